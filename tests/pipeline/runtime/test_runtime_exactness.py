"""Exactness of the PIC runtime: the quality oracle without trained weights (every family, float32 and bf16).

The block-mask reference is independent of the code under test: it takes token ids from the
tokenizer and the chat template as rendered, image token counts from the model's own vision path,
and every position from the model's own `get_rope_index` over the flat full-prefill sequence (1-D
families: 0..L-1). It never reads a compiled chunk's span or start. Negative controls prove it can fail.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.runtime.kv import assemble
from schemas.modes import ChunkKind, CompilePrefix
from schemas.sampling import Sampling

QUERY = "Which part number ships on 12 March?"
# float32: max |Δ logit| between the linked path and the reference at the tiny models' width (hidden 64).
# Measured 1.8e-7…4.8e-7 on every family (logits up to ~0.75); every negative control below misses by 7.6e-4
# or more. Wider models get `tolerance(vlm)`.
TOLERANCE, TOLERANCE_HIDDEN = 1e-5, 64
CONTROL_MARGIN = 20  # a negative control must miss the reference by this many tolerances


def tolerance(vlm) -> float:
    """TOLERANCE scaled by sqrt(hidden / 64) for a wider model (never below TOLERANCE).

    Why sqrt: the linked path and the reference compute the same float32 sums in different orders and shapes
    (other matmul blockings, attention over other column sets). Each addition rounds with relative error at most
    u = 2^-24; rounding errors that are independent and of either sign add as a random walk, so a length-n
    reduction is off by ~sqrt(n)·u relative to its terms (Higham & Mary 2019, "A new approach to probabilistic
    rounding error analysis", SIAM J. Sci. Comput. 41(5): the λ·sqrt(n)·u bound), and the difference of two
    orders likewise. A decoder's reductions (projections, the LM head; the MLP's, a fixed multiple wider) run
    over the hidden width, so the logits' gap grows with sqrt(hidden). Checked: Qwen2.5-VL / LLaVA-OneVision at
    hidden 3,584 give 7.5e-5; the full-width misses of the fixed 1e-5 (docs/BENCHMARKS.md real-shapes, 2026-12-04)
    were 1.00e-5…2.39e-5, all under it. The real-shape narrow models (hidden 256) get 2e-5."""
    hidden = vlm.model.config.get_text_config().hidden_size
    return TOLERANCE * math.sqrt(max(hidden, TOLERANCE_HIDDEN) / TOLERANCE_HIDDEN)


def page(rng: random.Random, width_px: int, height_px: int) -> Image.Image:
    """A noisy page so the vision tower sees non-trivial input."""
    pixels = np.random.default_rng(rng.randrange(2**32)).integers(0, 256, (height_px, width_px, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def random_text(rng: random.Random, num_words: int) -> str:
    words = ["invoice", "part", "XK-4471-B", "ships", "on", "12", "March", "the", "total", "is", "$1,093.40", "Zoë"]
    return " ".join(rng.choice(words) for _ in range(num_words))


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def compile_piece(vlm, piece, prefix: CompilePrefix):
    return vlm.compile_text(piece, prefix) if isinstance(piece, str) else vlm.compile_images(piece, prefix)


# ---- the independent reference ---------------------------------------------------------------------
def template_parts(vlm) -> tuple[str, str, str, str]:
    """(prefix, image markup before the image token, after it, turn suffix), cut from one rendered prompt."""
    rendered = vlm.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "\x01"}, {"type": "image"},
                                      {"type": "text", "text": "\x02"}]}], add_generation_prompt=True, tokenize=False)
    image_token = vlm.tokenizer.convert_ids_to_tokens(vlm.model.config.image_token_id)
    markup = rendered[rendered.index("\x01") + 1:rendered.index("\x02")]
    before, after = markup.split(image_token)
    return rendered[:rendered.index("\x01")], before, after, rendered[rendered.index("\x02") + 1:]


def page_block(vlm, pages, before: list[int], after: list[int]):
    """Token ids, pixel values and layout of pages, each page's image-token count as the model's own vision
    path produces features for it (LLaVA: its feature list; M-RoPE: patches / merge²)."""
    processed = vlm.image_processor(images=[p.convert("RGB") for p in pages], return_tensors="pt")
    pixels = processed["pixel_values"]
    if "image_grid_thw" in processed:
        grids = processed["image_grid_thw"]
        counts = [int(g.prod()) // vlm.model.config.vision_config.spatial_merge_size ** 2 for g in grids]
    else:
        grids = processed["image_sizes"]
        with torch.inference_mode():
            features = vlm.model.model.get_image_features(pixels.to(vlm.dtype), grids).pooler_output
        counts = [f.shape[0] for f in features]
    ids = [t for n in counts for t in before + [vlm.model.config.image_token_id] * n + after]
    return ids, pixels.to(vlm.dtype), grids


def flat_positions(vlm, ids: list[int], grids: list[torch.Tensor]) -> torch.Tensor:
    """`(axes, L)` positions of the flat prompt, as one full prefill lays it out (the model's own code)."""
    input_ids = torch.tensor([ids])
    if not hasattr(vlm.model.model, "get_rope_index"):  # 1-D RoPE: every token advances by one
        return torch.arange(len(ids)).view(1, -1)
    positions, _ = vlm.model.model.get_rope_index(
        input_ids, mm_token_type_ids=(input_ids == vlm.model.config.image_token_id).int(),
        image_grid_thw=torch.cat(grids) if grids else None)
    return positions[:, 0]


def reference_query_logits(vlm, pieces, prefix: CompilePrefix, query: str, instruction: str = "") -> torch.Tensor:
    """One forward over `[copy₁][c₁]…[copyₙ][cₙ][prefix + instruction][query]` with a block mask: each chunk
    sees its compile prefix copy and itself; the query sees the serving prefix, the instruction, every
    chunk and itself. Every block sits where the flat prompt `[prefix][instruction][c₁…cₙ][query]` puts it."""
    tokenizer = vlm.tokenizer
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    prefix_text, before, after, suffix = template_parts(vlm)
    serving = encode(prefix_text) + (encode(instruction) if instruction else [])
    copy_ids = {CompilePrefix.TEMPLATE: encode(prefix_text), CompilePrefix.NONE: [],
                CompilePrefix.DUMMY: vlm.adapter.dummy_prefix_ids}[prefix]  # the dummy variant's definition
    blocks, pixels, grids = [], [], []
    for piece in pieces:
        if isinstance(piece, str):
            blocks.append(encode(piece))
        else:
            ids, pixel_values, layout = page_block(vlm, piece, encode(before), encode(after))
            blocks.append(ids)
            pixels.append(pixel_values)
            grids.append(layout)
    query_ids = encode(query) + encode(suffix)
    flat = flat_positions(vlm, serving + [t for b in blocks for t in b] + query_ids, grids)
    ids, positions, spans = [], [], []
    cursor = len(serving)
    for block in blocks:  # [copy][chunk]: the copy ends right before the chunk's first position
        start = flat[:, cursor]
        copy_positions = (start[:, None] - len(copy_ids) + torch.arange(len(copy_ids))[None])
        spans.append((len(ids), len(ids) + len(copy_ids), len(ids) + len(copy_ids) + len(block)))
        ids += copy_ids + block
        positions += [copy_positions, flat[:, cursor:cursor + len(block)]]
        cursor += len(block)
    serving_from = len(ids)
    ids += serving
    positions.append(flat[:, :len(serving)])
    query_from = len(ids)
    ids += query_ids
    positions.append(flat[:, cursor:])

    total = len(ids)
    allowed = torch.zeros(total, total, dtype=torch.bool)
    causal = lambda n: torch.ones(n, n, dtype=torch.bool).tril()  # noqa: E731
    for block_from, chunk_from, block_to in spans:
        allowed[block_from:block_to, block_from:block_to] = causal(block_to - block_from)
        allowed[query_from:, chunk_from:block_to] = True
    allowed[serving_from:, serving_from:query_from] = True
    allowed[serving_from:query_from, serving_from:query_from] = causal(query_from - serving_from)
    allowed[query_from:, query_from:] = causal(total - query_from)
    # additive float mask in the model dtype: a bool mask is silently wrong under eager attention
    mask = torch.zeros(1, 1, total, total, dtype=vlm.dtype).masked_fill(~allowed, torch.finfo(vlm.dtype).min)
    input_ids = torch.tensor([ids])
    position_ids = torch.cat(positions, dim=1)
    kwargs = {"pixel_values": vlm.adapter.concat_pixels(pixels) if pixels else None}
    if position_ids.shape[0] == 3:
        kwargs.update(image_grid_thw=torch.cat(grids) if grids else None, position_ids=position_ids[:, None],
                      mm_token_type_ids=(input_ids == vlm.model.config.image_token_id).int())
    else:
        kwargs.update(image_sizes=torch.cat(grids) if grids else None, position_ids=position_ids)
    with torch.inference_mode():
        out = vlm.model(input_ids=input_ids, attention_mask=mask, **kwargs)
    return out.logits[0, query_from:]


def linked_query_logits(vlm, pieces, prefix: CompilePrefix, query: str, instruction: str = "",
                        rotation=None, mutate=lambda chunk: chunk) -> torch.Tensor:
    """The serving path: compile each piece, assemble after the serving prefix, prefill the query."""
    chunks = [mutate(compile_piece(vlm, piece, prefix)) for piece in pieces]
    if rotation is None:
        context = vlm.assemble(chunks, instruction)
    else:
        context = assemble(vlm.serving_prefix(instruction), chunks, rotation)
    return vlm.prefill_query(context, query, all_logits=True).logits[0]


def random_pieces(rng: random.Random) -> list:
    pieces = []
    for _ in range(rng.randrange(1, 5)):
        if rng.random() < 0.3:
            pieces.append(random_text(rng, rng.randrange(1, 25)))
        else:
            pieces.append([page(rng, rng.randrange(28, 170), rng.randrange(28, 170))
                           for _ in range(rng.choice([1, 1, 2]))])
    rng.shuffle(pieces)
    return pieces


# ---- 1. re-anchored keys equal keys compiled at the new position ------------------------------
@pytest.mark.parametrize("seed", range(3))
def test_reanchored_keys_match_keys_compiled_there(vlm, seed):
    rng = random.Random(seed)
    image = page(rng, rng.randrange(56, 200), rng.randrange(56, 200))
    text = random_text(rng, rng.randrange(3, 30))
    base, delta = rng.randrange(0, 200), rng.randrange(-150, 400)
    delta = max(delta, -base)
    for compile_at in (lambda offset: vlm.compile_images([image], position_offset=offset),
                       lambda offset: vlm.compile_text(text, position_offset=offset)):
        at_base, at_target = compile_at(base), compile_at(base + delta)
        assert at_target.compile_start == at_base.compile_start + delta
        moved = at_base.kv[:, 0].clone()  # rotate_keys_ works in place
        vlm.adapter.rotate_keys_(moved, torch.full((at_base.num_tokens,), delta))
        assert relative_error(moved, at_target.kv[:, 0]) <= 1e-4
        assert relative_error(at_base.kv[:, 1], at_target.kv[:, 1]) <= 1e-4  # values carry no position


# ---- 2. one chunk + query on top equals one full forward, and greedy decoding matches generate() ----
def test_single_chunk_prefill_equals_full_forward_and_generate(vlm):
    pages = [page(random.Random(7), 140, 98)]
    full = vlm.prefill_full([pages], QUERY, all_logits=True)
    linked = vlm.prefill_query(vlm.assemble([vlm.compile_images(pages)]), QUERY, all_logits=True)
    num_query = linked.logits.shape[1]
    assert float((linked.logits[0] - full.logits[0, -num_query:]).abs().max()) <= 1e-5
    assert linked.next_position == full.next_position

    sampling = Sampling(max_new_tokens=12)
    ours = vlm.generate(linked, sampling)
    pixel_values, grids, chunk_ids = vlm.image_inputs(pages)
    ids = torch.tensor([vlm.adapter.prefix_ids + chunk_ids + vlm.adapter.encode(QUERY) + vlm.adapter.turn_suffix_ids])
    inputs = vlm.adapter.model_inputs(ids, vlm.positions(ids, grids), pixel_values, grids)
    inputs.pop("position_ids")  # generate() derives them itself: an independent check of ours
    with torch.inference_mode():
        reference = vlm.model.generate(**inputs, attention_mask=torch.ones_like(ids),
                                       max_new_tokens=sampling.max_new_tokens,
                                       do_sample=False)[0, ids.shape[1]:].tolist()
    eot = vlm.adapter.end_of_turn_ids
    assert ours == reference[: next((i for i, t in enumerate(reference) if t in eot), len(reference))] and ours


# ---- 3. many chunks, every compile prefix, with and without an instruction, vs the reference -------
@pytest.mark.parametrize("seed", range(6))
def test_random_assemblies_match_masked_reference(vlm, seed):
    """Property test: random chunk counts, kinds, sizes and orders; template, prefix-free and dummy prefixes."""
    rng = random.Random(1000 + seed)
    pieces = random_pieces(rng)
    prefix = list(CompilePrefix)[seed % 3]
    instruction = random_text(rng, rng.randrange(2, 9)) + "\n\n" if seed % 2 else ""
    query = random_text(rng, rng.randrange(1, 10))
    ours = linked_query_logits(vlm, pieces, prefix, query, instruction)
    reference = reference_query_logits(vlm, pieces, prefix, query, instruction)
    assert float((ours - reference).abs().max()) <= tolerance(vlm)


# ---- 4. negative controls: each mutation of the serving path must be caught -------------------------
def t_only_rotation(adapter):
    """The adapter's rotation with the shift applied to M-RoPE's t axis alone (h and w left behind)."""
    real = adapter.rotary_emb

    def rotary(x, positions):
        kept = positions.clone()
        kept[1:] = 0
        return real(x, kept)

    broken = copy.copy(adapter)
    broken.__class__ = type("TOnlyAdapter", (type(adapter),), {"rotary_emb": property(lambda self: rotary)})
    return broken.rotation_matrices


MUTATIONS = {
    "identity rotation": dict(rotation=lambda deltas, head_dim: torch.eye(head_dim).expand(len(deltas), -1, -1)),
    "t-only shift": "t_only",
    "span = token count": dict(mutate=lambda c: dataclasses.replace(c, position_span=c.num_tokens)),
    # every chunk re-anchored one position past its slot (Δ+1): an off-by-one in the placement
    "Δ+1": dict(mutate=lambda c: dataclasses.replace(c, compile_start=c.compile_start - 1)),
}
ONE_AXIS_MUTATIONS = ("identity rotation", "Δ+1")  # the ones 1-D RoPE families can get wrong


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_negative_controls_fail_the_reference(vlm, mutation):
    if vlm.adapter.rope_axes == 1 and mutation not in ONE_AXIS_MUTATIONS:
        pytest.skip("1-D RoPE: one axis, and an image spans exactly its tokens")
    rng = random.Random(5)
    pieces = [[page(rng, 84, 140)], random_text(rng, 12), [page(rng, 196, 70), page(rng, 56, 56)], random_text(rng, 6)]
    kwargs = dict(rotation=t_only_rotation(vlm.adapter)) if MUTATIONS[mutation] == "t_only" else MUTATIONS[mutation]
    reference = reference_query_logits(vlm, pieces, CompilePrefix.TEMPLATE, QUERY)
    bound = tolerance(vlm)
    assert float((linked_query_logits(vlm, pieces, CompilePrefix.TEMPLATE, QUERY) - reference).abs().max()) <= bound
    broken = linked_query_logits(vlm, pieces, CompilePrefix.TEMPLATE, QUERY, **kwargs)
    assert float((broken - reference).abs().max()) > CONTROL_MARGIN * bound, f"the reference cannot see a {mutation}"


# ---- 5. bfloat16: the serving dtype, against bf16 references -----------------------------------------
# max |Δ logit| / max |logit| ≤ 2^-6 (four bf16 ulps at the logit scale). Measured 4.7e-3…8.3e-3 over four
# seeds and every family: the bf16 reference itself sits 5.4e-3…1.1e-2 from the float32 one. That noise is
# as large as a broken rotation's effect on these tiny models (5e-3…2e-2), so bf16 bounds precision only;
# correctness is the float32 suite's job.
BF16_TOLERANCE = 2**-6


def test_bf16_assembly_matches_bf16_references(vlm_bf16, vlm):
    rng = random.Random(9)
    one = [[page(rng, 140, 98)]]
    full = vlm_bf16.prefill_full(one, QUERY, all_logits=True).logits[0].float()
    linked = linked_query_logits(vlm_bf16, one, CompilePrefix.TEMPLATE, QUERY).float()
    assert relative_error(linked, full[-linked.shape[0]:]) <= BF16_TOLERANCE
    pieces, instruction = [[page(rng, 84, 140)], random_text(rng, 12), [page(rng, 196, 70)]], "Answer briefly.\n"
    ours = linked_query_logits(vlm_bf16, pieces, CompilePrefix.TEMPLATE, QUERY, instruction).float()
    reference = reference_query_logits(vlm_bf16, pieces, CompilePrefix.TEMPLATE, QUERY, instruction).float()
    assert relative_error(ours, reference) <= BF16_TOLERANCE
    # and no further from the float32 truth than twice the bf16 reference's own rounding (measured ≤1.3×)
    truth = reference_query_logits(vlm, pieces, CompilePrefix.TEMPLATE, QUERY, instruction)
    assert relative_error(ours, truth) <= 2 * relative_error(reference, truth)


# ---- 6. compiled metadata --------------------------------------------------------------------------
def test_chunk_metadata(vlm):
    rng = random.Random(3)
    image = vlm.compile_images([page(rng, 140, 84)])
    assert image.kind is ChunkKind.IMAGE and image.compile_start == len(vlm.adapter.prefix_ids)
    if vlm.adapter.rope_axes == 3:
        merge = vlm.adapter.merge_size
        (t, h, w), = image.grid_thw
        assert image.num_tokens == image.vision_tokens + 2 == t * h * w // merge**2 + 2  # + begin/end markup
        assert image.position_span == max(h, w) // merge + 2  # an image advances by its longer side
    else:
        assert image.position_span == image.num_tokens  # 1-D RoPE: every token advances by one
    text = vlm.compile_text("twelve tokens or so of plain text here", CompilePrefix.NONE)
    assert text.compile_start == 0 and text.position_span == text.num_tokens and text.vision_tokens == 0
    dummy = vlm.compile_text("twelve tokens", CompilePrefix.DUMMY)
    assert dummy.compile_start == len(vlm.adapter.prefix_ids) == len(vlm.adapter.dummy_prefix_ids)
    special = set(vlm.tokenizer.all_special_ids) | set(vlm.tokenizer.added_tokens_decoder)
    assert not special & set(vlm.adapter.dummy_prefix_ids)
