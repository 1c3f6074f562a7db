"""The slab: the KV of a batch of rows in one allocation, and what a forward over it reads (serve/engine/qvpic/batch.py
says how rows join, step and leave; this is the data structure and its bookkeeping).

`[layers, 2, rows, kv_heads, capacity, head_dim]`, rows left-aligned: row r fills columns `[0, lengths[r])` and
writes its next token at column `lengths[r]`. A forward reads the first `width` columns through an additive mask
that hides what a row has not written; on CUDA that width is rounded up to a bucket (`shapes.bucket_width`) so a
run of decode steps repeats a few shapes (a captured step, a compiled kernel's cache), at the cost of a few masked
columns, which change nothing (exp(finfo.min − max) is exactly 0 and unwritten columns hold zeros).

On CUDA the rows are bucketed too (`shapes.bucket_rows`): the allocation holds padding rows after the real ones, and a
decode step runs over all of them, so a join or a finish changes the step's shape only when it crosses a bucket.
A padding row is inert: the batch dimension is independent in every operation of the forward (a row's attention
reads its own row of the slab only), so it writes its one token at column 0 of its own row — scratch no real row
reads — and sees only that column; its logits are cut off before the sampler (no draws, no tokens, no stats).
Its cost is memory: `shapes.slab_rows` rows × capacity, which the scheduler's KV cap counts.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from pipeline.runtime.kv import BlockRun, ChunkKV
from pipeline.runtime.model import Prefill
from serve.engine.qvpic import shapes
from serve.engine.qvpic.shapes import bucket_width  # noqa: F401  (re-exported: tests' import path)
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
        forwarded = self.owner.forward_rows  # a prefill's: the real rows only, not the allocation's padding rows
        return self.keys[:forwarded, :, :width], self.values[:forwarded, :, :width]

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
        self.bucketed = shapes.buckets_on(kv.device)  # forwards read a bucketed width (`shapes.bucket_width`)
        self.forward_rows = self.num_rows  # rows of the forward prepared last (a decode step's padding included)
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
        physical = shapes.slab_rows(num_rows, device)  # on CUDA, padding rows after the real ones
        kv = SLAB_MEMORY.empty((num_layers, 2, physical, num_heads, capacity, head_dim), dtype, device)
        if zeroed:
            kv.zero_()
        elif physical > num_rows:  # no caller writes the padding rows: their masked columns must hold finite numbers
            kv[:, :, num_rows:].zero_()
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
            slab.kv[i, 0, :1, :, :length] = layer.keys
            slab.kv[i, 1, :1, :, :length] = layer.values
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
    def padded_rows(self) -> int:
        """The allocation's rows: `num_rows`, then on CUDA the padding rows a decode step runs over too."""
        return self.kv.shape[2]

    @property
    def rows_index(self) -> torch.Tensor:
        """`[rows, 1]`: 0..rows-1 over the forward's rows, made once per slab and row count (every layer's cache
        update indexes with it)."""
        if getattr(self, "_rows_index", None) is None or self._rows_index.shape[0] != self.forward_rows:
            self._rows_index = torch.arange(self.forward_rows, device=self.lengths.device)[:, None]
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
            merged.kv[:, :, rows, :, :used] = slab.kv[:, :, :slab.num_rows, :, :used]
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
        kept.kv[:, :, :len(rows), :, :used] = self.kv[:, :, index, :, :used]
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
        highest: the width and the RoPE table's reach are known without reading the device).

        `real` may have more rows than the slab, up to `padded_rows` (a bucketed decode step's, `columns` None):
        the padding rows, after the real ones, are wholly unreal; each writes at column 0 of its own row and sees
        only that column (`_padding`)."""
        num_rows, num_new = real.shape
        pad = num_rows - self.num_rows
        if pad and (columns is not None or num_rows > self.padded_rows):
            raise ValueError(f"a forward of {num_rows} rows over a slab of {self.num_rows} ({self.padded_rows} "
                             "allocated): only a decode step's padding rows may be added")
        self.forward_rows = num_rows
        steps = torch.arange(num_new, device=real.device)
        # [rows, new]
        self.write_columns = self._padding(self.lengths[:, None] + steps, pad) if columns is None else columns
        if last is None and columns is None:  # every slot real: a decode step (pads here: pass `last`)
            last = ([n + num_new - 1 for n in self.host_lengths], [p + num_new - 1 for p in self.host_next_positions])
        elif last is None:  # a caller without the host's bookkeeping (tests, benchmarks): read back, a sync
            last = (columns.max(1).values.tolist(), positions[:, -1].tolist())
        self._last = (list(last[0]), list(last[1]))
        self.width = max(self._last[0]) + 1
        self.max_position = max(self._last[1])
        if self.width > self.capacity:
            raise RuntimeError(f"slab of {self.capacity} columns cannot take column {self.width - 1}")
        if self.bucketed:  # the columns past the rows' own are unwritten (zeros, `valid` false): masked
            self.width = min(shapes.bucket_width(self.width), self.capacity)
        if positions is None:
            # Real tokens take consecutive positions; a pad slot repeats its row's first one (it is masked out).
            offsets = (real.long().cumsum(1) - 1).clamp(min=0)
            positions = self._padding(self.next_positions, pad)[:, None] + offsets
        positions = positions.unsqueeze(0).expand(3, -1, -1)
        allowed = self._padding(self.valid[:, :self.width], pad)[:, None].expand(num_rows, num_new, self.width).clone()
        if columns is not None:  # written columns after a token (chunks linked past its run) are hidden from it
            allowed &= torch.arange(self.width, device=real.device) < self.write_columns[:, :, None]
        causal = real[:, None, :] & (steps[None, :, None] >= steps[None, None, :])  # [rows, t, t'≤t real]
        allowed.scatter_(2, self.write_columns[:, None, :].expand(num_rows, num_new, num_new), causal)
        allowed[self.rows_index, steps[None, :], self.write_columns] = True  # pad slots see themselves: finite
        mask = torch.zeros(allowed.shape, dtype=dtype, device=real.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return positions, mask.unsqueeze(1)

    @staticmethod
    def _padding(rows: torch.Tensor, pad: int) -> torch.Tensor:
        """`rows` `[rows, ...]` and `pad` padding rows of zeros after them: column 0 (their own row's scratch:
        no real row reads another row), position 0, no column valid."""
        return torch.cat([rows, rows.new_zeros((pad, *rows.shape[1:]))]) if pad else rows

    def advance(self, real: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """After the forward: mark the real tokens' columns written, move lengths and positions on (`positions`:
        the explicit ones `prepare` was given; each row's last slot is real). Padding rows keep nothing."""
        rows, real = slice(0, self.num_rows), real[:self.num_rows]
        self.valid[self.rows_index[rows], self.write_columns[rows]] = real
        self.host_lengths = [column + 1 for column in self._last[0]]
        self.host_next_positions = [position + 1 for position in self._last[1]]
        if positions is None:
            self.lengths = self.lengths + real.shape[1]
            self.next_positions = self.next_positions + real.long().sum(1)
        else:
            self.lengths = self.write_columns.max(1).values + 1
            self.next_positions = positions[:, -1] + 1
