"""Batched compile equals single-chunk compile (float32, every family incl. 1-D RoPE LLaVA-OneVision, every
compile prefix): several chunks of one kind in one
right-padded forward give the KV each chunk gets alone — checked on what serving does with it, the
logits of a query prefilled on the linked chunks, and the greedy tokens that follow."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.runtime import ChunkKV
from schemas.config import CompilePrefix
from schemas.sampling import Sampling

QUERY = "Which part number ships on 12 March?"
WORDS = ["invoice", "part", "XK-4471-B", "ships", "on", "12", "March", "the", "total", "is", "$1,093.40", "Zoë"]


def page(rng: random.Random, width_px: int, height_px: int) -> Image.Image:
    pixels = np.random.default_rng(rng.randrange(2**32)).integers(0, 256, (height_px, width_px, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def query_logits(vlm, chunks: list[ChunkKV]) -> tuple[torch.Tensor, list[int]]:
    """Logits of every query token prefilled on the linked chunks, and 6 greedy tokens after them."""
    state = vlm.prefill_query(vlm.assemble(chunks), QUERY, all_logits=True)
    logits = state.logits[0].clone()
    return logits, vlm.generate(state, Sampling(max_new_tokens=6))


def sources(seed: int) -> dict[str, list]:
    rng = random.Random(seed)
    return {
        "text": [text(rng, n) for n in (3, 17, 9, 30)],  # different lengths: padded
        "image": [[page(rng, 112, 56)], [page(rng, 140, 112), page(rng, 84, 56)], [page(rng, 56, 84)],
                  [page(rng, 112, 56)]],  # one, two pages; different and equal shapes
    }


@pytest.mark.parametrize("prefix", list(CompilePrefix))
@pytest.mark.parametrize("kind", ["text", "image"])
def test_batched_compile_equals_single(vlm, kind, prefix):
    chunks = sources(3)[kind]
    single = [vlm.compile_many([c], prefix)[0] for c in chunks]
    batched = vlm.compile_many(chunks, prefix)
    for one, many in zip(single, batched):
        assert (many.num_tokens, many.position_span, many.compile_start, many.kind, many.grid_thw,
                many.vision_tokens) == (one.num_tokens, one.position_span, one.compile_start, one.kind,
                                        one.grid_thw, one.vision_tokens)
        assert float((many.kv - one.kv).abs().max()) <= 1e-5
    logits_single, tokens_single = query_logits(vlm, single)
    logits_batched, tokens_batched = query_logits(vlm, batched)
    assert float((logits_batched - logits_single).abs().max()) <= 1e-5
    assert tokens_batched == tokens_single


def test_one_chunk_batch_is_the_single_compile_bit_for_bit(vlm):
    (chunk,) = sources(4)["image"][:1]
    assert torch.equal(vlm.compile_many([chunk])[0].kv, vlm.compile_images(chunk).kv)


def test_negative_control_the_tolerance_sees_one_changed_word(vlm):
    """The 1e-5 bound is meaningful: changing one word of one chunk moves the query logits far past it."""
    chunks = sources(5)["text"]
    changed = chunks[:1] + [chunks[1].replace("part", "invoice", 1) if "part" in chunks[1] else chunks[1] + " part"]
    changed += chunks[2:]
    reference, _ = query_logits(vlm, vlm.compile_many(chunks))
    moved, _ = query_logits(vlm, vlm.compile_many(changed))
    assert float((moved - reference).abs().max()) > 1e-3


def test_mixed_kinds_are_refused(vlm):
    with pytest.raises(ValueError, match="one kind"):
        vlm.compile_many(["some text", [page(random.Random(0), 56, 56)]])
