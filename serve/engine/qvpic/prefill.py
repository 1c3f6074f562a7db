"""The admit step's prefills, as part of `QvpicEngine` (serve/engine/qvpic/engine.py): the joining requests'
prompts resumed from the prefix cache, then what is new prefilled — linked prompts' text tails in one forward,
those with images and the online (full-prompt) baselines alone, and one longer than a step's budget in pieces over
the steps that follow (serve/engine/qvpic/pieces.py) — and each one's first token picked.

A mixin, not a class of its own: it works on the engine's model, prefix cache, sampler, scheduler and metrics, keeps
the prompt in pieces in the engine's `pieces`, and ends in the engine's `_pick`, `_join` and `_finish`.
"""

from __future__ import annotations

import logging
import time

import torch

from pipeline.runtime import ms_since
from pipeline.runtime.conversation import PreparedSegment
from serve.engine.prepared import LinkedPrompt
from serve.engine.qvpic.batch import Slab, lay_out, prefill_alone, prefill_queries
from serve.engine.qvpic.linked_prompt import Resumed, resume
from serve.engine.qvpic.pieces import Pieces
from serve.engine.qvpic.scheduler import prefill_cost
from serve.engine.sequence import End, Sequence, Status

log = logging.getLogger(__name__)


class Prefills:
    """The engine's prefill steps (see the module's docstring)."""

    def _prefill(self, seqs: list[Sequence]) -> tuple[list[Slab], list[Sequence]]:
        linked = [s for s in seqs if not s.context.online]
        slabs, linked = self._prefill_linked(linked) if linked else ([], [])
        online = [s for s in seqs if s.context.online]
        return slabs + [self._prefill_online(s) for s in online], linked + online

    def _prefill_each(self, seqs: list[Sequence]) -> tuple[list[Slab], list[Sequence]]:
        """The joining requests prefilled together; when that raises (one request's exception, or out of memory on
        its prefill), each again alone, and only those that raise alone fail (End.FAILED with their error): one
        tenant's bad request no longer ends the other tenants' rows, running or joining (issue 60). A request that
        already had its first token when the group failed cannot be replayed: it fails too."""
        try:
            return self._prefill(seqs)
        except Exception as error:  # noqa: BLE001  attributed below, request by request
            if len(seqs) == 1:
                self._fail_joining(seqs[0], error)
                return [], []
            log.warning("a batched prefill of %d requests failed (%s); prefilling each alone", len(seqs), error)
        slabs, joined = [], []
        for seq in seqs:
            if seq.status is not Status.WAITING:  # its first token went out before the group failed
                self._fail_joining(seq, RuntimeError("a prefill beside this request's failed after its first token"))
                continue
            try:
                alone, order = self._prefill([seq])
            except Exception as error:  # noqa: BLE001  this request's own failure
                self._fail_joining(seq, error)
                continue
            slabs += alone
            joined += order
        return slabs, joined

    def _fail_joining(self, seq: Sequence, error: Exception) -> None:
        """A joining request whose prefill raised ends with it, every choice (its rows never joined the slab)."""
        log.warning("request %d failed at its prefill: %r", seq.id, error)
        if self.pieces is not None and self.pieces.seq is seq:  # laid out for pieces before it failed
            self._end_pieces()
        for member in seq.members:
            self._finish(member, End.FAILED, error)
            self.sampler.forget(member.id)
        seq.prompt_logits = None

    def _prefill_linked(self, seqs: list[Sequence]) -> tuple[list[Slab], list[Sequence]]:
        """Each prompt resumed from the prefix cache, then the text-only tails prefilled in one forward and those
        holding images alone. The slabs, and the sequences in their row order."""
        started = time.perf_counter()
        for seq in seqs:
            context = seq.context
            # Texts before the last group are computed in the batched forward (holes) unless the row is prefilled
            # alone (an image in its last text) or recomputes chunk tokens (they would attend to unwritten runs).
            seq.resumed = resume(self.vlm, self.prefix_cache, context.salt, context.prompt,
                                 past_groups=context.recompute is None,
                                 defer_texts=context.recompute is None and not context.prompt.after.image_spans,
                                 final_logits=self.config.prefix_cache.final_logits)
            seq.num_prompt_tokens = context.prompt.num_tokens
            self._count_prefix(seq)
        head_ms = ms_since(started, self.vlm.device)
        cached = [s for s in seqs if s.resumed.logits is not None]  # whole prompt and its logits: no forward
        batched = [s for s in seqs if s.resumed.logits is None and not s.resumed.tail.image_spans]
        alone = [s for s in seqs if s.resumed.logits is None and s.resumed.tail.image_spans]
        # one the scheduler picked to cut, unless the prefix cache left it less than this step's piece
        budget, per_column = self.scheduler.piece_budget(), self.scheduler.per_column
        pieced = [s for s in batched if self.scheduler.in_pieces(s)
                  and prefill_cost(new_tokens(s), s.num_prompt_tokens, per_column) > budget]
        batched = [s for s in batched if s not in pieced]
        for seq in pieced:
            self._start_pieces(seq)
        slabs = []
        if cached:
            started = time.perf_counter()
            slabs.append(Slab.of_cached([s.resumed.base for s in cached],
                                        [s.sampling.max_new_tokens - 1 for s in cached]))
            self._pick(cached, torch.stack([s.resumed.logits for s in cached]),
                       prefill_started=started - head_ms / 1e3)
        if batched:
            started = time.perf_counter()
            slab, logits, assembly_ms = prefill_queries(
                self.vlm, [s.resumed.base for s in batched], [s.resumed.chunks for s in batched],
                [s.resumed.tail.ids for s in batched], [s.sampling.max_new_tokens - 1 for s in batched],
                [s.context.recompute for s in batched], [s.resumed.holes for s in batched])
            for seq, reanchor_ms, row in zip(batched, assembly_ms, logits):
                seq.reanchor_ms = reanchor_ms
                self._keep_logits(seq, row)
            self._pick(batched, logits, prefill_started=started + sum(assembly_ms) / 1e3 - head_ms / 1e3)
            slabs.append(slab)
        for seq in alone:
            started = time.perf_counter()
            slab, logits = prefill_alone(self.vlm, seq.resumed.base, seq.resumed.chunks, seq.resumed.tail,
                                         seq.sampling.max_new_tokens - 1)
            self._keep_logits(seq, logits[0])
            self._pick([seq], logits, prefill_started=started - head_ms / 1e3)
            slabs.append(slab)
        return slabs, cached + batched + alone

    def _start_pieces(self, seq: Sequence) -> None:
        """`seq`'s row laid out (context assembled, chunks linked, chunk tokens recomputed) in a slab of its own; its
        new tokens are forwarded from this step on, a piece per step (`_piece`)."""
        resumed = seq.resumed
        layout = lay_out(self.vlm, [resumed.base], [resumed.chunks], [resumed.tail.ids],
                         [seq.sampling.max_new_tokens - 1], [seq.context.recompute], [resumed.holes])
        seq.reanchor_ms = layout.assembly_ms[0]
        with self._work:
            self.pieces = Pieces(seq, layout)
            self.scheduler.prefilling = seq

    def _piece(self) -> None:
        """The prompt being prefilled in pieces forwards its next one, with what the step's budget left; after its
        last, its first token is picked and it joins the batch. A piece that raises fails that request alone."""
        pieces, budget = self.pieces, self.scheduler.piece_budget()
        if pieces is None or budget < 1:
            return
        seq = pieces.seq
        try:
            logits = pieces.forward(self.vlm, pieces.size(budget, self.scheduler.per_column))
        except Exception as error:  # noqa: BLE001  its own: the running rows go on
            self._fail_joining(seq, error)
            return
        if logits is None:
            return
        self._keep_logits(seq, logits[0])
        self._pick([seq], logits, prefill_started=pieces.started)
        self._end_pieces()
        self._join([pieces.layout.slab], [seq])

    def _end_pieces(self) -> None:
        with self._work:
            self.pieces, self.scheduler.prefilling = None, None

    def _keep_logits(self, seq: Sequence, row: torch.Tensor) -> None:
        """The prompt's last-column logits `[vocab]`, kept until the row is stored (before any sampler sees them).
        Not a row with recomputed chunk tokens: its logits are not those of the chunk KV its keys name."""
        if self.prefix_cache.enabled and self.config.prefix_cache.final_logits and seq.context.recompute is None:
            seq.prompt_logits = row.detach().clone()

    def _count_prefix(self, seq: Sequence) -> None:
        seq.prefix_cached_tokens = seq.resumed.cached_columns
        self.metrics.prefix_cache_tokens.inc(seq.prefix_cached_tokens, outcome="hit")
        self.metrics.prefix_cache_tokens.inc(seq.num_prompt_tokens - seq.prefix_cached_tokens, outcome="computed")

    def _prefill_online(self, seq: Sequence) -> Slab:
        """The whole prompt as one causal stream, resumed from the prefix cache as vLLM's would be (a baseline
        measured without it would flatter the linked modes on repeated prompts), the rest prefilled alone."""
        started = time.perf_counter()
        context = seq.context
        whole = self.vlm.online_segment(context.texts, context.groups)
        prompt = LinkedPrompt([PreparedSegment([]), whole], [[]], [[]])  # no linked chunks: one empty group
        seq.resumed = resume(self.vlm, self.prefix_cache, context.salt, prompt)
        seq.num_prompt_tokens = whole.num_tokens
        self._count_prefix(seq)
        slab, logits = prefill_alone(self.vlm, seq.resumed.base, [], seq.resumed.tail, seq.sampling.max_new_tokens - 1)
        self._pick([seq], logits, prefill_started=started)
        return slab


def new_tokens(seq: Sequence) -> int:
    """Tokens a resumed linked prompt forwards: its holes' text runs and its tail."""
    resumed: Resumed = seq.resumed
    return sum(h.text.num_tokens for h in resumed.holes) + len(resumed.tail.ids)
