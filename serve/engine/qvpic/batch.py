"""Iteration-level batching on the model: many requests' ragged contexts in one forward pass.

Rows are requests. Their KV lives in one slab `[layers, 2, rows, kv_heads, capacity, head_dim]` whose
rows are left-aligned: row r fills columns `[0, lengths[r])` and its next token is written at column
`lengths[r]`, so rows never pad to each other's generated tokens and the slab is as wide as its
longest row will ever get (its capacity is reserved when rows join, so a decode step never copies
the cache, which transformers' DynamicCache does at every step). A joining request's context is
assembled (re-anchored) straight into its row. Attention reads the slab's first `width` columns
through an additive float mask in the
model dtype (0 = attend, finfo.min = blocked; a bool mask is silently wrong under eager attention)
that hides what a row has not written and the pad slots of its query. Positions are each row's own
explicit 3-D M-RoPE positions, so where a row sits in the slab changes nothing it computes: its
logits equal the same request's run alone (to float rounding).

    join:   prefill_queries(bases, chunks, queries) -> Slab of the new rows (assembled in place), first-token logits
            Slab.from_prefill(state)           -> a row whose prefill ran alone (online modes)
            Slab.merge([running, joined])      -> one slab
    step:   decode_step(slab, tokens)          -> next-token logits of every row
    leave:  slab.keep(rows)                    -> the slab without the rows that finished
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from pipeline.runtime.conversation import PreparedSegment
from pipeline.runtime.kv import AssembledContext, BlockRun, ChunkKV, assemble
from pipeline.runtime.model import VLM, Prefill
from pipeline.runtime.selective_recompute import ChunkInputs, recompute
from pipeline.runtime.timing import ms_since
from schemas.config import ChunkKind, RecomputeSpec
from serve.engine.qvpic.linked_prompt import Hole
from serve.engine.qvpic.slab_memory import SLAB_MEMORY


class SlabLayer(CacheLayerMixin):
    """One layer's view of the slab: `update` writes the new keys/values at each row's own columns, in place."""

    is_compileable = False
    supports_early_init = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, owner: Slab):
        super().__init__()
        self.keys, self.values = keys, values  # [rows, kv_heads, capacity, head_dim]
        # not a strong reference: a slab and its layers would form a cycle, and its memory (tens of MB to GB) would
        # wait for the cyclic collector instead of going back at once (to serve/engine/qvpic/slab_memory.py's pool)
        self.owner = weakref.proxy(owner)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("a slab is allocated before the forward pass")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        rows, columns, width = self.owner.rows_index, self.owner.write_columns, self.owner.width
        # keys[rows, :, columns] is [rows, new, kv_heads, head_dim]; the states are [rows, kv_heads, new, head_dim]
        self.keys[rows, :, columns] = key_states.transpose(1, 2).to(self.keys.dtype)
        self.values[rows, :, columns] = value_states.transpose(1, 2).to(self.values.dtype)
        return self.keys[:, :, :width], self.values[:, :, :width]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.width, 0

    def get_seq_length(self) -> int:
        return self.owner.width

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class Slab(Cache):
    """The KV of a batch of rows, the columns each has written, and where each continues."""

    def __init__(self, kv: torch.Tensor, valid: torch.Tensor, lengths: torch.Tensor, next_positions: torch.Tensor,
                 host_lengths: Sequence[int], host_next_positions: Sequence[int]):
        self.kv = kv  # [layers, 2, rows, kv_heads, capacity, head_dim]: one allocation, rows left-aligned
        super().__init__(layers=[SlabLayer(kv[i, 0], kv[i, 1], self) for i in range(kv.shape[0])])
        self.valid = valid  # [rows, capacity] bool: columns a row has written with a real token
        self.lengths = lengths  # [rows] long: the next column each row writes
        self.next_positions = next_positions  # [rows] long: the next token's position (equal on t/h/w)
        # The same two on the host, kept by the slab's own bookkeeping: a forward's width, the RoPE table's reach and
        # a copy's columns come from these, never from a read of the device's (each would drain its stream)
        self.host_lengths, self.host_next_positions = list(host_lengths), list(host_next_positions)
        self.write_columns = lengths[:, None]  # [rows, new] set before each forward
        self.width = 0  # columns the forward reads, set before it
        self.max_position = 0  # the forward's highest position (an upper bound), set before it
        # each row's pad slots' columns `[start, stop)` (a batched prefill's: the only columns below its length never
        # written with a real token), so a row's real KV is cut out without reading `valid` back
        self.host_pads: list[tuple[int, int]] = [(0, 0)] * len(self.host_lengths)
        self._last: tuple[list[int], list[int]] = ([], [])  # each row's last column and position this forward

    @classmethod
    def empty(cls, num_layers: int, num_rows: int, num_heads: int, capacity: int, head_dim: int,
              dtype: torch.dtype, device: torch.device, zeroed: bool = True) -> Slab:
        """Zeroed (unwritten columns are masked, and must hold finite numbers: 0 · NaN = NaN); `zeroed=False`
        for a caller that writes or zeroes every column itself."""
        # on a CPU, memory a gone slab held (no page faults at first touch: serve/engine/qvpic/slab_memory.py)
        kv = SLAB_MEMORY.empty((num_layers, 2, num_rows, num_heads, capacity, head_dim), dtype, device)
        if zeroed:
            kv.zero_()
        return cls(kv, torch.zeros(num_rows, capacity, dtype=torch.bool, device=device),
                   torch.zeros(num_rows, dtype=torch.long, device=device),
                   torch.zeros(num_rows, dtype=torch.long, device=device), [0] * num_rows, [0] * num_rows)

    def like(self, num_rows: int, capacity: int) -> Slab:
        num_layers, _, _, num_heads, _, head_dim = self.kv.shape
        return Slab.empty(num_layers, num_rows, num_heads, capacity, head_dim, self.kv.dtype, self.kv.device)

    @classmethod
    def from_prefill(cls, state: Prefill, reserve: int) -> Slab:
        """One row holding a batch-1 prefill's cache, with room for `reserve` more tokens."""
        first = state.cache.layers[0].keys  # [1, kv_heads, tokens, head_dim]
        length = first.shape[2]
        slab = cls.empty(len(state.cache.layers), 1, first.shape[1], length + reserve, first.shape[3], first.dtype,
                         first.device)
        for i, layer in enumerate(state.cache.layers):
            slab.kv[i, 0, :, :, :length] = layer.keys
            slab.kv[i, 1, :, :, :length] = layer.values
        slab.valid[0, :length] = True
        slab.lengths[0] = slab.host_lengths[0] = length
        slab.next_positions[0] = slab.host_next_positions[0] = state.next_position
        return slab

    @classmethod
    def of_cached(cls, bases: Sequence[ChunkKV | BlockRun], reserves: Sequence[int]) -> Slab:
        """Rows whose whole prompt came from the prefix cache (serve/engine/qvpic/linked_prompt.py `Resumed.logits`):
        each base's KV `[layers, 2, kv_heads, n, head_dim]` copied in, `reserves[j]` columns left for its decoded
        tokens, and no forward: its next token is sampled from the cached logits."""
        first = bases[0].like
        lengths = [base.num_tokens for base in bases]
        slab = cls.empty(first.shape[0], len(bases), first.shape[2], max(n + r for n, r in zip(lengths, reserves)),
                         first.shape[4], first.dtype, first.device, zeroed=False)
        for row, (base, length) in enumerate(zip(bases, lengths)):
            base.write_into(slab.kv[:, :, row])
            slab.kv[:, :, row, :, length:].zero_()  # only the columns the copy leaves unwritten
            slab.valid[row, :length] = True
            slab.lengths[row] = slab.host_lengths[row] = length
            # a cached run's base: the position after its last column
            slab.next_positions[row] = slab.host_next_positions[row] = base.position_span
        return slab

    # ---- shape ---------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        return self.kv.shape[4]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @property
    def rows_index(self) -> torch.Tensor:
        """`[rows, 1]`: 0..rows-1, made once per slab (every layer's cache update indexes with it)."""
        if getattr(self, "_rows_index", None) is None or self._rows_index.shape[0] != self.num_rows:
            self._rows_index = torch.arange(self.num_rows, device=self.lengths.device)[:, None]
        return self._rows_index

    # ---- rows joining and leaving --------------------------------------------------------------
    @staticmethod
    def merge(slabs: Sequence[Slab], capacity: int) -> Slab:
        """Rows of `slabs` stacked (in order) into one slab of `capacity` columns."""
        slabs = [s for s in slabs if s.num_rows]
        if len(slabs) == 1 and slabs[0].capacity == capacity:
            return slabs[0]
        merged = slabs[0].like(sum(s.num_rows for s in slabs), capacity)
        row = 0
        for slab in slabs:
            used = min(max(slab.host_lengths), capacity)  # rows are left-aligned: nothing lies beyond
            rows = slice(row, row + slab.num_rows)
            merged.kv[:, :, rows, :, :used] = slab.kv[:, :, :, :, :used]
            merged.valid[rows, :used] = slab.valid[:, :used]
            merged.lengths[rows], merged.next_positions[rows] = slab.lengths, slab.next_positions
            merged.host_lengths[rows], merged.host_next_positions[rows] = slab.host_lengths, slab.host_next_positions
            merged.host_pads[rows] = slab.host_pads
            row += slab.num_rows
        return merged

    def keep(self, rows: Sequence[int], capacity: int) -> Slab:
        """A new slab of only `rows` (in that order): the others' memory is released with this one."""
        kept = self.like(len(rows), capacity)
        if not rows:
            return kept
        index = torch.tensor(list(rows), dtype=torch.long, device=self.lengths.device)
        used = min(max(self.host_lengths[r] for r in rows), capacity)
        kept.kv[:, :, :, :, :used] = self.kv[:, :, index, :, :used]
        kept.valid[:, :used] = self.valid[index, :used]
        kept.lengths[:], kept.next_positions[:] = self.lengths[index], self.next_positions[index]
        kept.host_lengths = [self.host_lengths[r] for r in rows]
        kept.host_next_positions = [self.host_next_positions[r] for r in rows]
        kept.host_pads = [self.host_pads[r] for r in rows]
        return kept

    def read_back(self) -> Slab:
        """The host's bookkeeping read from the device's (a sync): for a caller that wrote `lengths` and
        `next_positions` itself (tests, benchmarks); the engine keeps both as it goes."""
        self.host_lengths, self.host_next_positions = self.lengths.tolist(), self.next_positions.tolist()
        return self

    # ---- one forward -----------------------------------------------------------------------------
    def prepare(self, real: torch.Tensor, dtype: torch.dtype, columns: torch.Tensor | None = None,
                positions: torch.Tensor | None = None,
                last: tuple[Sequence[int], Sequence[int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Set where this forward writes (`real` [rows, new]: which new tokens are real, pad slots first)
        and return its `(3, rows, new)` positions (M-RoPE's axes, equal for text) and `[rows, 1, new, width]`
        additive mask.

        By default each row writes its new tokens at its next columns and positions, every slot real (a decode
        step). `columns` and `positions` `[rows, new]` place them explicitly instead (a row's text runs between
        linked chunks, then its query: serve/engine/qvpic/linked_prompt.py `Hole`), ascending along each row's real
        slots; a token then sees the written columns before its own and the new tokens before it, never a linked
        chunk that lies after it. `last` then gives, on the host, each row's last slot's column and position (its
        highest: the width and the RoPE table's reach are known without reading the device)."""
        num_rows, num_new = real.shape
        steps = torch.arange(num_new, device=real.device)
        self.write_columns = self.lengths[:, None] + steps if columns is None else columns  # [rows, new]
        if last is None and columns is None:  # every slot real: a decode step (pads here: pass `last`)
            last = ([n + num_new - 1 for n in self.host_lengths], [p + num_new - 1 for p in self.host_next_positions])
        elif last is None:  # a caller without the host's bookkeeping (tests, benchmarks): read back, a sync
            last = (columns.max(1).values.tolist(), positions[:, -1].tolist())
        self._last = (list(last[0]), list(last[1]))
        self.width = max(self._last[0]) + 1
        self.max_position = max(self._last[1])
        if self.width > self.capacity:
            raise RuntimeError(f"slab of {self.capacity} columns cannot take column {self.width - 1}")
        if positions is None:
            # Real tokens take consecutive positions; a pad slot repeats its row's first one (it is masked out).
            offsets = (real.long().cumsum(1) - 1).clamp(min=0)
            positions = self.next_positions[:, None] + offsets
        positions = positions.unsqueeze(0).expand(3, -1, -1)
        allowed = self.valid[:, None, :self.width].expand(num_rows, num_new, self.width).clone()
        if columns is not None:  # written columns after a token (chunks linked past its run) are hidden from it
            allowed &= torch.arange(self.width, device=real.device) < self.write_columns[:, :, None]
        causal = real[:, None, :] & (steps[None, :, None] >= steps[None, None, :])  # [rows, t, t'≤t real]
        allowed.scatter_(2, self.write_columns[:, None, :].expand(num_rows, num_new, num_new), causal)
        allowed[self.rows_index, steps[None, :], self.write_columns] = True  # pad slots see themselves: finite
        mask = torch.zeros(allowed.shape, dtype=dtype, device=real.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return positions, mask.unsqueeze(1)

    def advance(self, real: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """After the forward: mark the real tokens' columns written, move lengths and positions on (`positions`:
        the explicit ones `prepare` was given; each row's last slot is real)."""
        self.valid[self.rows_index, self.write_columns] = real
        self.host_lengths = [column + 1 for column in self._last[0]]
        self.host_next_positions = [position + 1 for position in self._last[1]]
        if positions is None:
            self.lengths = self.lengths + real.shape[1]
            self.next_positions = self.next_positions + real.long().sum(1)
        else:
            self.lengths = self.write_columns.max(1).values + 1
            self.next_positions = positions[:, -1] + 1


@torch.inference_mode()
def prefill_queries(vlm: VLM, bases: Sequence[ChunkKV | BlockRun | None], contexts: Sequence[Sequence[ChunkKV]],
                    queries: Sequence[list[int]], reserves: Sequence[int],
                    recomputes: Sequence[tuple[RecomputeSpec, list[ChunkInputs]] | None] | None = None,
                    holes: Sequence[Sequence[Hole]] | None = None) -> tuple[Slab, torch.Tensor, list[float]]:
    """Assemble every context straight into its row of a new slab, then prefill every query on top of its
    own context in one forward.

    Row j holds `[bases[j]][context j's chunks, re-anchored after it]` at columns `[0, C_j)` — the base is what
    precedes the chunks at positions 0.. (the prompt's text before them, or a prefix-cache run; see
    serve/engine/qvpic/linked_prompt.py) — then each of `holes[j]`: a text run left unwritten and the chunks linked
    after it, then its query. The runs and the query are the row's new tokens, forwarded together in this one
    pass (each sees only the columns before it), left-padded to the longest row (so every row's last token is
    real and only its logits are computed); `reserves[j]` more columns are kept for its decoded tokens.
    Returns the slab, the logits `[rows, vocab]` and each row's assembly time (ms).
    `recomputes[j]` (spec, chunk inputs): recompute row j's selected chunk tokens after its assembly (its time
    counts as prefill, not assembly; see pipeline/runtime/selective_recompute.py).
    """
    holes = holes if holes is not None else [[] for _ in queries]
    if any(len(q) == 0 for q in queries):
        raise ValueError("every row needs at least one query token to prefill")
    # Each row's new tokens: its holes' text runs, then its query; left-padded to the longest row.
    counts = [sum(h.text.num_tokens for h in row) + len(q) for row, q in zip(holes, queries)]
    num_rows, longest = len(queries), max(counts)
    shape = vlm.prefix.kv  # [layers, 2, kv_heads, tokens, head_dim]: the slab's shape
    linked_lengths = [(base.num_tokens if base is not None else 0) + sum(c.num_tokens for c in chunks)
                      + sum(c.num_tokens for h in row for c in h.chunks)
                      for base, chunks, row in zip(bases, contexts, holes)]
    capacity = max(n + longest + r for n, r in zip(linked_lengths, reserves))
    # Every column below a row's linked context plus `longest` is written (assembled here, or by the forward:
    # holes, pads and query); only the rest is zeroed, not the whole slab.
    slab = Slab.empty(shape.shape[0], num_rows, shape.shape[2], capacity, shape.shape[4], vlm.dtype, vlm.device,
                      zeroed=False)
    for row, linked_length in enumerate(linked_lengths):
        slab.kv[:, :, row, :, linked_length + longest:].zero_()
    pad = vlm.tokenizer.pad_token_id if vlm.tokenizer.pad_token_id is not None else 0
    ids = torch.full((num_rows, longest), pad, dtype=torch.long)
    real = torch.zeros(num_rows, longest, dtype=torch.bool)
    columns = torch.zeros(num_rows, longest, dtype=torch.long)  # where each slot is written
    positions = torch.zeros(num_rows, longest, dtype=torch.long)  # and its (text) position
    last: tuple[list[int], list[int]] = ([], [])  # each row's last slot (its query's last token): column, position
    assembly_ms = []
    for row, (base, chunks) in enumerate(zip(bases, contexts)):
        started = time.perf_counter()
        context = assemble_row(vlm, base, chunks, slab.kv[:, :, row])
        slab.valid[row, :context.num_tokens] = True
        column, position, slot = context.num_tokens, context.next_position, longest - counts[row]
        for hole in holes[row]:  # the run's columns stay unwritten (invalid) until the forward fills them
            column, position, slot = _place(ids, columns, positions, row, slot, hole.text.ids, column, position)
            if hole.chunks:
                linked = link_at(vlm, hole.chunks, position, slab.kv[:, :, row, :, column:])
                slab.valid[row, column:column + linked.num_tokens] = True
                column, position = column + linked.num_tokens, linked.next_position
        assembly_ms.append(ms_since(started, vlm.device))
        if recomputes is not None and recomputes[row] is not None:
            recompute(vlm, context, chunks, recomputes[row][1], recomputes[row][0])
        # Pad slots (invisible) take the columns between the linked context and the query.
        pads = longest - counts[row]
        columns[row, :pads] = torch.arange(column, column + pads)
        slab.host_pads[row] = (column, column + pads)
        positions[row, :pads] = position
        end_column, end_position, _ = _place(ids, columns, positions, row, slot, queries[row], column + pads, position)
        last[0].append(end_column - 1)
        last[1].append(end_position - 1)
        real[row, pads:] = True
    ids, real, columns, positions = (t.to(vlm.device) for t in (ids, real, columns, positions))
    return slab, forward(vlm, slab, ids, real, columns, positions, last), assembly_ms


def _place(ids: torch.Tensor, columns: torch.Tensor, positions: torch.Tensor, row: int, slot: int,
           tokens: Sequence[int], column: int, position: int) -> tuple[int, int, int]:
    """Text `tokens` into `row`'s slots from `slot`, at consecutive columns and positions; where all three end."""
    n = len(tokens)
    ids[row, slot:slot + n] = torch.tensor(list(tokens), dtype=torch.long)
    columns[row, slot:slot + n] = torch.arange(column, column + n)
    positions[row, slot:slot + n] = torch.arange(position, position + n)
    return column + n, position + n, slot + n


def link_at(vlm: VLM, chunks: Sequence[ChunkKV], position: int, out: torch.Tensor) -> AssembledContext:
    """`chunks` re-anchored from `position` into `out` `[layers, 2, kv_heads, ≥tokens, head_dim]` from its first
    column (after a text run of the same row: an empty base carries the position)."""
    if position <= 0:
        raise ValueError("chunks linked after a text run start past position 0")
    layers, _, heads, _, head_dim = out.shape
    empty = ChunkKV(out.new_empty(layers, 2, heads, 0, head_dim), position, 0, ChunkKind.TEXT)
    return assemble_row(vlm, empty, chunks, out)


def assemble_row(vlm: VLM, base: ChunkKV | BlockRun | None, chunks: Sequence[ChunkKV],
                 out: torch.Tensor) -> AssembledContext:
    """`[base][chunks re-anchored]` into `out` `[layers, 2, kv_heads, capacity, head_dim]` (an empty one when
    there is neither: a prompt whose whole text comes after its chunks, none of them linked)."""
    moved = [c if c.kv.device == vlm.device else ChunkKV(c.kv.to(vlm.device), c.position_span, c.compile_start,
                                                           c.kind, c.grid_thw, c.vision_tokens) for c in chunks]
    if base is None and not moved:
        return AssembledContext(layers=[(out[i, 0, :, :0][None], out[i, 1, :, :0][None]) for i in range(out.shape[0])],
                                next_position=0, chunk_starts=[])
    return assemble(base, moved, vlm.rotations, out)


@torch.inference_mode()
def prefill_alone(vlm: VLM, base: ChunkKV | BlockRun | None, chunks: Sequence[ChunkKV], tail: PreparedSegment,
                  reserve: int) -> tuple[Slab, torch.Tensor]:
    """One row whose text after the chunks holds images (a user's picture in the question): assembled, then its
    tail forwarded with its pixels alone (the batched query prefill takes text only). Its slab, logits `[1, vocab]`."""
    num_tokens = (base.num_tokens if base is not None else 0) + sum(c.num_tokens for c in chunks)
    shape = vlm.prefix.kv
    out = torch.empty(shape.shape[0], 2, shape.shape[2], num_tokens, shape.shape[4], dtype=vlm.dtype, device=vlm.device)
    context = assemble_row(vlm, base, chunks, out)
    cache = DynamicCache(ddp_cache_data=[(k, v) for k, v in context.layers]) if num_tokens else DynamicCache()
    ids = torch.tensor([tail.ids], device=vlm.device)
    pixel_values = vlm.adapter.concat_pixels(tail.pixel_values) if tail.pixel_values else None
    grids = torch.cat(tail.grids) if tail.grids else None
    state = vlm._forward(ids, cache, context.next_position, pixel_values, grids)
    return Slab.from_prefill(state, reserve), state.logits[:, -1]


@torch.inference_mode()
def decode_step(vlm: VLM, slab: Slab, tokens: Sequence[int]) -> torch.Tensor:
    """Feed every row its last token; the next-token logits `[rows, vocab]`."""
    ids = torch.tensor(list(tokens), dtype=torch.long, device=vlm.device)[:, None]
    return forward(vlm, slab, ids, torch.ones_like(ids, dtype=torch.bool))


def forward(vlm: VLM, slab: Slab, ids: torch.Tensor, real: torch.Tensor, columns: torch.Tensor | None = None,
            explicit: torch.Tensor | None = None,
            last: tuple[Sequence[int], Sequence[int]] | None = None) -> torch.Tensor:
    """`columns`/`explicit` `[rows, new]`: where the new tokens go and their positions, `last` each row's last
    column and position on the host (`Slab.prepare`)."""
    positions, mask = slab.prepare(real, vlm.dtype, columns, explicit, last)
    if vlm.fused is not None:  # pipeline/runtime/fused.py: new tokens are text, so one position axis says all
        logits = vlm.fused.forward(slab, ids, positions[0], mask)
        slab.advance(real, explicit)
        return logits
    if vlm.adapter.rope_axes == 1:  # plain 1-D RoPE (LLaVA-OneVision): `[rows, new]`
        positions = positions[0]
    out = vlm.model(input_ids=ids, position_ids=positions, attention_mask=mask, **{vlm.cache_argument: slab},
                    use_cache=True, logits_to_keep=1)
    slab.advance(real, explicit)
    return out.logits[:, -1]
