"""Compiled chunk KV and its assembly into one request's cache.

A chunk's KV is position-independent once we know where it was compiled: assembling a request places
chunk i at start position s_i (s_{i+1} = s_i + span_i) and rotates its keys by Δ_i = s_i − compile_start.
Values carry no position and are never touched.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import torch

from pipeline.runtime.reanchor import rotate_halves
from schemas.modes import ChunkKind


@dataclass
class ChunkKV:
    kv: torch.Tensor  # [layers, 2, kv_heads, tokens, head_dim]; keys rotated to compile-time positions
    position_span: int  # how far the next position advances after the chunk (≠ tokens for images)
    compile_start: int  # position of the chunk's first token when it was compiled
    kind: ChunkKind
    grid_thw: list[tuple[int, ...]] = field(default_factory=list)  # per page: patch grid (t, h, w), or LLaVA's (h, w)
    vision_tokens: int = 0  # image tokens among `num_tokens` (set at compile; metadata)

    def __post_init__(self) -> None:
        if self.kv.dim() != 5 or self.kv.shape[1] != 2:
            raise ValueError(f"ChunkKV.kv must be [layers, 2, kv_heads, tokens, head_dim], got {tuple(self.kv.shape)}")
        if self.position_span <= 0 or self.compile_start < 0:
            raise ValueError(f"invalid span {self.position_span} / compile start {self.compile_start}")

    @property
    def num_tokens(self) -> int:
        return self.kv.shape[3]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @property
    def like(self) -> torch.Tensor:
        """A tensor with the KV's layers, heads, head_dim, dtype and device."""
        return self.kv

    def write_into(self, out: torch.Tensor) -> None:
        """The KV as it is (no rotation) into `out` `[layers, 2, kv_heads, ≥tokens, head_dim]` from column 0."""
        out[:, :, :, :self.num_tokens] = self.kv


@dataclass
class BlockRun:
    """A resumed prompt's first columns as the prefix cache holds them: blocks `[layers, 2, kv_heads, block_tokens,
    head_dim]` (the last one partial, or cut), of which the first `num_tokens` columns count. They are written block
    by block straight where they go (`write_into`: a slab's row), never concatenated first — one pass fewer over
    their bytes (a 4-turn conversation's ~1,500 cached columns are ~18 MB at bench-qwen's shape); `kv` concatenates
    them only for a caller that needs one tensor. As a base: compile_start 0, position_span the next position."""

    blocks: list[torch.Tensor]
    num_tokens: int
    position_span: int
    compile_start: int = 0

    @property
    def like(self) -> torch.Tensor:
        """A tensor with the run's layers, heads, head_dim, dtype and device (not its columns)."""
        return self.blocks[0]

    @property
    def kv(self) -> torch.Tensor:
        return torch.cat(self.blocks, dim=3)[:, :, :, :self.num_tokens]

    def write_into(self, out: torch.Tensor) -> None:
        """Into `out` `[layers, 2, kv_heads, ≥num_tokens, head_dim]` from its first column. On the CPU block by
        block (one pass over the bytes); on a GPU that is a kernel launch per block (~90 for a 1,500-column
        conversation), so there one batched gather of them all and one copy into the row (`batched_write`)."""
        parts = self._parts()
        if out.device.type == "cuda":
            batched_write(parts, out)
            return
        column = 0
        for part in parts:
            out[:, :, :, column:column + part.shape[3]] = part
            column += part.shape[3]

    def _parts(self) -> list[torch.Tensor]:
        """The blocks' counted columns, in order (views)."""
        parts, column = [], 0
        for block in self.blocks:
            n = min(block.shape[3], self.num_tokens - column)
            if n <= 0:
                break
            parts.append(block.narrow(3, 0, n))
            column += n
        return parts


def batched_write(parts: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """`BlockRun.write_into` on a GPU: `parts` (contiguous blocks' columns) one after another into `out`'s first
    columns by one `cat` (one batched kernel: its inputs and output dense) and one `index_copy_` into the strided
    row, two copies whatever the number of blocks (any device computes the same; only a GPU gains)."""
    total = sum(part.shape[3] for part in parts)
    out.index_copy_(3, torch.arange(total, device=out.device), torch.cat(list(parts), dim=3))


@dataclass
class AssembledContext:
    """One request's context KV, ready for the query prefill."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), each [1, kv_heads, tokens, head_dim]
    next_position: int  # where the query starts
    chunk_starts: list[int]  # s_i of every chunk, in request order

    @property
    def num_tokens(self) -> int:
        return self.layers[0][0].shape[2]


# The rotation table's bytes on its device. A shift Δ is a chunk's start in a request minus where it was compiled,
# so a working set of requests reuses a few hundred to a few thousand Δs; an entry costs head_dim² + 2·head_dim
# floats (its matrix and its per-channel factors): 65 KiB at Qwen2.5-VL-7B's head_dim 128 in float32, so 64 MiB
# holds ~1,000 shifts there (~4,000 at head_dim 64). The earlier bound, 8,192 entries, allowed 520 MiB of GPU
# memory at head_dim 128 that no KV budget (serve/engine/kv_budget.py) counted; a Δ evicted is recomputed in
# one small batched call.
ROTATION_TABLE_NBYTES = 64 << 20


def rotation_nbytes(matrix: torch.Tensor) -> int:
    """An entry's bytes: its `[head_dim, head_dim]` matrix and its factors `(diag, cross)` `[head_dim]` each,
    counted up front whether they are read off or not (so the table's bytes never grow after it is filled)."""
    return (matrix.numel() + 2 * matrix.shape[-1]) * matrix.element_size()


class RotationTable:
    """Re-anchoring matrices by shift Δ, each computed once: a rotary cos/sin table in matrix form.

    `compute(deltas [n], head_dim) -> [n, head_dim, head_dim]` is the model's own (Adapter.rotation_matrices);
    what it returns for a Δ never changes, so the table keeps the most recently used within `max_nbytes`
    (`ROTATION_TABLE_NBYTES`; `rotation_nbytes` each) and a request computes only the shifts it has not seen.
    """

    def __init__(self, compute, max_nbytes: int = ROTATION_TABLE_NBYTES):
        self.compute, self.max_nbytes = compute, max_nbytes
        self.nbytes = 0
        self._table: OrderedDict[tuple[int, int, torch.device], _Rotation] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._table)

    def _rotations(self, deltas: torch.Tensor | Sequence[int], head_dim: int,
                   device: torch.device | None = None) -> list[_Rotation]:
        """`deltas`: a tensor, or the shifts as host ints with the `device` their matrices live on (what a caller
        that knows them should pass: reading a device's tensor back drains its stream)."""
        if isinstance(deltas, torch.Tensor):
            deltas, device = deltas.tolist(), deltas.device
        keys = [(int(d), head_dim, device) for d in deltas]
        with self._lock:
            missing = list(dict.fromkeys(k for k in keys if k not in self._table))
        fresh: dict[tuple[int, int, torch.device], _Rotation] = {}
        if missing:
            matrices = self.compute(torch.tensor([k[0] for k in missing], device=device), head_dim)
            fresh = {key: _Rotation(matrix) for key, matrix in zip(missing, matrices)}
            with self._lock:
                for key, rotation in fresh.items():
                    if key not in self._table:  # (another thread may have put it meanwhile)
                        self._table[key] = rotation
                        self.nbytes += rotation.nbytes
                while self.nbytes > self.max_nbytes and self._table:
                    self.nbytes -= self._table.popitem(last=False)[1].nbytes
        with self._lock:
            found = []
            for key in keys:
                rotation = self._table.get(key)
                if rotation is not None:
                    self._table.move_to_end(key)
                else:  # computed for this call, and already past the budget: used once, not kept
                    rotation = fresh[key]
                found.append(rotation)
        return found

    def __call__(self, deltas: torch.Tensor | Sequence[int], head_dim: int,
                 device: torch.device | None = None) -> torch.Tensor:
        return torch.stack([rotation.matrix for rotation in self._rotations(deltas, head_dim, device)])

    def halves(self, deltas: torch.Tensor | Sequence[int], head_dim: int,
               device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The same rotations as per-channel factors `(diag, cross)` `[n, head_dim]` with
        rotate(k, Δ) = k · diag + swap_halves(k) · cross — when every matrix pairs channel i only with
        i ± head_dim/2 (Qwen's rotate-half layout, pass-through channels having cross 0); None otherwise
        (GLM's interleaved pairs keep the matrix product). One elementwise pass over the keys instead of a
        `head_dim`-wide product per key (pipeline/runtime/reanchor.py), and exact (a column's other entries are 0).
        Read off each matrix once and kept with it: a request pays a lookup."""
        factors = [rotation.factors() for rotation in self._rotations(deltas, head_dim, device)]
        if any(f is None for f in factors):
            return None
        return torch.stack([f[0] for f in factors]), torch.stack([f[1] for f in factors])


class _Rotation:
    """One shift's matrix and, once asked for, its per-channel factors (None: it pairs channels otherwise)."""

    def __init__(self, matrix: torch.Tensor):
        self.matrix = matrix
        self.nbytes = rotation_nbytes(matrix)
        self._factors: tuple[torch.Tensor, torch.Tensor] | None | bool = False  # False: not read off yet

    def factors(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self._factors is False:  # two threads may both read them off: the same tensors, no harm
            self._factors = _halves_factors(self.matrix)
        return self._factors


def _halves_factors(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    head_dim = matrix.shape[-1]
    channels = torch.arange(head_dim, device=matrix.device)
    partner = (channels + head_dim // 2) % head_dim
    diag = matrix.diagonal().contiguous()  # M[i, i]
    cross = matrix[partner, channels]  # M[partner(i), i]
    rest = matrix.clone()
    rest[channels, channels] = 0
    rest[partner, channels] = 0
    if head_dim % 2 or bool(rest.any()):
        return None
    return diag, cross


def chunk_starts(prefix_span: int, chunks: Sequence[ChunkKV]) -> list[int]:
    """s_1 = prefix span, s_{i+1} = s_i + span_i."""
    starts, position = [], prefix_span
    for chunk in chunks:
        starts.append(position)
        position += chunk.position_span
    return starts


def assemble(prefix: ChunkKV | BlockRun | None, chunks: Sequence[ChunkKV], rotation_matrices,
             out: torch.Tensor | None = None) -> AssembledContext:
    """Lay out `[prefix][c_1 re-anchored]…[c_n re-anchored]` in request order in one tensor: a new one, or
    `out` (`[layers, 2, kv_heads, ≥tokens, head_dim]`, e.g. a row of a batch's slab) from its first column.

    `rotation_matrices(deltas [n], head_dim) -> [n, head_dim, head_dim]` gives the model's rotary
    shift by Δ as a matrix (see Adapter.rotation_matrices); each chunk's keys are multiplied by theirs
    in float32 and written once into place. Stored chunk KV is never modified.
    """
    prefix_span = prefix.position_span if prefix is not None else 0
    if prefix is not None and prefix.compile_start != 0:
        raise ValueError("the serving prefix must be compiled at position 0")
    parts = ([prefix] if prefix is not None else []) + list(chunks)
    if not parts:
        raise ValueError("nothing to assemble: no prefix and no chunks")
    starts = chunk_starts(prefix_span, chunks)
    first = parts[0].like
    num_layers, _, num_heads, _, head_dim = first.shape
    total = sum(p.num_tokens for p in parts)
    if out is None:
        kv = torch.empty(num_layers, 2, num_heads, total, head_dim, dtype=first.dtype, device=first.device)
    else:
        kv = out[:, :, :, :total]
    shifts = [s - c.compile_start for c, s in zip(chunks, starts)]
    # a table is asked by the host's shifts: nothing to read back from the device
    table = isinstance(rotation_matrices, RotationTable)
    factors = rotation_matrices.halves(shifts, head_dim, first.device) if chunks and table else None
    if not chunks or factors is not None:
        matrices = None
    elif table:
        matrices = rotation_matrices(shifts, head_dim, first.device)
    else:
        matrices = rotation_matrices(torch.tensor(shifts, dtype=torch.long, device=first.device), head_dim)
    offset = 0
    for i, part in enumerate(parts):
        end = offset + part.num_tokens
        chunk_index = i - (prefix is not None)
        if chunk_index < 0:  # the prefix: at its own positions
            part.write_into(kv[:, :, :, offset:end])
            offset = end
            continue
        kv[:, 1, :, offset:end] = part.kv[:, 1]  # values carry no position
        if shifts[chunk_index] == 0:
            kv[:, 0, :, offset:end] = part.kv[:, 0]
        elif factors is not None:
            rotate_halves(part.kv[:, 0], factors[0][chunk_index], factors[1][chunk_index], kv[:, 0, :, offset:end])
        else:  # [layers, kv_heads, tokens, head_dim] @ [head_dim, head_dim]
            kv[:, 0, :, offset:end] = (part.kv[:, 0].float() @ matrices[chunk_index]).to(kv.dtype)
        offset = end
    next_position = starts[-1] + chunks[-1].position_span if chunks else prefix_span
    layers = [(kv[i, 0].unsqueeze(0), kv[i, 1].unsqueeze(0)) for i in range(num_layers)]
    return AssembledContext(layers=layers, next_position=next_position, chunk_starts=starts)
