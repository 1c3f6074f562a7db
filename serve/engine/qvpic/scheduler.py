"""Admission: which waiting requests join the batch at the next step, under its caps.

Requests wait in FIFO order and join while the batch holds fewer than `max_batch_size` rows and the
KV slab *as it will be laid out* stays under `max_kv_nbytes`: every row reserves the columns it can
ever fill (prompt, its query's pad slots, every decoded token but the last), and a slab is as wide as
its widest row, so the projection is rows × widest reservation × bytes per column (on CUDA the rows its allocation
holds, padding rows included: serve/engine/qvpic/shapes.py). A request that
cannot fit even alone is refused at once (413); when the queue itself is full the request is refused
with 503 and Retry-After, so Serve's own queue (the generator's `max_ongoing_requests`) holds the rest
instead of this replica's memory. Joins are also spread over steps (`max_prefill_tokens` forwarded per
step, and one full prefill), so a burst of arrivals does not stall the running rows for one long prefill.
A linked request counts its query tokens only: its context's KV is copied into the slab, not computed,
so a burst of linked requests joins in one step (counting contexts held 16 concurrent requests of 1k
context tokens to 7 a step and doubled their TTFT).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from schemas.config import EngineConfig
from schemas.errors import BusyError, TooLargeError
from serve.engine.sequence import Sequence

ONLINE_PREFILLS_PER_STEP = 1  # a full prefill (online modes) is long: one per step keeps decode moving


class Scheduler:
    def __init__(self, config: EngineConfig, column_nbytes: int, slab_rows: Callable[[int], int] = lambda rows: rows):
        self.config = config
        self.column_nbytes = column_nbytes  # one row's KV for one token, every layer, keys and values
        # the rows a slab of n rows allocates (on CUDA its padding rows too: serve/engine/qvpic/shapes.py): counted
        self.slab_rows = slab_rows
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in slab row order
        self.reserved: dict[int, int] = {}  # sequence id -> columns reserved when it joined

    def add(self, seq: Sequence) -> None:
        rows = len(seq.members)  # n choices: n rows of its reservation
        nbytes = self.slab_rows(rows) * seq.max_columns * self.column_nbytes
        if nbytes > self.config.max_kv_nbytes:
            raise TooLargeError(f"the request needs {nbytes} bytes of KV ({rows} × {seq.max_columns} tokens); this "
                                f"generator's batch holds at most {self.config.max_kv_nbytes} (max_kv_nbytes)")
        if rows > self.config.max_batch_size:
            raise TooLargeError(f"the request asks for {rows} choices; this generator's batch holds at most "
                                f"{self.config.max_batch_size} rows (max_batch_size)")
        if len(self.waiting) >= self.config.max_waiting:
            raise BusyError(f"the generator is full ({len(self.running)} running, {len(self.waiting)} waiting); "
                            "retry shortly", self.retry_after_s())
        self.waiting.append(seq)

    def schedule(self) -> list[Sequence]:
        """Pop the waiting requests that join now, in FIFO order."""
        joining: list[Sequence] = []
        prompt_tokens = 0
        while self.waiting:
            candidate = self.waiting[0]
            online = sum(s.context.online for s in joining)
            if candidate.context.online and online >= ONLINE_PREFILLS_PER_STEP:
                break
            if joining and prompt_tokens + candidate.num_prefill_tokens > self.config.max_prefill_tokens:
                break
            if not self._fits(joining + [candidate]):
                break
            prompt_tokens += candidate.num_prefill_tokens
            joining.append(self.waiting.popleft())
        return joining

    def join(self, seqs: list[Sequence], reserved: dict[int, int]) -> None:
        self.running += seqs
        self.reserved.update(reserved)

    def leave(self, gone: set[int]) -> None:
        self.running = [s for s in self.running if s.id not in gone]
        for seq_id in gone:
            self.reserved.pop(seq_id, None)

    def capacity(self) -> int:
        """Columns the slab of the running rows needs."""
        return max((self.reserved[s.id] for s in self.running), default=0)

    # ---- the caps ----------------------------------------------------------------------------------
    def reservations(self, joining: list[Sequence]) -> dict[int, int]:
        """Columns each joining request reserves: linked queries are left-padded to the longest one."""
        longest = max((s.num_query_tokens for s in joining if not s.context.online), default=0)
        return {s.id: s.max_columns + (0 if s.context.online else longest - s.num_query_tokens) for s in joining}

    def _fits(self, joining: list[Sequence]) -> bool:
        rows = len(self.running) + sum(len(s.members) for s in joining)
        if rows > self.config.max_batch_size:
            return False
        columns = max(self.capacity(), *self.reservations(joining).values())
        return self.slab_rows(rows) * columns * self.column_nbytes <= self.config.max_kv_nbytes

    def retry_after_s(self) -> float:
        """A guess at when a row frees up: the running requests' remaining tokens at ~20 tokens/s each."""
        remaining = min((s.sampling.max_new_tokens - len(s.token_ids) for s in self.running), default=0)
        return max(1.0, math.ceil(remaining / 20))
