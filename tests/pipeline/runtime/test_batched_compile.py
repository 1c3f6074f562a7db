"""Batched compile is exact: chunks of different lengths compiled in one right-padded forward (float32, every
family incl. 1-D RoPE LLaVA-OneVision, every compile prefix) give, linked one by one and all together, the query
logits of the independent block-mask reference — one transformers forward over the flat prompt, with token ids
from the tokenizer and positions from the model's own `get_rope_index`
(tests/pipeline/runtime/test_runtime_exactness.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image

from schemas.modes import CompilePrefix
from tests.pipeline.runtime.test_runtime_exactness import (
    CONTROL_MARGIN,
    page_block,
    reference_query_logits,
    template_parts,
    tolerance,
)

QUERY = "Which part number ships on 12 March?"
WORDS = ["invoice", "part", "XK-4471-B", "ships", "on", "12", "March", "the", "total", "is", "$1,093.40", "Zoë"]


def page(rng: random.Random, width_px: int, height_px: int) -> Image.Image:
    pixels = np.random.default_rng(rng.randrange(2**32)).integers(0, 256, (height_px, width_px, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def sources(seed: int) -> dict[str, list]:
    rng = random.Random(seed)
    return {
        "text": [text(rng, n) for n in (3, 17, 9, 30)],  # different lengths: padded
        "image": [[page(rng, 112, 56)], [page(rng, 140, 112), page(rng, 84, 56)], [page(rng, 56, 84)],
                  [page(rng, 112, 56)]],  # one, two pages; different and equal shapes
    }


def linked_logits(vlm, chunks) -> torch.Tensor:
    """The serving path: the compiled chunks linked after the serving prefix, the query prefilled on top."""
    return vlm.prefill_query(vlm.assemble(chunks), QUERY, all_logits=True).logits[0]


def reference_tokens(vlm, piece) -> tuple[int, int]:
    """(tokens, vision tokens) of one chunk as the tokenizer and the model's own vision path count them."""
    if isinstance(piece, str):
        return len(vlm.tokenizer(piece, add_special_tokens=False).input_ids), 0
    _, before, after, _ = template_parts(vlm)
    encode = lambda markup: vlm.tokenizer(markup, add_special_tokens=False).input_ids  # noqa: E731
    ids, _, _ = page_block(vlm, piece, encode(before), encode(after))
    return len(ids), sum(t == vlm.model.config.image_token_id for t in ids)


@pytest.mark.parametrize("prefix", list(CompilePrefix))
@pytest.mark.parametrize("kind", ["text", "image"])
def test_batched_compile_matches_the_reference(vlm, kind, prefix):
    pieces = sources(3)[kind]
    batched = vlm.compile_many(pieces, prefix)
    assert len({chunk.num_tokens for chunk in batched}) > 1  # the batch really is ragged: rows are padded
    for piece, chunk in zip(pieces, batched):  # every row of the batch, linked on its own
        assert (chunk.num_tokens, chunk.vision_tokens) == reference_tokens(vlm, piece)
        reference = reference_query_logits(vlm, [piece], prefix, QUERY)
        assert float((linked_logits(vlm, [chunk]) - reference).abs().max()) <= tolerance(vlm)
    reference = reference_query_logits(vlm, pieces, prefix, QUERY)  # and all of them, in order
    assert float((linked_logits(vlm, batched) - reference).abs().max()) <= tolerance(vlm)


def test_negative_control_a_row_of_the_batch_is_checked_against_its_own_chunk(vlm):
    """The check above can fail: rows swapped between chunks, or one changed word, miss the reference by more
    than 20× the tolerance (measured: ≥ 6.8e-4 on every family, against 1e-5)."""
    pieces = sources(5)["text"]
    batched = vlm.compile_many(pieces)
    reference = reference_query_logits(vlm, pieces, CompilePrefix.TEMPLATE, QUERY)
    swapped = [batched[1], batched[0], *batched[2:]]
    assert float((linked_logits(vlm, swapped) - reference).abs().max()) > CONTROL_MARGIN * tolerance(vlm)
    changed = pieces[:1] + [pieces[1].replace("part", "invoice", 1) if "part" in pieces[1] else pieces[1] + " part"]
    moved = linked_logits(vlm, vlm.compile_many(changed + pieces[2:]))
    assert float((moved - reference).abs().max()) > CONTROL_MARGIN * tolerance(vlm)


def test_mixed_kinds_are_refused(vlm):
    with pytest.raises(ValueError, match="one kind"):
        vlm.compile_many(["some text", [page(random.Random(0), 56, 56)]])
