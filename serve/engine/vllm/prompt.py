"""A prepared context (serve/engine/prepared.py) as vLLM takes it: the prompt, its images, and what qvpic's
connector supplies (serve/engine/vllm/connector.py).

A linked context `[texts[0]][group 0][texts[1]]` becomes
- the prompt vLLM tokenises nothing of: `texts[0]`'s ids, each chunk's placeholder ids, `texts[1]`'s ids. An image
  chunk's pages are `<|vision_start|><|image_pad|><|vision_end|>` with one pad per page, and its image input is
  the page's grid with zero embeddings: vLLM expands each pad to the grid's token count and derives every
  token's M-RoPE (t, h, w) position from the grids — the same layout qvpic compiled and re-anchored to, so the
  query's positions after the chunk are qvpic's. The embeddings are never read: the connector claims every chunk
  token, and vLLM runs no encoder input whose tokens are already computed. A text chunk's placeholders are ids
  drawn from its entry identity: positions of text are 1-D, so any ids place it; vLLM's prefix cache keys blocks
  by ids (and images by `multi_modal_uuids`, the entry identity here), so a chunk's blocks are its own.
- a claim: `[texts[0] KV][each chunk's KV re-anchored where it lands]` (pipeline.runtime.kv.assemble, the
  re-anchoring qvpic's own engine runs). texts[0] — the template prefix and the instruction, computed once per
  distinct one — comes from the VLM's text KV cache (`VLM.text_kv`). When texts[0] holds a conversation's earlier
  turns (`has_history`: new every turn), vLLM computes it instead, in a prefill-only request of its own (the
  engine's history pass, `VllmPrompt.history_ids`), and the claim is the chunks alone, re-anchored after it.
An online context (full_text, full_image) is the whole prompt with its pages as images: vLLM computes all of it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.runtime import VLM, ChunkKV
from pipeline.runtime.kv import assemble
from schemas.errors import InvalidRequestError
from schemas.modes import ChunkKind
from serve.engine.prepared import LinkedContext, OnlineContext, PreparedContext


@dataclass
class VllmPrompt:
    """One request as vLLM's `add_request` takes it, and the KV the connector supplies (None: nothing)."""

    prompt: dict[str, Any]  # vLLM's TokensPrompt: prompt_token_ids, multi_modal_data, multi_modal_uuids
    num_tokens: int  # the prompt's tokens once vLLM expands each image's pad
    claim_kv: torch.Tensor | None = None  # [layers, 2, tokens, kv_heads, head_dim]: KV from column `claim_offset`
    claim_offset: int = 0  # the columns before the claim's KV: vLLM's history pass computes them
    history_ids: list[int] | None = None  # those columns' token ids (the prompt's first), for the history pass


def collapse_images(ids: list[int], image_token_id: int) -> list[int]:
    """Each run of image tokens as one pad: vLLM expands a pad to its image's token count itself."""
    return [t for i, t in enumerate(ids) if t != image_token_id or i == 0 or ids[i - 1] != image_token_id]


def identity_ids(identity: bytes, count: int, vocab: int, avoid: set[int]) -> list[int]:
    """`count` token ids drawn from `identity` (never one of `avoid`): a text chunk's placeholders."""
    ids, counter = [], 0
    while len(ids) < count:
        digest = hashlib.sha256(identity + counter.to_bytes(4, "little")).digest()
        for i in range(0, len(digest), 4):
            token = int.from_bytes(digest[i:i + 4], "little") % vocab
            if token not in avoid and len(ids) < count:
                ids.append(token)
        counter += 1
    return ids


def refuse(what: str, param: str) -> InvalidRequestError:
    error = InvalidRequestError(f"{what} runs on qvpic's engine only (generator.engine.kind: qvpic); this "
                                "generator runs vLLM's (docs/DEPLOY.md, 'Engines')")
    error.param = param
    return error


def check(context: PreparedContext) -> None:
    """InvalidRequestError, naming it, for what of `context` only qvpic's engine serves (cheap: before queueing)."""
    if context.online:
        if any(text.image_spans for text in context.texts):
            raise refuse("images in the conversation's messages", "messages")
        return
    if context.recompute is not None:
        raise refuse("selective recompute", "recompute")
    if len(context.prompt.groups) != 1:
        raise refuse("chunks in more than one user turn (history_chunks)", "history_chunks")
    if any(text.image_spans for text in context.prompt.texts):
        raise refuse("images in the conversation's messages beside linked chunks", "messages")


def has_history(vlm: VLM, ids: list[int]) -> bool:
    """Whether `ids` (a linked prompt's texts[0]) end more turns than the template prefix does: a conversation's
    earlier messages, which vLLM computes (the serving prefix and its instruction repeat, and qvpic keeps their KV)."""
    ends = vlm.adapter.end_of_turn_ids
    return sum(t in ends for t in ids) > sum(t in ends for t in vlm.adapter.prefix_ids)


def linked_prompt(vlm: VLM, context: LinkedContext, history: bool = False) -> VllmPrompt:
    """The prompt and claim of a linked context that `check` let through; with `history`, texts[0] is left to vLLM's
    history pass and the claim starts after it."""
    prompt = context.prompt
    before, after = prompt.texts
    adapter = vlm.adapter
    avoid = {adapter.image_token_id, *adapter.end_of_turn_ids}
    ids, embeds, grids, uuids = list(before.ids), [], [], []
    for chunk, identity in zip(prompt.groups[0], prompt.identities[0]):
        if chunk.kind is ChunkKind.TEXT:
            ids += identity_ids(identity, chunk.num_tokens, vlm.vocab_size, avoid)
            continue
        for page, grid in enumerate(chunk.grid_thw):
            page_grid = torch.tensor([grid])
            page_ids = adapter.image_ids(page_grid[0])
            ids += collapse_images(page_ids, adapter.image_token_id)
            tokens = sum(t == adapter.image_token_id for t in page_ids)
            embeds.append(torch.zeros(tokens, hidden_size(vlm), dtype=vlm.dtype))
            grids.append(page_grid)
            uuids.append(f"{identity.hex()}-{page}")
    ids += after.ids
    chunks = prompt.groups[0]
    if history:  # no KV before the chunks: a stand-in that only places them (texts[0] is text: 1-D positions)
        like = (chunks[0].kv if chunks else vlm.text_kv(vlm.adapter.prefix_ids).kv).narrow(3, 0, 0)
        claimed = ChunkKV(like, position_span=before.num_tokens, compile_start=0, kind=ChunkKind.TEXT)
    else:
        claimed = vlm.text_kv(before.ids)
    layers, _, heads, _, head_dim = claimed.kv.shape
    total = claimed.num_tokens + sum(c.num_tokens for c in chunks)
    kv = torch.empty(layers, 2, heads, total, head_dim, dtype=claimed.kv.dtype, device=claimed.kv.device)
    if chunks or claimed.num_tokens:
        assemble(claimed, chunks, vlm.rotations, out=kv)  # the chunks are on the VLM's device already
    mm = {}
    if embeds:
        mm = {"multi_modal_data": {"image": {"image_embeds": torch.cat(embeds), "image_grid_thw": torch.cat(grids)}},
              "multi_modal_uuids": {"image": uuids}}
    # token-major once, here on the engine's thread before the request reaches vLLM: the connector's writes are views
    return VllmPrompt({"prompt_token_ids": ids, **mm}, prompt.num_tokens, kv.transpose(2, 3).contiguous(),
                      claim_offset=before.num_tokens if history else 0,
                      history_ids=list(before.ids) if history else None)


def online_prompt(vlm: VLM, context: OnlineContext) -> VllmPrompt:
    """The whole prompt, its pages as images in order: vLLM computes all of it, as it would served alone."""
    whole = vlm.online_segment(context.texts, context.groups)
    pages = [page for group in context.groups for piece in group if not isinstance(piece, str) for page in piece]
    ids = collapse_images(whole.ids, vlm.adapter.image_token_id)
    mm = {"multi_modal_data": {"image": [p.convert("RGB") for p in pages]}} if pages else {}
    return VllmPrompt({"prompt_token_ids": ids, **mm}, whole.num_tokens)


def vllm_prompt(vlm: VLM, context: PreparedContext) -> VllmPrompt:
    if context.online:
        return online_prompt(vlm, context)
    return linked_prompt(vlm, context, history=has_history(vlm, context.prompt.before.ids))


def hidden_size(vlm: VLM) -> int:
    config = vlm.model.config
    return getattr(config, "text_config", config).hidden_size
