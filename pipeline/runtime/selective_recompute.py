"""Selective recompute across linked chunks: give some chunk tokens back their attention to the context.

A linked chunk's KV was computed with the chunk attending only to its own compile prefix; in the
request it follows the serving prefix and other chunks it never saw. Two known repairs rebuild a set S
of each chunk's tokens on the assembled context before the query is prefilled (RecomputeKind):

- LEADING (EPIC): S = the first k tokens of every chunk;
- DEVIATION (CacheBlend): S = per chunk, the share r of its tokens whose K/V deviate most from what the
  context would give them. The deviation is estimated on the first layer whose K/V attention changes:
  layer 0's K/V depend only on a token's embedding and position, so they equal the cached ones; one
  decoder layer run over every chunk token with full attention gives the fresh layer-1 K/V, compared
  with the cached layer-1 K/V per token (squared L2 over heads, keys plus values).

Recomputing S is one forward of S's input embeddings at their serving positions over the assembled
cache, under a 4-D additive mask that lets each token of S attend every column at or before its own.
At each layer the fresh K/V of S overwrite theirs in place before attention reads them, so a token of
S sees the fresh K/V of earlier tokens of S and the cached K/V of the rest. With S = every chunk token
this is the full prefill of the same pieces (tests/serve/engine/test_recompute.py).

What it needs at serve time: each chunk's input embeddings — its token ids and, for page entries, its
pages' merged vision features. Nothing new is stored for it: the store already keeps each chunk's text
(rendered again to the same pages, as the generator's repair path does) or its scanned page image; the
cost is rendering and vision encoding per request (benchmarks/quality/recompute.py measures it, and the bytes
that storing the merged vision embeddings instead would add).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from PIL import Image
from transformers.cache_utils import Cache, CacheLayerMixin

from pipeline.runtime.kv import AssembledContext, ChunkKV
from pipeline.runtime.timing import ms_since
from schemas.config import RecomputeKind, RecomputeSpec


@dataclass
class ChunkInputs:
    """The tokens one linked chunk was compiled from, prefix excluded: ids, and for pages their pixel values
    and layout (`[pages, 3]` patch grids, or LLaVA's `[pages, 2]` sizes)."""

    ids: list[int]
    pixel_values: torch.Tensor | None = None
    grids: torch.Tensor | None = None


@dataclass(frozen=True)
class RecomputeReport:
    num_tokens: int  # chunk tokens recomputed
    select_ms: float  # input embeddings (vision encoding) and, for DEVIATION, the estimation pass
    recompute_ms: float  # the forward over the selected tokens


def chunk_inputs(vlm, source: str | Sequence[Image.Image]) -> ChunkInputs:
    """A chunk's inputs from its source — its text, or its pages — tokenised as compile tokenises them."""
    if isinstance(source, str):
        return ChunkInputs(vlm.adapter.encode(source))
    pixel_values, grids, ids = vlm.image_inputs(source)
    return ChunkInputs(ids, pixel_values, grids)


class _Stop(Exception):
    """Raised from a hook to end a forward once what it was run for has been captured."""


@torch.inference_mode()
def input_embeddings(vlm, inputs: ChunkInputs, num_tokens: int | None = None) -> torch.Tensor:
    """`[n, hidden]` input embeddings of the chunk's first `num_tokens` tokens (all by default), exactly as the
    model's own forward merges them (text embeddings, each page's vision features at its image tokens).
    Only the pages that hold one of those tokens go through the vision tower."""
    n = len(inputs.ids) if num_tokens is None else min(num_tokens, len(inputs.ids))
    ids, pixel_values, grids = inputs.ids, inputs.pixel_values, inputs.grids
    if grids is not None:  # keep the pages that start before token n (a chunk's ids are its pages' in order)
        page_tokens = torch.tensor([len(vlm.adapter.image_ids(g)) for g in grids])
        page_ends = page_tokens.cumsum(0)
        num_pages = max(1, int((page_ends - page_tokens < n).sum()))
        ids = ids[: int(page_ends[num_pages - 1])]
        # M-RoPE families: flattened patches, t·h·w rows per page; LLaVA: one row of tiles per page
        rows = int(grids[:num_pages].prod(-1).sum()) if vlm.adapter.rope_axes == 3 else num_pages
        pixel_values, grids = pixel_values[:rows], grids[:num_pages]
    captured = []

    def capture(_module, _args, kwargs):
        captured.append(kwargs["inputs_embeds"][0])
        raise _Stop

    input_ids = torch.tensor([ids], device=vlm.device)
    handle = vlm.model.model.language_model.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        vlm.model.model(**vlm.adapter.model_inputs(input_ids, vlm.positions(input_ids, grids), pixel_values, grids))
    except _Stop:
        pass
    finally:
        handle.remove()
    return captured[0][:n]


class _ColumnsLayer(CacheLayerMixin):
    """One layer of an assembled context (`[1, kv_heads, tokens, head_dim]`) that a forward over tokens already
    in it updates at their own columns: in place (`write`), on a copy (the estimation pass reads the context
    without changing it), or not at all (`stop`: capture this layer's fresh K/V and end the forward)."""

    is_compileable = False
    supports_early_init = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor, write: bool,
                 stop: bool = False):
        super().__init__()
        self.keys, self.values, self.columns, self.write, self.stop = keys, values, columns, write, stop
        self.captured: tuple[torch.Tensor, torch.Tensor] | None = None
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("an assembled context is allocated before the forward pass")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.stop:
            self.captured = (key_states, value_states)  # [1, kv_heads, new, head_dim]
            raise _Stop
        keys, values = (self.keys, self.values) if self.write else (self.keys.clone(), self.values.clone())
        keys[:, :, self.columns] = key_states.to(keys.dtype)
        values[:, :, self.columns] = value_states.to(values.dtype)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self) -> int:
        return self.keys.shape[2]

    def get_max_length(self) -> int:
        return self.keys.shape[2]


def _forward(vlm, layers: list[_ColumnsLayer], embeds: torch.Tensor, positions: torch.Tensor,
             columns: torch.Tensor) -> None:
    """Tokens `embeds [n, hidden]` at `positions (axes, 1, n)`, sitting at `columns [n]` of the context, each
    attending every column at or before its own."""
    total = layers[0].keys.shape[2]
    allowed = torch.arange(total, device=vlm.device)[None, :] <= columns[:, None]  # [n, total]
    mask = (torch.zeros(allowed.shape, dtype=vlm.dtype, device=vlm.device)
            .masked_fill_(~allowed, torch.finfo(vlm.dtype).min))
    vlm.model.model(inputs_embeds=embeds[None].to(vlm.dtype), position_ids=positions if vlm.adapter.rope_axes == 3
                    else positions[0], attention_mask=mask[None, None], **{vlm.cache_argument: Cache(layers=layers)},
                    use_cache=True)


def _deviations(vlm, context: AssembledContext, embeds: torch.Tensor, positions: torch.Tensor,
                columns: torch.Tensor) -> torch.Tensor:
    """`[n]` squared L2 distance, per token, between its cached layer-1 K/V and the K/V it gets when layer 0
    runs with attention to the whole context (the context itself is left as it is)."""
    if len(context.layers) < 2:
        raise ValueError("deviation-based recompute needs a model with at least two layers")
    layers = [_ColumnsLayer(k, v, columns, write=False, stop=i == 1) for i, (k, v) in enumerate(context.layers)]
    try:
        _forward(vlm, layers, embeds, positions, columns)
    except _Stop:
        pass
    fresh_k, fresh_v = layers[1].captured
    cached_k, cached_v = (t[:, :, columns] for t in context.layers[1])
    return ((fresh_k.float() - cached_k.float()).square().sum((0, 1, 3))
            + (fresh_v.float() - cached_v.float()).square().sum((0, 1, 3)))


@torch.inference_mode()
def recompute(vlm, context: AssembledContext, chunks: Sequence[ChunkKV], inputs: Sequence[ChunkInputs],
              spec: RecomputeSpec) -> RecomputeReport:
    """Recompute the tokens `spec` selects of every chunk of `context` in place (its KV, every layer).

    `context` is `vlm.assemble(chunks, …)` (or a slab row assembled the same way) in the model's dtype;
    `inputs[i]` is chunk i's source as `chunk_inputs` builds it."""
    if not spec.enabled or not chunks:
        return RecomputeReport(0, 0.0, 0.0)
    if len(inputs) != len(chunks):
        raise ValueError(f"{len(inputs)} chunk inputs for {len(chunks)} chunks")
    if context.layers[0][0].dtype != vlm.dtype:
        raise ValueError(f"recompute writes {vlm.dtype} KV; the context holds {context.layers[0][0].dtype}")
    started = time.perf_counter()
    column = context.num_tokens - sum(c.num_tokens for c in chunks)  # the serving prefix comes first
    leading = spec.kind is RecomputeKind.LEADING
    embeds, positions, columns, spans = [], [], [], []
    for chunk, chunk_in, start in zip(chunks, inputs, context.chunk_starts):
        if len(chunk_in.ids) != chunk.num_tokens:
            raise ValueError(f"a chunk's source has {len(chunk_in.ids)} tokens; its KV entry holds {chunk.num_tokens}")
        n = min(spec.leading_num_tokens, chunk.num_tokens) if leading else chunk.num_tokens
        ids = torch.tensor([chunk_in.ids], device=vlm.device)
        embeds.append(input_embeddings(vlm, chunk_in, n))
        positions.append(vlm.positions(ids, chunk_in.grids, start)[:, :, :n])  # as one full prefill lays them out
        columns.append(torch.arange(column, column + n, device=vlm.device))
        spans.append(n)
        column += chunk.num_tokens
    embeds, positions, columns = torch.cat(embeds), torch.cat(positions, dim=2), torch.cat(columns)
    if spec.kind is RecomputeKind.DEVIATION:
        deviation, keep, offset = _deviations(vlm, context, embeds, positions, columns), [], 0
        for n in spans:  # the top r of each chunk, at least one token
            top = deviation[offset:offset + n].topk(max(1, math.ceil(spec.deviation_fraction * n))).indices
            keep.append(top + offset)
            offset += n
        keep = torch.cat(keep).sort().values  # in context order: causal within the selection
        embeds, positions, columns = embeds[keep], positions[:, :, keep], columns[keep]
    selected = ms_since(started, vlm.device)
    started = time.perf_counter()
    _forward(vlm, [_ColumnsLayer(k, v, columns, write=True) for k, v in context.layers], embeds, positions, columns)
    return RecomputeReport(int(columns.numel()), selected, ms_since(started, vlm.device))
