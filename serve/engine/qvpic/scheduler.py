"""Admission: which waiting requests join the batch at the next step, under its caps.

Requests wait in FIFO order and join while the batch holds fewer than `max_batch_size` rows and the
KV slab *as it will be laid out* stays under `max_kv_nbytes`: every row reserves the columns it can
ever fill (prompt, its query's pad slots, every decoded token but the last), and a slab is as wide as
its widest row, so the projection is rows × widest reservation × bytes per column (on CUDA the rows its allocation
holds, padding rows included: serve/engine/qvpic/shapes.py). A request that
cannot fit even alone is refused at once (413); when the queue itself is full the request is refused
with 503 and Retry-After, so Serve's own queue (the generator's `max_ongoing_requests`) holds the rest
instead of this replica's memory.

A step's prefills cost at most `max_prefill_tokens` tokens' work, so no arrival stalls the running rows (or another
tenant's next join) for longer than that takes. A token's work grows with the columns it reads: its attention adds
`column_cost` of a token per column (`prefill_cost`), ~0.03 per 1,000 columns on a 7B model, ~3.5 on the tiny test
models (64 hidden units), whose long prompts are mostly attention. So:
- joins are spread over steps, and one full prefill (an online mode's) per step;
- a linked prompt whose texts pass the budget is prefilled in pieces, one per step
  (serve/engine/qvpic/pieces.py), one such prompt at a time: while it is, the requests that join whole go first and
  take at most three quarters of the budget, and its piece takes the rest (at least a quarter, so it always ends).
  A second long prompt waits its turn without holding back the shorter ones queued behind it. A prompt with an
  image in its last text, and a full prefill, are forwarded whole: they can be longer than the budget.
A linked request counts its texts only (serve/engine/prepared.py `num_query_tokens`): its chunks' KV is copied into
the slab, not computed, so a burst of linked requests joins in one step (counting contexts held 16 concurrent
requests of 1k context tokens to 7 a step and doubled their TTFT).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from schemas.config import EngineConfig
from schemas.errors import BusyError, TooLargeError
from serve.engine.sequence import Sequence

ONLINE_PREFILLS_PER_STEP = 1  # a full prefill (online modes) is long: one per step keeps decode moving


def column_cost(text_config) -> float:
    """A token's attention per column it reads, as a share of its other work in a layer (a transformers text config).

    Multiply-adds a token costs in one decoder layer: its projections `d·(H + 2·KV)·hd + H·hd·d` and the gated MLP's
    `3·d·I` (d hidden units, H query and KV key-value heads of hd, I the MLP's width), and for each column it reads
    `2·H·hd` (a score and a weighted value per head dimension)."""
    d, heads = text_config.hidden_size, text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or d // heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    linear = d * (heads + 2 * kv_heads) * head_dim + heads * head_dim * d + 3 * d * text_config.intermediate_size
    return 2 * heads * head_dim / linear


def prefill_cost(tokens: int, columns: int, per_column: float) -> float:
    """`tokens` new tokens reading up to `columns` columns each, in tokens of work at no context."""
    return tokens * (1 + columns * per_column)


class Scheduler:
    def __init__(self, config: EngineConfig, column_nbytes: int, slab_rows: Callable[[int], int] = lambda rows: rows,
                 per_column: float = 0.0):
        self.config = config
        self.per_column = per_column  # a token's attention per column it reads, in tokens (`column_cost`)
        self.column_nbytes = column_nbytes  # one row's KV for one token, every layer, keys and values
        # the rows a slab of n rows allocates (on CUDA its padding rows too: serve/engine/qvpic/shapes.py): counted
        self.slab_rows = slab_rows
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in slab row order
        self.reserved: dict[int, int] = {}  # sequence id -> columns reserved when it joined
        self.prefilling: Sequence | None = None  # the prompt being prefilled in pieces: not in `waiting` or `running`
        self.whole_cost = 0.0  # the work of the requests joining whole at this step, in tokens (`schedule`)

    @property
    def busy(self) -> bool:
        """Anything left to step: a request waiting, prefilling in pieces or running."""
        return bool(self.waiting or self.running or self.prefilling is not None)

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
        """Pop the waiting requests that join now, in FIFO order: those that join whole, within the step's budget, and
        at most one to be prefilled in pieces (`in_pieces`), when no other is."""
        joining: list[Sequence] = []
        budget, self.whole_cost = self.config.max_prefill_tokens, 0.0
        pieces = self.prefilling is not None
        for candidate in list(self.waiting):
            long = self.in_pieces(candidate)
            if long and pieces:
                continue  # waits for the prompt being prefilled in pieces; shorter requests behind it go on
            online = sum(s.context.online for s in joining)
            if candidate.context.online and online >= ONLINE_PREFILLS_PER_STEP:
                break
            room = budget - budget // 4 if pieces else budget
            cost = self.cost(candidate)
            # the first to join whole always does (one longer than the budget that cannot be cut: alone), unless a
            # prompt in pieces holds its quarter
            if not long and (joining or pieces) and self.whole_cost + cost > room:
                break
            if not self._fits(joining + [candidate]):
                break
            self.waiting.remove(candidate)
            joining.append(candidate)
            if long:
                pieces = True
            else:
                self.whole_cost += cost
        return joining

    def cost(self, seq: Sequence) -> float:
        """A join's work, in tokens: the tokens it forwards, each reading at most its whole prompt."""
        return prefill_cost(seq.num_prefill_tokens, seq.num_prompt_tokens, self.per_column)

    def in_pieces(self, seq: Sequence) -> bool:
        """Prefilled over several steps: a linked prompt whose texts cost more than the step's budget (one with an
        image in its last text is forwarded whole, with its pixels, and so is a full prefill)."""
        return (not seq.context.online and not seq.context.after.image_spans
                and self.cost(seq) > self.config.max_prefill_tokens)

    def piece_budget(self) -> float:
        """The work the prompt being prefilled in pieces may do at this step, in tokens: what the whole joins left."""
        return max(self.config.max_prefill_tokens - self.whole_cost, 0.0)

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
        if self.prefilling is not None:  # its rows and columns are held from its first piece
            joining = [self.prefilling, *joining]
        rows = len(self.running) + sum(len(s.members) for s in joining)
        if rows > self.config.max_batch_size:
            return False
        columns = max(self.capacity(), *self.reservations(joining).values())
        return self.slab_rows(rows) * columns * self.column_nbytes <= self.config.max_kv_nbytes

    def retry_after_s(self) -> float:
        """A guess at when a row frees up: the running requests' remaining tokens at ~20 tokens/s each."""
        remaining = min((s.sampling.max_new_tokens - len(s.token_ids) for s in self.running), default=0)
        return max(1.0, math.ceil(remaining / 20))
