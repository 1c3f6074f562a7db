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
  distinct one — comes from the VLM's text KV cache (`VLM.text_kv`).
An online context (full_text, full_image) is the whole prompt with its pages as images: vLLM computes all of it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.runtime import VLM
from pipeline.runtime.kv import assemble
from schemas.config import ChunkKind
from schemas.errors import InvalidRequestError
from serve.engine.prepared import LinkedContext, OnlineContext, PreparedContext


@dataclass
class VllmPrompt:
    """One request as vLLM's `add_request` takes it, and the KV the connector supplies (None: nothing)."""

    prompt: dict[str, Any]  # vLLM's TokensPrompt: prompt_token_ids, multi_modal_data, multi_modal_uuids
    num_tokens: int  # the prompt's tokens once vLLM expands each image's pad
    claim_kv: torch.Tensor | None = None  # [layers, 2, tokens, kv_heads, head_dim]: its first tokens' KV


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


def linked_prompt(vlm: VLM, context: LinkedContext) -> VllmPrompt:
    """The prompt and claim of a linked context that `check` let through."""
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
    claimed = vlm.text_kv(before.ids)
    layers, _, heads, _, head_dim = claimed.kv.shape
    total = claimed.num_tokens + sum(c.num_tokens for c in prompt.groups[0])
    kv = torch.empty(layers, 2, heads, total, head_dim, dtype=claimed.kv.dtype, device=claimed.kv.device)
    assemble(claimed, prompt.groups[0], vlm.rotations, out=kv)  # the chunks are on the VLM's device already
    mm = {}
    if embeds:
        mm = {"multi_modal_data": {"image": {"image_embeds": torch.cat(embeds), "image_grid_thw": torch.cat(grids)}},
              "multi_modal_uuids": {"image": uuids}}
    # token-major once, here on the engine's thread before the request reaches vLLM: the connector's writes are views
    return VllmPrompt({"prompt_token_ids": ids, **mm}, prompt.num_tokens, kv.transpose(2, 3).contiguous())


def online_prompt(vlm: VLM, context: OnlineContext) -> VllmPrompt:
    """The whole prompt, its pages as images in order: vLLM computes all of it, as it would served alone."""
    whole = vlm.online_segment(context.texts, context.groups)
    pages = [page for group in context.groups for piece in group if not isinstance(piece, str) for page in piece]
    ids = collapse_images(whole.ids, vlm.adapter.image_token_id)
    mm = {"multi_modal_data": {"image": [p.convert("RGB") for p in pages]}} if pages else {}
    return VllmPrompt({"prompt_token_ids": ids, **mm}, whole.num_tokens)


def vllm_prompt(vlm: VLM, context: PreparedContext) -> VllmPrompt:
    return online_prompt(vlm, context) if context.online else linked_prompt(vlm, context)


def hidden_size(vlm: VLM) -> int:
    config = vlm.model.config
    return getattr(config, "text_config", config).hidden_size
