"""Exactness of the PIC runtime: the quality oracle without trained weights (float32, both families)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.runtime.kv import ChunkKV, chunk_starts
from schemas.sampling import Sampling
from schemas.config import ChunkKind, CompilePrefix

QUERY = "Which part number ships on 12 March?"


def page(rng: random.Random, width_px: int, height_px: int) -> Image.Image:
    """A noisy page so the vision tower sees non-trivial input."""
    pixels = np.random.default_rng(rng.randrange(2**32)).integers(0, 256, (height_px, width_px, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def random_text(rng: random.Random, num_words: int) -> str:
    words = ["invoice", "part", "XK-4471-B", "ships", "on", "12", "March", "the", "total", "is", "$1,093.40", "Zoë"]
    return " ".join(rng.choice(words) for _ in range(num_words))


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# ---- 1. re-anchored keys equal keys compiled at the new position ------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_reanchored_keys_match_keys_compiled_there(vlm, seed):
    rng = random.Random(seed)
    image = page(rng, rng.randrange(56, 200), rng.randrange(56, 200))
    text = random_text(rng, rng.randrange(3, 30))
    base, delta = rng.randrange(0, 200), rng.randrange(-150, 400)
    delta = max(delta, -base)
    for compile_at in (
        lambda offset: vlm.compile_images([image], position_offset=offset),
        lambda offset: vlm.compile_text(text, position_offset=offset),
    ):
        at_base, at_target = compile_at(base), compile_at(base + delta)
        assert at_target.compile_start == at_base.compile_start + delta
        moved = vlm.adapter.rotate_keys(at_base.kv[:, 0], torch.full((at_base.num_tokens,), delta))
        assert relative_error(moved, at_target.kv[:, 0]) <= 1e-4
        assert relative_error(at_base.kv[:, 1], at_target.kv[:, 1]) <= 1e-4  # values carry no position


# ---- 2. one chunk + query on top equals one full forward ---------------------------------------
def test_single_chunk_prefill_equals_full_forward(vlm):
    rng = random.Random(7)
    pages = [page(rng, 140, 98)]
    full = vlm.prefill_full([pages], QUERY, all_logits=True)

    # (a) prefix kept: one forward over [prefix][chunk], the query prefilled on that very cache
    pixel_values, grids, chunk_ids = vlm.image_inputs(pages)
    ids = torch.tensor([vlm.adapter.prefix_ids + chunk_ids])
    positions = vlm.positions(ids, grids)
    with torch.inference_mode():
        out = vlm.model(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grids,
                        mm_token_type_ids=(ids == vlm.adapter.image_token_id).int(), position_ids=positions,
                        use_cache=True)
    query_ids = torch.tensor([vlm.adapter.encode(QUERY) + vlm.adapter.turn_suffix_ids])
    kept = vlm._forward(query_ids, out.cache, int(positions.max()) + 1, logits_to_keep=0)
    assert float((kept.logits[0] - full.logits[0, -query_ids.shape[1]:]).abs().max()) <= 1e-5

    # (b) the serving path: prefix stripped at compile, serving prefix computed once, chunk linked
    chunk = vlm.compile_images(pages)
    linked = vlm.prefill_query(vlm.assemble([chunk]), QUERY, all_logits=True)
    assert float((linked.logits[0] - full.logits[0, -query_ids.shape[1]:]).abs().max()) <= 1e-5
    assert linked.next_position == full.next_position

    # greedy decoding on the linked cache is token-identical to transformers' generate() on the full prompt
    sampling = Sampling(max_new_tokens=12)
    ours = vlm.generate(linked, sampling)
    full_ids = torch.tensor([vlm.adapter.prefix_ids + chunk_ids + query_ids[0].tolist()])
    with torch.inference_mode():
        reference = vlm.model.generate(
            input_ids=full_ids, attention_mask=torch.ones_like(full_ids), pixel_values=pixel_values,
            image_grid_thw=grids, mm_token_type_ids=(full_ids == vlm.adapter.image_token_id).int(),
            max_new_tokens=sampling.max_new_tokens, do_sample=False,
        )[0, full_ids.shape[1]:].tolist()
    eot = vlm.adapter.end_of_turn_ids
    reference = reference[: next((i for i, t in enumerate(reference) if t in eot), len(reference))]
    assert ours == reference and len(ours) > 0


# ---- 3 & 4. many chunks, re-anchored, vs an independent 4-D-mask reference ---------------------
def reference_query_logits(vlm, pieces, with_template: bool, query: str) -> torch.Tensor:
    """One forward over `[P copy₁][c₁]…[P copyₙ][cₙ][serving P][query]` with a block mask.

    Each chunk sees only its own prefix copy and itself; the query sees the serving prefix, every
    chunk and itself. Positions: each block at its compile-time positions shifted to s_i.
    """
    adapter = vlm.adapter
    prefix = CompilePrefix.TEMPLATE if with_template else CompilePrefix.NONE
    compiled = [vlm.compile_images(p, prefix) if not isinstance(p, str) else vlm.compile_text(p, prefix) for p in pieces]
    starts = chunk_starts(len(adapter.prefix_ids), compiled)
    ids, positions, blocks, pixels, grids = [], [], [], [], []
    for piece, chunk, start in zip(pieces, compiled, starts):
        if isinstance(piece, str):
            chunk_ids, block_grids = adapter.encode(piece), None
        else:
            pixel_values, block_grids, chunk_ids = vlm.image_inputs(piece)
            pixels.append(pixel_values)
            grids.append(block_grids)
        copy = adapter.prefix_ids if with_template else []
        block = torch.tensor([copy + chunk_ids])
        block_pos = vlm.positions(block, block_grids) + (start - chunk.compile_start)
        blocks.append((len(ids), len(ids) + len(copy), len(ids) + block.shape[1]))
        ids += block[0].tolist()
        positions.append(block_pos)
    serving_from = len(ids)
    ids += adapter.prefix_ids
    positions.append(vlm.positions(torch.tensor([adapter.prefix_ids]), None))
    next_position = starts[-1] + compiled[-1].position_span
    query_ids = adapter.encode(query) + adapter.turn_suffix_ids
    query_from = len(ids)
    ids += query_ids
    positions.append(vlm.positions(torch.tensor([query_ids]), None, next_position))

    total = len(ids)
    allowed = torch.zeros(total, total, dtype=torch.bool)
    causal = lambda a, b: torch.ones(b - a, b - a, dtype=torch.bool).tril()  # noqa: E731
    for block_from, chunk_from, block_to in blocks:
        allowed[block_from:block_to, block_from:block_to] = causal(block_from, block_to)
        allowed[query_from:, chunk_from:block_to] = True
    allowed[serving_from:query_from, serving_from:query_from] = causal(serving_from, query_from)
    allowed[query_from:, serving_from:query_from] = True
    allowed[query_from:, query_from:] = causal(query_from, total)
    mask = torch.zeros(1, 1, total, total, dtype=vlm.dtype).masked_fill(~allowed, torch.finfo(vlm.dtype).min)

    input_ids = torch.tensor([ids])
    with torch.inference_mode():
        out = vlm.model(
            input_ids=input_ids, attention_mask=mask, position_ids=torch.cat(positions, dim=2),
            pixel_values=torch.cat(pixels) if pixels else None, image_grid_thw=torch.cat(grids) if grids else None,
            mm_token_type_ids=(input_ids == adapter.image_token_id).int(),
        )
    return out.logits[0, query_from:]


def linked_query_logits(vlm, pieces, with_template: bool, query: str) -> torch.Tensor:
    prefix = CompilePrefix.TEMPLATE if with_template else CompilePrefix.NONE
    chunks: list[ChunkKV] = [vlm.compile_images(p, prefix) if not isinstance(p, str)
                             else vlm.compile_text(p, prefix) for p in pieces]
    return vlm.prefill_query(vlm.assemble(chunks), query, all_logits=True).logits[0]


def test_three_mixed_chunks_match_masked_reference(vlm):
    rng = random.Random(11)
    pieces = [[page(rng, 84, 140)], random_text(rng, 12), [page(rng, 196, 70), page(rng, 56, 56)]]
    ours = linked_query_logits(vlm, pieces, True, QUERY)
    reference = reference_query_logits(vlm, pieces, True, QUERY)
    assert float((ours - reference).abs().max()) <= 1e-4


@pytest.mark.parametrize("seed", range(6))
def test_random_assemblies_match_masked_reference(vlm, seed):
    """Property test: random chunk counts, kinds, sizes and orders, with and without the template."""
    rng = random.Random(1000 + seed)
    pieces = []
    for _ in range(rng.randrange(1, 5)):
        if rng.random() < 0.3:
            pieces.append(random_text(rng, rng.randrange(1, 25)))
        else:
            pieces.append([page(rng, rng.randrange(28, 170), rng.randrange(28, 170))
                           for _ in range(rng.choice([1, 1, 2]))])
    rng.shuffle(pieces)
    with_template = seed % 3 != 2  # every third case: plain (prefix-free) chunks, as image PIC compiles them
    query = random_text(rng, rng.randrange(1, 10))
    ours = linked_query_logits(vlm, pieces, with_template, query)
    reference = reference_query_logits(vlm, pieces, with_template, query)
    assert float((ours - reference).abs().max()) <= 1e-4


def test_chunk_metadata(vlm):
    rng = random.Random(3)
    image = vlm.compile_images([page(rng, 140, 84)])
    merge = vlm.adapter.merge_size
    (t, h, w), = image.grid_thw
    assert image.kind is ChunkKind.IMAGE
    assert image.num_tokens == t * h * w // merge**2 + 2  # image tokens + begin/end markup
    assert image.position_span == max(h, w) // merge + 2  # an image advances by its longer side, not its tokens
    assert image.compile_start == len(vlm.adapter.prefix_ids)
    text = vlm.compile_text("twelve tokens or so of plain text here", CompilePrefix.NONE)
    assert text.compile_start == 0 and text.position_span == text.num_tokens
