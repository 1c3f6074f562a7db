"""qvpic's engine (an `Engine`: serve/engine/interface.py): one thread owns the model and runs every request's
forward passes as one batch.

    step = retire   cancelled, expired and finished rows leave the batch; their KV is freed
         → admit    waiting requests that fit the caps are prefilled together and join
         → piece    a prompt longer than a step's budget forwards its next piece; after its last, it joins
         → decode   one forward for every row; each gets its next token

A request joins at the step after it arrives and leaves at the step after it ends, so a client that
goes away costs at most one more step. The model lock is held per step: the generator's repair path
(recompiling an unreadable entry) takes it between steps, so forward passes never overlap.

The admit step's prefills are in prefill.py and each step's token choice in pick.py (mixins of this class).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

import torch

from pipeline.runtime import VLM
from schemas.config import EngineConfig
from serve.engine.interface import Engine, EngineStats, step_failure
from serve.engine.kv_budget import sized
from serve.engine.qvpic.batch import Slab, decode_step
from serve.engine.qvpic.linked_prompt import store
from serve.engine.qvpic.pick import Picks
from serve.engine.qvpic.pieces import Pieces
from serve.engine.qvpic.prefill import Prefills
from serve.engine.qvpic.prefix_cache import PrefixCache
from serve.engine.qvpic.sampler import Sampler
from serve.engine.qvpic.scheduler import Scheduler, column_cost
from serve.engine.qvpic.shapes import slab_rows
from serve.engine.qvpic.slab_memory import SLAB_MEMORY
from serve.engine.sequence import End, Sequence, Status
from serve.engine.stops import StopMatcher
from serve.metrics import serve_metrics

log = logging.getLogger(__name__)


def column_nbytes(vlm: VLM) -> int:
    """KV bytes of one token of one row: every layer's keys and values."""
    layers, _, heads, _, head_dim = vlm.prefix.kv.shape
    return layers * 2 * heads * head_dim * torch.finfo(vlm.dtype).bits // 8


class QvpicEngine(Prefills, Picks, Engine):
    """qvpic's engine (serve/engine/interface.py states the contract it keeps)."""

    def __init__(self, vlm: VLM, config: EngineConfig, start: bool = True,
                 on_logits: Callable[[Sequence, torch.Tensor], None] | None = None):
        vlm.use_forward(config.forward)
        if config.max_kv_nbytes is None:  # left to the device: measured now, the weights loaded in their forward's
            config = sized(config, vlm.device)  # form and nothing of the engine's allocated yet
            log.info("the batch's KV cap on %s: %.2f GiB", vlm.device, config.max_kv_nbytes / (1 << 30))
        self.vlm, self.config = vlm, config
        SLAB_MEMORY.max_free_nbytes = config.slab_reuse_nbytes  # the process's slabs (one engine per generator)
        self.metrics = serve_metrics()
        self.scheduler = Scheduler(config, column_nbytes(vlm), functools.partial(slab_rows, device=vlm.device),
                                   column_cost(vlm.model.config.get_text_config()))
        cache = config.prefix_cache
        self.prefix_cache = PrefixCache(cache.block_tokens, cache.device_nbytes, cache.host_nbytes, vlm.device)
        self.slab: Slab | None = None  # rows aligned with scheduler.running
        self.model_lock = threading.Lock()
        self.on_logits = on_logits  # tests: every logits row a sequence's token was picked from
        self.steps = self.decoded_tokens = 0
        self.ended: Counter[str] = Counter()  # requests by how they ended
        self._work = threading.Condition()
        self.sampler = Sampler(vlm)  # each row's next token under its request's decoding controls
        self._joining: list[Sequence] = []
        self.pieces: Pieces | None = None  # the prompt being prefilled in pieces (serve/engine/qvpic/pieces.py)
        self.forward_threads = torch.get_num_threads()  # the loop's own, once it runs (pipeline/runtime/threads.py)
        if start:
            threading.Thread(target=self._loop, name="qvpic-engine", daemon=True).start()

    # ---- the request's side ------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue `seq` and its forks: their grammars and stop strings made first (InvalidRequestError: a grammar
        llguidance cannot compile), then the caps (TooLargeError: it can never fit; BusyError: the queue is full)."""
        tokenizer = self.vlm.tokenizer
        compiled: dict[str, object] = {}  # grammar text -> its matcher: n choices compile it once, then copy it
        for member in seq.members:
            sampling = member.sampling
            if sampling.grammar is not None:
                if (first := compiled.get(sampling.grammar)) is not None:
                    member.grammar = first.deep_copy()
                else:
                    member.grammar = compiled[sampling.grammar] = self.sampler.grammars.matcher(
                        sampling.grammar, sampling.grammar_param)
            if sampling.stop:  # a completed match ends decoding (the generator's own matcher cuts the text alike)
                member.stops = StopMatcher(tokenizer, sampling.stop, skip_special_tokens=sampling.skip_special_tokens)
        with self._work:
            self.scheduler.add(seq)
            self._work.notify()

    def abort(self, seq: Sequence) -> None:
        """Drop `seq` at the next step (a no-op once it finished)."""
        if seq.status is not Status.FINISHED:
            seq.cancel()
            with self._work:
                self._work.notify()

    def clear_prefix_cache(self, timeout_s: float = 10.0) -> None:
        """Drop the prefix KV cache (a cold measurement). A finished request's blocks are kept at the engine's next
        step, after its answer was delivered: wait for that first, or they would land in the cache just cleared
        (the next "cold" request would find them — a race the generator tests lost about one run in four)."""
        self.settle(timeout_s)
        with self.model_lock:
            self.prefix_cache.clear()

    def settle(self, timeout_s: float = 10.0) -> bool:
        """Wait until every finished request's blocks are in the prefix cache (they are kept at the engine's next
        step, after the answer was delivered). False if some were still pending after `timeout_s`."""
        with self._work:
            return self._work.wait_for(lambda: not any(s.status is Status.FINISHED for s in self.scheduler.running),
                                       timeout=timeout_s)

    def stats(self) -> EngineStats:
        with self._work:
            prefilling = sum(len(seq.members) for seq in self._joining)  # out of `waiting`, not yet in the batch
            prefilling += len(self.pieces.seq.members) if self.pieces is not None else 0
            return EngineStats(len(self.scheduler.running) + prefilling, len(self.scheduler.waiting),
                               self.slab.nbytes if self.slab is not None else 0, self.steps, self.decoded_tokens,
                               dict(self.ended), self.forward_threads, dataclasses.replace(self.prefix_cache.stats))

    # ---- the engine's thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        self.forward_threads = torch.get_num_threads()  # per thread: the generator's event loop runs on one
        while True:
            with self._work:
                while not self.scheduler.busy:
                    self._work.wait()
            try:
                with self.model_lock:
                    self.step()
            except Exception as error:  # noqa: BLE001  fail the requests in flight, keep serving
                log.exception("engine step failed; the requests in flight end with it")
                self._fail(error)
            self._export()

    def step(self) -> None:
        self._retire()
        self._admit()
        self._piece()
        if self.scheduler.running:
            self._decode()
        self.steps += 1

    def _retire(self) -> None:
        now = time.monotonic()
        with self._work:
            for seq in [s for s in self.scheduler.waiting if s.cancelled or s.expired(now)]:
                self.scheduler.waiting.remove(seq)
                for member in seq.members:  # its forks never joined either
                    self._finish(member, End.CANCELLED if seq.cancelled else End.DEADLINE)
        if self.pieces is not None and ((seq := self.pieces.seq).cancelled or seq.expired(now)):
            self._end_pieces()  # its own slab goes with it
            for member in seq.members:
                self._finish(member, End.CANCELLED if seq.cancelled else End.DEADLINE)
        gone = set()
        for seq in self.scheduler.running:
            if seq.status is not Status.FINISHED and (seq.cancelled or seq.expired(now)):
                self._finish(seq, End.CANCELLED if seq.cancelled else End.DEADLINE)
            if seq.status is Status.FINISHED:
                gone.add(seq.id)
        if gone:
            self._keep_prefixes(gone)
            kept = [row for row, s in enumerate(self.scheduler.running) if s.id not in gone]
            with self._work:
                self.scheduler.leave(gone)
                self.slab = self.slab.keep(kept, self.scheduler.capacity()) if kept else None
                self._work.notify_all()  # clear_prefix_cache may be waiting for these rows' prefixes to be kept
            for seq_id in gone:
                self.sampler.forget(seq_id)

    def _admit(self) -> None:
        with self._work:
            self._joining = self.scheduler.schedule()
        if not self._joining:
            return
        now = time.monotonic()
        for seq in self._joining:
            seq.queue_ms = (now - seq.submitted_at) * 1e3
        slabs, joining = self._prefill_each(self._joining)  # the new slabs, and the requests in their row order
        self._join(slabs, joining)

    def _join(self, slabs: list[Slab], joining: list[Sequence]) -> None:
        """Prefilled requests (each with its first token) join the batch: their slabs merged after the running rows'.
        A request that ended at once (EOS, one token) keeps its prompt's blocks and leaves again."""
        if not joining:  # every one failed at its prefill (or is being prefilled in pieces): the rows go on
            with self._work:
                self._joining = []
            return
        if any(s.forks for s in joining):  # n choices: each fork's row a copy of its leader's prompt KV
            index = [row for row, seq in enumerate(joining) for _ in seq.members]
            capacity = max(slab.capacity for slab in slabs)
            slabs = [Slab.merge(slabs, capacity).keep(index, capacity)]
            joining = [member for seq in joining for member in seq.members]
        # Each row reserves what it can still fill: its prompt as laid out, then max_new_tokens - 1 tokens.
        lengths = [n for slab in slabs for n in slab.host_lengths]
        reserved = {s.id: length + s.sampling.max_new_tokens - 1 for s, length in zip(joining, lengths)}
        rows = self.scheduler.running + joining  # the merged slab's row order
        live = [s for s in joining if s.status is not Status.FINISHED]  # not done at once (EOS, 1 token)
        if len(live) < len(joining):  # done at once: their prompt KV goes into the prefix cache from here
            new_rows = [(slab, row) for slab in slabs for row in range(len(slab.lengths))]  # aligned with joining
            for (slab, row), seq in zip(new_rows, joining):
                if seq.status is Status.FINISHED:
                    self._store_row(slab, row, seq)
        with self._work:
            self._joining = []
            if not live:
                return
            self.scheduler.join(live, {s.id: reserved[s.id] for s in live})
            slab = Slab.merge(([self.slab] if self.slab is not None else []) + slabs,
                              max(self.scheduler.capacity(), *reserved.values()))
            if len(live) < len(joining):
                slab = slab.keep([r for r, s in enumerate(rows) if s.status is not Status.FINISHED],
                                 self.scheduler.capacity())
            self.slab = slab

    def _store_row(self, slab: Slab, row: int, seq: Sequence) -> None:
        """A row that ended well: its blocks (prompt, then the tokens fed back) into the prefix cache."""
        prompt_logits, seq.prompt_logits = seq.prompt_logits, None
        if not self.prefix_cache.enabled or seq.end not in (End.STOP, End.LENGTH) or seq.resumed is None:
            return
        # the row's real columns, from the slab's host bookkeeping (reading `valid` back would drain the stream)
        length, (start, stop) = slab.host_lengths[row], slab.host_pads[row]
        kv = slab.kv[:, :, row, :, :length]  # [layers, 2, kv_heads, columns, head_dim]: no pad slot inside, a view
        if stop > start:  # without its pad slots (the cache copies only its new blocks either way)
            kv = torch.cat([kv[:, :, :, :start], kv[:, :, :, stop:]], dim=3)
        store(self.vlm, self.prefix_cache, seq.context.salt, seq.resumed, kv, seq.token_ids,
              slab.host_next_positions[row], prompt_logits)

    def _keep_prefixes(self, gone: set[int]) -> None:
        """Blocks of the rows that ended well go into the prefix cache: a follow-up turn (or the same
        request again) finds them, decoded tokens included."""
        if self.slab is None or not self.prefix_cache.enabled:
            return
        for row, seq in enumerate(self.scheduler.running):
            if seq.id in gone:
                self._store_row(self.slab, row, seq)
        stats = self.prefix_cache.stats
        self.metrics.prefix_cache_device_nbytes.set(stats.device_nbytes)
        self.metrics.prefix_cache_host_nbytes.set(stats.host_nbytes)
        self.metrics.prefix_cache_evictions.set(stats.evicted_blocks)

    def _decode(self) -> None:
        started = time.perf_counter()
        rows = self.scheduler.running
        logits = decode_step(self.vlm, self.slab, [s.pending_token for s in rows])
        self._pick(rows, logits, decode_started=started)

    def _finish(self, seq: Sequence, end: End, error: Exception | None = None) -> None:
        if seq.status is not Status.FINISHED:
            self.ended[end.value] += 1
            self.metrics.engine_ended.inc(end=end.value)
        seq.finish(end, error)

    def _export(self) -> None:
        stats = self.stats()
        self.metrics.engine_running.set(stats.running)
        self.metrics.engine_waiting.set(stats.waiting)
        self.metrics.engine_kv_bytes.set(stats.kv_nbytes)

    def _fail(self, error: Exception) -> None:
        """A step raised: every request in flight ends with it (`step_failure`: out of memory a 503 to retry); the
        engine starts over empty."""
        error = step_failure(error)
        with self._work:
            pieced = self.pieces.seq.members if self.pieces is not None else []
            for seq in self.scheduler.running + [m for s in self._joining for m in s.members] + pieced:
                self._finish(seq, End.FAILED, error)
            self.scheduler.leave({s.id for s in self.scheduler.running})
            self.slab, self._joining = None, []
            self.pieces, self.scheduler.prefilling = None, None
            self.sampler.forget()
