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
logits equal the same request's run alone (to float rounding). The slab itself: serve/engine/qvpic/slab.py.

    join:   prefill_queries(bases, chunks, queries) -> Slab of the new rows (assembled in place), first-token logits
            lay_out(bases, chunks, queries)    -> the same rows laid out, to forward in pieces (pieces.py)
            Slab.from_prefill(state)           -> a row whose prefill ran alone (online modes)
            Slab.merge([running, joined])      -> one slab
    step:   decode_step(slab, tokens)          -> next-token logits of every row
    leave:  slab.keep(rows)                    -> the slab without the rows that finished
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from pipeline.runtime.conversation import PreparedSegment
from pipeline.runtime.kv import AssembledContext, BlockRun, ChunkKV, assemble
from pipeline.runtime.model import VLM
from pipeline.runtime.selective_recompute import ChunkInputs, recompute
from pipeline.runtime.timing import ms_since
from schemas.config import RecomputeSpec
from schemas.modes import ChunkKind
from serve.engine.qvpic.linked_prompt import Hole
from serve.engine.qvpic.slab import Slab, SlabLayer  # noqa: F401  (re-exported: the engine's, tests' import path)


@dataclass
class Layout:
    """New rows laid out in their slab, ready to forward: their contexts assembled (and linked chunks placed) at
    their columns, and the new tokens' slots `[rows, slots]` on the host, pad slots first (see `lay_out`)."""

    slab: Slab
    ids: torch.Tensor  # [rows, slots] long: each slot's token (pad_token_id in a pad slot)
    real: torch.Tensor  # [rows, slots] bool: False in a row's left pad slots
    columns: torch.Tensor  # [rows, slots] long: the column each slot writes, ascending along a row
    positions: torch.Tensor  # [rows, slots] long: each slot's (text) position
    last: tuple[list[int], list[int]]  # each row's last slot (its query's last token): column, position
    assembly_ms: list[float]  # each row's assembly (re-anchoring) time

    def slots(self, device: torch.device, cut: slice = slice(None)) -> tuple[torch.Tensor, ...]:
        """`ids`, `real`, `columns` and `positions` of the slots `cut`, on `device`: what a forward takes."""
        return tuple(t[:, cut].to(device) for t in (self.ids, self.real, self.columns, self.positions))


@torch.inference_mode()
def prefill_queries(vlm: VLM, bases: Sequence[ChunkKV | BlockRun | None], contexts: Sequence[Sequence[ChunkKV]],
                    queries: Sequence[list[int]], reserves: Sequence[int],
                    recomputes: Sequence[tuple[RecomputeSpec, list[ChunkInputs]] | None] | None = None,
                    holes: Sequence[Sequence[Hole]] | None = None) -> tuple[Slab, torch.Tensor, list[float]]:
    """`lay_out` the rows, then prefill every row's new tokens in one forward. Returns the slab, the logits
    `[rows, vocab]` and each row's assembly time (ms)."""
    layout = lay_out(vlm, bases, contexts, queries, reserves, recomputes, holes)
    return layout.slab, forward(vlm, layout.slab, *layout.slots(vlm.device), layout.last), layout.assembly_ms


@torch.inference_mode()
def lay_out(vlm: VLM, bases: Sequence[ChunkKV | BlockRun | None], contexts: Sequence[Sequence[ChunkKV]],
            queries: Sequence[list[int]], reserves: Sequence[int],
            recomputes: Sequence[tuple[RecomputeSpec, list[ChunkInputs]] | None] | None = None,
            holes: Sequence[Sequence[Hole]] | None = None) -> Layout:
    """Assemble every context straight into its row of a new slab and lay out each row's new tokens, to be
    forwarded on top of it: in one forward (`prefill_queries`), or one row's in pieces over several engine steps
    (serve/engine/qvpic/pieces.py).

    Row j holds `[bases[j]][context j's chunks, re-anchored after it]` at columns `[0, C_j)` — the base is what
    precedes the chunks at positions 0.. (the prompt's text before them, or a prefix-cache run; see
    serve/engine/qvpic/linked_prompt.py) — then each of `holes[j]`: a text run left unwritten and the chunks linked
    after it, then its query. The runs and the query are the row's new tokens, forwarded together in this one
    pass (each sees only the columns before it), left-padded to the longest row (so every row's last token is
    real and only its logits are computed); `reserves[j]` more columns are kept for its decoded tokens.
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
    return Layout(slab, ids, real, columns, positions, last, assembly_ms)


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


PADDING_TOKEN = 0  # a padding row's input (any token: what it computes is never read)


@torch.inference_mode()
def decode_step(vlm: VLM, slab: Slab, tokens: Sequence[int]) -> torch.Tensor:
    """Feed every row its last token; the next-token logits `[rows, vocab]`. On CUDA the step runs over the slab's
    padding rows too (`bucket_rows`: token 0, wholly unreal), and their logits are cut off here: no sampler, token
    or count ever sees them."""
    rows = len(tokens)
    padding = [PADDING_TOKEN] * (slab.padded_rows - rows)
    ids = torch.tensor(list(tokens) + padding, dtype=torch.long, device=vlm.device)[:, None]
    real = torch.ones_like(ids, dtype=torch.bool)
    if slab.padded_rows > rows:
        real[rows:] = False
    return forward(vlm, slab, ids, real)[:rows]


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
