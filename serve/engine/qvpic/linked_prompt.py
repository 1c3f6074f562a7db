"""One linked request's prompt, resumed from the prefix cache: what is left to compute, link and prefill.

A linked prompt is `[texts[0]][group 0][texts[1]] … [group n-1][texts[n]]` (pipeline/runtime/conversation.py):
texts are token runs and images, a group is compiled chunk KV re-anchored where it lands. `resume` looks the
prompt's blocks up in the prefix cache (serve/engine/qvpic/prefix_cache.py) and returns

    base    KV of every column before the last group's part still to link, at positions 0.. — the cached run,
            then what remains of the earlier texts forwarded and of the earlier groups linked, in order
    chunks  chunks to link right after `base` (without holes: the last group's, none when the cached run covers them)
    holes   with `defer_texts`: the texts still to compute before the last group, each with the chunks linked
            after it — left as holes in the row, computed by the batched prefill in the tail's forward (one read
            of the weights for a follow-up turn, not one per text run)
    tail    what the batched query prefill still has to run of the last text (at least its last token, whose
            logits pick the first answer token; nothing when `logits` came from the cache)
    logits  with `final_logits`, when the cache holds the whole prompt and the logits its last column produced: those
            logits `[vocab]` (base then holds every column, and nothing is left to prefill)

so an identical request prefills nothing (one token without `final_logits`, as vLLM's prefix cache does), a
follow-up turn only what its earlier turns did not hold (their
questions' chunks, answers and headers are blocks of the earlier request's stream), and a request with a new
system prompt computes that prompt once, then finds it. Chunks are never recomputed: a run that ends inside one
is cut back to its start, and the chunk is linked from its own KV.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache

from pipeline.runtime.conversation import PreparedSegment
from pipeline.runtime.kv import BlockRun, ChunkKV, assemble
from schemas.modes import ChunkKind
from serve.engine.prepared import LinkedPrompt
from serve.engine.qvpic.prefix_cache import (
    PrefixCache,
    StreamKeys,
    block_hashes,
    logits_key,
    partial_key,
    resume_point,
)


@dataclass
class Hole:
    """A text run left unwritten in the row, then chunks linked after it: the run is computed in the same forward
    as the tail (its tokens see only the columns before them; serve/engine/qvpic/batch.py `Slab.prepare`)."""

    text: PreparedSegment  # text only (a run holding an image is forwarded on its own, in `resume`)
    chunks: list[ChunkKV]  # linked right after the run, re-anchored at the position the run ends at


@dataclass
class Resumed:
    base: ChunkKV | BlockRun | None  # columns [0, n): compile_start 0, position_span = the next position
    chunks: list[ChunkKV]  # linked right after `base`
    tail: PreparedSegment  # of the last text, to prefill after them
    cached_columns: int  # columns of `base` that came from the prefix cache
    stream: StreamKeys  # the prompt's column keys (the decoded tokens are added when it is stored)
    ends: tuple[int, ...]  # where each text before a group ends, and the prompt: partial blocks are kept there
    holes: list[Hole] = field(default_factory=list)  # after `chunks`, before `tail`, in order
    logits: torch.Tensor | None = None  # `[vocab]`: the whole prompt was cached, its last column's logits too

    @property
    def linked_tokens(self) -> int:
        """Columns linked from chunk KV (after the cached run): `chunks` and every hole's."""
        return sum(c.num_tokens for c in self.chunks) + sum(c.num_tokens for h in self.holes for c in h.chunks)


def segment_keys(vlm, stream: StreamKeys, segment: PreparedSegment, start: int) -> int:
    """Add `segment`'s columns at positions from `start`; the position after it."""
    if not segment.ids:
        return start
    if segment.grids:  # [axes, L]; the axes agree on text tokens
        ids = torch.tensor([segment.ids], device=vlm.device)
        positions = vlm.positions(ids, torch.cat(segment.grids), start)[:, 0].cpu().numpy()
    else:  # text alone: consecutive positions, known on the host (no device work to read back)
        positions = np.broadcast_to(np.arange(start, start + len(segment.ids), dtype=np.int64),
                                    (vlm.adapter.rope_axes, len(segment.ids)))
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


def prompt_keys(vlm, prompt: LinkedPrompt) -> StreamKeys:
    stream, position = StreamKeys(), 0
    for i, text in enumerate(prompt.texts):
        position = segment_keys(vlm, stream, text, position)
        if i < len(prompt.groups):
            for chunk, identity in zip(prompt.groups[i], prompt.identities[i]):
                stream.add_item(b"chunk:" + identity + b"@" + str(position).encode(), chunk.num_tokens,
                                position + chunk.position_span)
                position += chunk.position_span
    return stream


@torch.inference_mode()
def resume(vlm, cache: PrefixCache | None, salt: bytes, prompt: LinkedPrompt, past_groups: bool = True,
           defer_texts: bool = False, final_logits: bool = False) -> Resumed:
    """`past_groups=False`: use cached columns only before the last group (selective recompute re-derives it).
    `defer_texts`: the texts still to compute before the last group come back as `holes` for the batched
    prefill (when none of them holds an image), instead of being forwarded here one by one.
    `final_logits`: a prompt cached to its end with its last column's logits comes back whole, with them."""
    stream = prompt_keys(vlm, prompt)
    starts = prompt.starts()  # [t0, g0, t1, g1, …, tn, end]
    last_group, last_text = starts[-3], starts[-2]
    ends = tuple(starts[1:-1:2]) + (stream.num_columns,)
    limit = stream.num_columns - 1 if past_groups else min(last_group, stream.num_columns - 1)
    blocks, columns, logits = [], 0, None
    if cache is not None and cache.enabled and limit > 0:
        size = cache.block_tokens
        hashes = block_hashes(salt, stream, size)  # every full block: a hit is cut back to `limit` below
        if final_logits and past_groups:
            logits = cache.get_logits(logits_key(salt, stream, hashes, size, stream.num_columns))
            limit = stream.num_columns if logits is not None else limit  # the last column need not be recomputed
        blocks = cache.match(hashes)
        columns = resume_point(blocks, size, limit)
        # A text before a group, a prompt and a whole stream (decoded tokens included) rarely end on a block: the
        # last partial block of each is stored under its own key (`store`). So past the full blocks found, the
        # longest partial block of this prompt's next columns is looked up, each length from the longest: an
        # identical request then prefills one token, and a follow-up turn whose history goes on past where the
        # earlier stream ended prefills none of that stream (≤ block_tokens - 1 keys of a few bytes each).
        first = len(blocks) * size
        for end in range(min(first + size - 1, stream.num_columns), first, -1):
            usable = min(end, limit)
            if usable <= columns:
                break
            partial = cache.get(partial_key(salt, stream, hashes, size, end))
            if partial is not None and partial.next_positions[usable - first - 1] >= 0:
                blocks, columns = blocks + [partial], usable
                break
        if columns < stream.num_columns:  # a block of the prompt was evicted: its end is computed after all
            logits = None
        cache.stats.hit_tokens += columns
    _, next_positions = stream.joined()
    position = int(next_positions[columns - 1]) if columns else 0
    # the cached run, copied block by block into the row it goes to (pipeline/runtime/kv.py `BlockRun`)
    base = BlockRun([b.kv for b in blocks], columns, max(position, 1)) if columns else None
    if columns >= last_text:  # the run reaches into the last text
        return Resumed(base, [], prompt.after.tail(columns - last_text), columns, stream, ends, logits=logits)
    # What remains before the last group: the rest of each text, the rest of each earlier group.
    rests = [text.tail(max(columns - starts[2 * i], 0)) if columns < starts[2 * i + 1] else None
             for i, text in enumerate(prompt.texts[:-1])]
    rests = [r if r is not None and r.ids else None for r in rests]  # an empty text leaves no hole
    defer = defer_texts and not any(r is not None and r.image_spans for r in rests)
    linked: list[ChunkKV] = []  # chunks after `base` before any hole (deferred), or the last group's
    holes: list[Hole] = []
    for i, rest in enumerate(rests):
        if rest is not None and defer:
            holes.append(Hole(rest, []))
        elif rest is not None:
            kv, position = _forward(vlm, base.kv if base is not None else None, rest, position)
            base = _base(kv, position)
        group_start, group_end = starts[2 * i + 1], starts[2 * i + 2]
        last = i == len(prompt.groups) - 1
        if columns < group_end or last:
            group = _from(prompt.groups[i], max(columns - group_start, 0))
            if defer or last:  # linked by the batched prefill's assembly
                (holes[-1].chunks if holes else linked).extend(group)
            else:
                kv, position = _link(vlm, base.kv if base is not None else None, group, position)
                base = _base(kv, position)
    return Resumed(base, linked, prompt.after, columns, stream, ends, holes)


def _from(group: list[ChunkKV], columns: int) -> list[ChunkKV]:
    """The chunks of `group` after its first `columns` columns (a cut at a chunk boundary)."""
    covered, index = 0, 0
    while covered < columns:
        covered += group[index].num_tokens
        index += 1
    return group[index:]


def _base(kv: torch.Tensor | None, position: int) -> ChunkKV | None:
    return None if kv is None or kv.shape[3] == 0 else ChunkKV(kv, max(position, 1), 0, ChunkKind.TEXT)


def _forward(vlm, cached: torch.Tensor | None, segment: PreparedSegment, start: int
             ) -> tuple[torch.Tensor | None, int]:
    """`segment` forwarded after `cached` `[layers, 2, kv_heads, n, head_dim]`: the KV of both, the next position."""
    if not segment.ids:
        return cached, start
    layers = [] if cached is None else [(cached[i, 0][None].to(vlm.dtype), cached[i, 1][None].to(vlm.dtype))
                                        for i in range(cached.shape[0])]
    cache = DynamicCache(ddp_cache_data=layers) if layers else DynamicCache()
    ids = torch.tensor([segment.ids], device=vlm.device)
    pixel_values = vlm.adapter.concat_pixels(segment.pixel_values) if segment.pixel_values else None
    grids = torch.cat(segment.grids) if segment.grids else None
    state = vlm._forward(ids, cache, start, pixel_values, grids)
    kv = torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in state.cache.layers])
    return kv, state.next_position


def _link(vlm, cached: torch.Tensor | None, chunks: list[ChunkKV], start: int) -> tuple[torch.Tensor | None, int]:
    """`chunks` re-anchored after `cached`: the KV of both, the next position."""
    if not chunks:
        return cached, start
    moved = [c if c.kv.device == vlm.device else ChunkKV(c.kv.to(vlm.device), c.position_span, c.compile_start,
                                                           c.kind, c.grid_thw, c.vision_tokens) for c in chunks]
    context = assemble(_base(cached, start), moved, vlm.rotations)
    kv = torch.stack([torch.stack([k[0], v[0]]) for k, v in context.layers])
    return kv, context.next_position


def store(vlm, cache: PrefixCache | None, salt: bytes, resumed: Resumed, kv: torch.Tensor, decoded: list[int],
          next_position: int, prompt_logits: torch.Tensor | None = None) -> None:
    """Keep a finished request's blocks: `kv` `[layers, 2, kv_heads, columns, head_dim]` is its prompt and the
    decoded tokens it fed back (`decoded`, ending at `next_position`), column for column; `prompt_logits`
    `[vocab]`, the logits the prompt's last column produced, under the prompt's end."""
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
    for end in sorted({*resumed.ends, kv.shape[3]}):  # the texts' ends, the prompt's, the whole stream's
        if end % size and end <= kv.shape[3]:
            first = (end // size) * size
            cache.put(partial_key(salt, stream, hashes, size, end), kv[:, :, :, first:end], next_positions[first:end])
    if prompt_logits is not None:
        cache.put_logits(logits_key(salt, stream, hashes, size, resumed.ends[-1]), prompt_logits)


def native_prompt(vlm, chunks: list[ChunkKV], query: str, instruction: str = "",
                  identities: list[bytes] | None = None) -> LinkedPrompt:
    """`[template prefix][instruction][chunks][query turn]` without a router (tests, benchmarks, evaluation).
    Without `identities` each chunk is named by the sha256 of its KV bytes: never two chunks under one name."""
    if identities is None:
        identities = [hashlib.sha256(c.kv.float().contiguous().cpu().numpy().tobytes()).hexdigest().encode()
                      for c in chunks]
    before = vlm.adapter.prefix_ids + (vlm.adapter.encode(instruction) if instruction else [])
    return LinkedPrompt.single(PreparedSegment(list(before)), list(chunks), identities,
                               PreparedSegment(vlm.query_turn_ids(query)))
