"""Each step's token choice, as part of `QvpicEngine` (serve/engine/qvpic/engine.py): every row's next token picked
from its logits (greedy, sampled, penalised, constrained) on the device and read back together — the step's one
device→host transfer — then emitted, or its sequence ends. A row whose own work raises fails alone.

A mixin, not a class of its own: it works on the engine's model, sampler and counters and ends rows through the
engine's `_finish`; it holds no state of its own.
"""

from __future__ import annotations

import logging

import torch

from pipeline.runtime import ms_since
from serve.engine.sequence import End, Sequence, Status

log = logging.getLogger(__name__)


class Picks:
    """The engine's token choice (see the module's docstring)."""

    def _pick(self, seqs: list[Sequence], logits: torch.Tensor, prefill_started: float | None = None,
              decode_started: float | None = None) -> None:
        """Each sequence's next token from its logits row `[vocab]`: emitted, or the sequence ends. Every row's
        choice (greedy, sampled, penalised, constrained) is made on the device and read back together: the step's
        one device→host transfer, which also waits for the step's work (so its time needs no second wait)."""
        picking: list[tuple[Sequence, int]] = []  # each sequence that picks, and its logits row
        for index, leader in enumerate(seqs):
            if prefill_started is None:
                picking.append((leader, index))
                continue
            for seq in leader.members:  # a fork's first token comes from its leader's prefill, with its own sampler
                seq.status = Status.RUNNING
                if seq is not leader:
                    seq.resumed, seq.num_prompt_tokens = leader.resumed, leader.num_prompt_tokens
                    seq.prefix_cached_tokens, seq.queue_ms = leader.prefix_cached_tokens, leader.queue_ms
                    seq.reanchor_ms = leader.reanchor_ms
                picking.append((seq, index))
        best = logits.argmax(-1)  # [rows]: every greedy row's at once
        chosen: list[torch.Tensor | None] = []
        failed: dict[int, Exception] = {}  # position in `picking` -> the exception its own work raised
        for position, (seq, index) in enumerate(picking):
            try:  # one row's controls (its grammar's mask, its penalties, a NaN guard) may raise: that row's alone
                if self.on_logits is not None:
                    self.on_logits(seq, logits[index])
                chosen.append(self.sampler.choose(seq, logits[index]))
            except Exception as error:  # noqa: BLE001  failed below, the other rows keep their choices
                failed[position] = error
                chosen.append(None)  # a placeholder: its token is never emitted
        if len(picking) == len(seqs) and all(c is None for c in chosen):
            tokens = best.tolist()
        else:
            tokens = torch.stack([best[index] if c is None else c for c, (_, index) in zip(chosen, picking)]).tolist()
        elapsed_ms = ms_since(prefill_started if prefill_started is not None else decode_started, self.vlm.device,
                              synced=True)
        for position, ((seq, index), token) in enumerate(zip(picking, tokens)):
            if prefill_started is None:
                seq.decode_ms += elapsed_ms
            else:
                seq.prefill_ms = elapsed_ms
            if position in failed:
                self._fail_row(seq, failed[position])
                continue
            try:
                self._emit(seq, logits[index], token)
            except Exception as error:  # noqa: BLE001  its logprobs, grammar or stop strings: this row's alone
                self._fail_row(seq, error)

    def _fail_row(self, seq: Sequence, error: Exception) -> None:
        """A row whose own work in a step raised ends with it (End.FAILED), alone (issue 60): the step's forward and
        every other row's choice were made without touching its state (each row's sampler, grammar and stop matcher
        are its own), so the others go on with exactly the tokens they would have had without it. It leaves the
        batch at the next `_retire`, like a finished row; its blocks are not kept (not a STOP or LENGTH end)."""
        log.warning("request %d failed in a step: %r", seq.id, error)
        self._finish(seq, End.FAILED, error)

    def _emit(self, seq: Sequence, row: torch.Tensor, token: int) -> None:
        """`token`, chosen from `seq`'s logits row `[vocab]`: delivered, or it ends the sequence."""
        self.sampler.logprobs(seq, row, token)
        if self.sampler.ends_turn(seq, token):
            self._finish(seq, End.STOP)
            return
        seq.token_ids.append(token)
        self.decoded_tokens += 1
        seq.deliver(token)
        if (end := self.sampler.ending(seq, token)) is not None:
            self._finish(seq, end)
