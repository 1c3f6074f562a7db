"""One linked request's prompt, resumed from the prefix cache: what is left to compute, link and prefill.

A linked prompt is `[before][c_1 … c_n][after]` (pipeline/runtime/conversation.py): `before` and `after` are
token runs and images, the chunks are compiled KV re-anchored where they land. `resume` looks the prompt's
blocks up in the prefix cache (pipeline/runtime/prefix_cache.py) and returns

    base    KV of columns [0, n) at positions 0.. — the cached run, plus `before`'s remainder forwarded on it
    chunks  the chunks still to link after `base` (none when the cached run covers them)
    tail    what the batched query prefill still has to run (at least the last token, whose logits pick the
            first answer token)

so an identical request prefills one token, a follow-up turn only what its earlier turns did not hold, and a
request with a new system prompt computes that prompt once, then finds it. Chunks are never recomputed: a run
that ends inside one is cut back to its start, and the chunk is linked from its own KV.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache

from pipeline.runtime.conversation import PreparedSegment
from pipeline.runtime.kv import ChunkKV
from pipeline.runtime.prefix_cache import PrefixCache, StreamKeys, block_hashes, gather, partial_key, resume_point
from schemas.config import ChunkKind


@dataclass
class LinkedPrompt:
    before: PreparedSegment
    chunks: list[ChunkKV]  # loaded KV at compile-time positions, in request order
    chunk_identities: list[bytes]  # each chunk's entry key (chunk, tier, variant, fingerprint), as bytes
    after: PreparedSegment

    @property
    def num_tokens(self) -> int:
        return self.before.num_tokens + sum(c.num_tokens for c in self.chunks) + self.after.num_tokens


@dataclass
class Resumed:
    base: ChunkKV | None  # columns [0, n): compile_start 0, position_span = the next position
    chunks: list[ChunkKV]  # to link after `base`
    tail: PreparedSegment  # to prefill after them
    cached_columns: int  # columns of `base` that came from the prefix cache
    stream: StreamKeys  # the prompt's column keys (the decoded tokens are added when it is stored)
    before_columns: int  # where `before` ends (its partial last block is stored under `partial_key`)
    prompt_columns: int  # where the prompt ends (so is the prompt's)


def segment_keys(vlm, stream: StreamKeys, segment: PreparedSegment, start: int) -> int:
    """Add `segment`'s columns at positions from `start`; the position after it."""
    if not segment.ids:
        return start
    ids = torch.tensor([segment.ids], device=vlm.device)
    grids = torch.cat(segment.grids) if segment.grids else None
    positions = vlm.positions(ids, grids, start)[:, 0].cpu().numpy()  # [axes, L]; the axes agree on text tokens
    column = 0
    for first, end, digest in segment.image_spans:
        if first > column:
            stream.add_tokens(segment.ids[column:first], positions[0, column:first])
        # After an image the text resumes past its largest position (M-RoPE: start + max(h, w) of the grid).
        stream.add_item(b"image:" + digest.encode(), end - first, int(positions[:, end - 1].max()) + 1)
        column = end
    if column < len(segment.ids):
        stream.add_tokens(segment.ids[column:], positions[0, column:])
    return int(positions.max()) + 1


def prompt_keys(vlm, prompt: LinkedPrompt) -> tuple[StreamKeys, int]:
    """The prompt's column keys, and the position after its `after` segment."""
    stream = StreamKeys()
    position = segment_keys(vlm, stream, prompt.before, 0)
    for chunk, identity in zip(prompt.chunks, prompt.chunk_identities):
        stream.add_item(b"chunk:" + identity + b"@" + str(position).encode(), chunk.num_tokens,
                        position + chunk.position_span)
        position += chunk.position_span
    return stream, segment_keys(vlm, stream, prompt.after, position)


@torch.inference_mode()
def resume(vlm, cache: PrefixCache | None, salt: bytes, prompt: LinkedPrompt, past_before: bool = True) -> Resumed:
    """`past_before=False`: use cached columns of `before` only (selective recompute re-derives the chunks)."""
    stream, _ = prompt_keys(vlm, prompt)
    num_before = prompt.before.num_tokens
    num_chunks = sum(c.num_tokens for c in prompt.chunks)
    limit = stream.num_columns - 1 if past_before else min(num_before, stream.num_columns - 1)
    blocks, columns = [], 0
    if cache is not None and cache.enabled and limit > 0:
        size = cache.block_tokens
        hashes = block_hashes(salt, stream, size)  # every full block: a hit is cut back to `limit` below
        blocks = cache.match(hashes)
        columns = resume_point(blocks, size, limit)
        # The text before the chunks and the prompt as a whole rarely end on a block: their last partial block is
        # stored under its own key (an identical request then prefills one token, not up to a block).
        for end in (num_before, stream.num_columns):
            if (end // size) * size < min(end, limit) and columns < min(end, limit) and len(blocks) == end // size:
                partial = cache.get(partial_key(salt, stream, hashes, size, end))
                usable = min(end, limit)
                if partial is not None and partial.next_positions[usable - (end // size) * size - 1] >= 0:
                    blocks, columns = blocks + [partial], usable
                break
        cache.stats.hit_tokens += columns
    _, next_positions = stream.joined()
    cached = gather(blocks, columns) if columns else None  # [layers, 2, kv_heads, columns, head_dim]
    position = int(next_positions[columns - 1]) if columns else 0
    if columns < num_before:  # the rest of `before`, forwarded on the cached run
        cached, position = _forward(vlm, cached, prompt.before.tail(columns), position)
        linked_from, tail = 0, prompt.after
    elif columns <= num_before + num_chunks:  # the run ends after a whole chunk (or at `before`'s end)
        linked_from, covered = 0, num_before
        while covered < columns:
            covered += prompt.chunks[linked_from].num_tokens
            linked_from += 1
        tail = prompt.after
    else:
        linked_from, tail = len(prompt.chunks), prompt.after.tail(columns - num_before - num_chunks)
    base = None if cached is None or cached.shape[3] == 0 else ChunkKV(cached, max(position, 1), 0, ChunkKind.TEXT)
    return Resumed(base, prompt.chunks[linked_from:], tail, columns, stream, num_before, stream.num_columns)


def _forward(vlm, cached: torch.Tensor | None, segment: PreparedSegment, start: int) -> tuple[torch.Tensor, int]:
    """`segment` forwarded after `cached` `[layers, 2, kv_heads, n, head_dim]`: the KV of both, the next position."""
    layers = [] if cached is None else [(cached[i, 0][None].to(vlm.dtype), cached[i, 1][None].to(vlm.dtype))
                                        for i in range(cached.shape[0])]
    cache = DynamicCache(ddp_cache_data=layers) if layers else DynamicCache()
    ids = torch.tensor([segment.ids], device=vlm.device)
    pixel_values = vlm.adapter.concat_pixels(segment.pixel_values) if segment.pixel_values else None
    grids = torch.cat(segment.grids) if segment.grids else None
    state = vlm._forward(ids, cache, start, pixel_values, grids)
    kv = torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in state.cache.layers])
    return kv, state.next_position


def store(vlm, cache: PrefixCache | None, salt: bytes, resumed: Resumed, kv: torch.Tensor, decoded: list[int],
          next_position: int) -> None:
    """Keep a finished request's blocks: `kv` `[layers, 2, kv_heads, columns, head_dim]` is its prompt and the
    decoded tokens it fed back (`decoded`, ending at `next_position`), column for column."""
    if cache is None or not cache.enabled:
        return
    stream = resumed.stream
    fed = kv.shape[3] - stream.num_columns
    if fed < 0:
        return  # the row does not hold its whole prompt (it cannot happen; never store a torn stream)
    if fed:
        ids = decoded[:fed]
        stream.add_tokens(ids, np.arange(next_position - len(ids), next_position))
    size = cache.block_tokens
    hashes = block_hashes(salt, stream, size, kv.shape[3])
    _, next_positions = stream.joined()
    cache.insert(hashes, kv, next_positions)
    for end in (resumed.before_columns, resumed.prompt_columns):
        if end % size and end <= kv.shape[3]:
            first = (end // size) * size
            cache.put(partial_key(salt, stream, hashes, size, end), kv[:, :, :, first:end], next_positions[first:end])


def native_prompt(vlm, chunks: list[ChunkKV], query: str, instruction: str = "",
                  identities: list[bytes] | None = None) -> LinkedPrompt:
    """`[template prefix][instruction][chunks][query turn]` without a router (tests, benchmarks, evaluation).
    Without `identities` each chunk is named by the sha256 of its KV bytes: never two chunks under one name."""
    if identities is None:
        identities = [hashlib.sha256(c.kv.float().contiguous().cpu().numpy().tobytes()).hexdigest().encode()
                      for c in chunks]
    before = vlm.adapter.prefix_ids + (vlm.adapter.encode(instruction) if instruction else [])
    return LinkedPrompt(PreparedSegment(list(before)), list(chunks), identities,
                        PreparedSegment(vlm.query_turn_ids(query)))
