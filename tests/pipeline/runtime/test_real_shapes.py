"""Exactness at the real models' shapes: the checks of tests/pipeline/runtime/test_runtime_exactness.py and
tests/pipeline/runtime/test_batched_compile.py (the assembled context against the independent 4-D-mask reference, and
their
negative controls) on Qwen2.5-VL-7B, GLM-4.1V-9B and LLaVA-OneVision-7B built from their public configs
(pipeline/runtime/real_shapes.py: real head dimensions, rotary layout, vision patch/merge sizes and window
attention; 2 decoder layers, a 2-layer vision tower, a small vocabulary, random weights, float32).

Qwen2.5-VL and GLM-4.1V carry their real chat templates (tests/fixtures/chat_templates/). LLaVA-OneVision keeps
the factory's: its real template renders every image before any text, so the reference cannot cut the image
markup out of a text-image-text turn (its prefix and turn suffix are the same strings;
tests/pipeline/runtime/test_chat_templates.py
checks the real one).

CI runs one case of each check per family at `Width.NARROW` (the real head dimensions, rotary layout and vision
geometry with two heads per tower: the full widths take ~90 s a family just to build on two cores);
`QVPIC_REAL_SHAPES=full` runs every case the tiny-model suites run at the full public widths, as
`python -m benchmarks.quality.real_shapes` does and records in docs/BENCHMARKS.md. LLaVA-OneVision's pages cost ~1.5k
tokens each (384-px SigLIP tiles), so CI checks it on text chunks and the full run adds its pages.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from pipeline.runtime import REAL_SHAPES, VLM, Width, ensure_real_shape
from schemas.config import ModelSpec
from schemas.modes import CompilePrefix
from tests.pipeline.runtime import test_batched_compile as batched
from tests.pipeline.runtime import test_runtime_exactness as exact
from tests.support.paths import TESTS

pytestmark = pytest.mark.slow
FULL = os.environ.get("QVPIC_REAL_SHAPES") == "full"
WIDTH = Width.FULL if FULL else Width.NARROW
TEMPLATES = TESTS / "fixtures" / "chat_templates"
REAL_TEMPLATE = {"qwen2.5-vl-7b": "qwen2_5_vl_instruct.jinja", "glm-4.1v-9b": "glm4_1v_thinking.jinja"}
LLAVA = "llava-onevision-7b"


@pytest.fixture(scope="module", params=REAL_SHAPES)
def real_vlm(request):
    """One real-shape model at a time (at full width each holds 2–3 GB of float32 weights)."""
    template = (TEMPLATES / REAL_TEMPLATE[request.param]).read_text() if request.param in REAL_TEMPLATE else None
    vlm = VLM(ModelSpec(path=str(ensure_real_shape(request.param, template, width=WIDTH)), device="cpu"))
    vlm.name = request.param
    yield vlm
    del vlm
    gc.collect()


def needs_pages(vlm) -> None:
    if vlm.name == LLAVA and not FULL:
        pytest.skip("LLaVA-OneVision pages at real shape (~1.5k tokens each) run in the full set only")


def test_real_shape_is_the_public_one(real_vlm):
    """The loaded model has the real rotary layout: 128-channel heads; Qwen2.5-VL's sections [16, 24, 24] over
    all 64 frequencies, GLM-4.1V's [8, 12, 12] over half of them (32), LLaVA's plain 1-D RoPE over all 64."""
    config = real_vlm.model.config.text_config
    positions = torch.zeros(real_vlm.adapter.rope_axes, 1, 1, dtype=torch.long)  # (axes, batch, tokens)
    cos, _ = real_vlm.adapter.rotary_emb(torch.empty(0), positions if real_vlm.adapter.rope_axes == 3 else positions[0])
    head_dim = config.hidden_size // config.num_attention_heads
    expected = {"qwen2.5-vl-7b": (128, 128, [16, 24, 24]), "glm-4.1v-9b": (128, 64, [8, 12, 12]),
                LLAVA: (128, 128, None)}[real_vlm.name]
    assert (head_dim, cos.shape[-1], config.rope_parameters.get("mrope_section")) == expected


@pytest.mark.parametrize("seed", range(3) if FULL else [0])
def test_reanchored_keys(real_vlm, seed):
    needs_pages(real_vlm)
    exact.test_reanchored_keys_match_keys_compiled_there(real_vlm, seed)


def test_single_chunk_prefill_and_generate(real_vlm):
    needs_pages(real_vlm)
    exact.test_single_chunk_prefill_equals_full_forward_and_generate(real_vlm)


@pytest.mark.parametrize("seed", range(6) if FULL else [1])
def test_random_assemblies(real_vlm, seed):
    needs_pages(real_vlm)
    exact.test_random_assemblies_match_masked_reference(real_vlm, seed)


def test_text_assembly_every_prefix(real_vlm):
    """Text chunks only (cheap on every family, LLaVA included): each compile prefix, with an instruction."""
    pieces = [exact.random_text(exact.random.Random(s), n) for s, n in ((1, 14), (2, 5), (3, 22))]
    for prefix in CompilePrefix:
        ours = exact.linked_query_logits(real_vlm, pieces, prefix, exact.QUERY, "Answer briefly.\n")
        reference = exact.reference_query_logits(real_vlm, pieces, prefix, exact.QUERY, "Answer briefly.\n")
        assert float((ours - reference).abs().max()) <= exact.tolerance(real_vlm)


@pytest.mark.parametrize("mutation", list(exact.MUTATIONS) if FULL else ["t-only shift"])
def test_negative_controls(real_vlm, mutation):
    if real_vlm.name == LLAVA:
        needs_pages(real_vlm)
    exact.test_negative_controls_fail_the_reference(real_vlm, mutation)


@pytest.mark.parametrize("mutation", exact.ONE_AXIS_MUTATIONS)
def test_negative_control_on_text(real_vlm, mutation):
    """The controls every family can fail, on text chunks, so CI sees them fail on LLaVA-OneVision too: the
    identity rotation, and every chunk re-anchored one position off (Δ+1), each missing the reference by more
    than CONTROL_MARGIN of the width-scaled tolerance, while the unmutated assembly stays within it."""
    pieces = [exact.random_text(exact.random.Random(s), n) for s, n in ((4, 12), (5, 9))]
    reference = exact.reference_query_logits(real_vlm, pieces, CompilePrefix.TEMPLATE, exact.QUERY)
    bound = exact.tolerance(real_vlm)
    ours = exact.linked_query_logits(real_vlm, pieces, CompilePrefix.TEMPLATE, exact.QUERY)
    broken = exact.linked_query_logits(real_vlm, pieces, CompilePrefix.TEMPLATE, exact.QUERY,
                                       **exact.MUTATIONS[mutation])
    assert float((ours - reference).abs().max()) <= bound
    assert float((broken - reference).abs().max()) > exact.CONTROL_MARGIN * bound


@pytest.mark.parametrize("kind,prefix", [(k, p) for k in ("text", "image") for p in CompilePrefix] if FULL
                         else [("text", CompilePrefix.DUMMY)])
def test_batched_compile(real_vlm, kind, prefix):
    if kind == "image":
        needs_pages(real_vlm)
    batched.test_batched_compile_matches_the_reference(real_vlm, kind, prefix)


@pytest.mark.skipif(not FULL, reason="full set only")
def test_batched_negative_control(real_vlm):
    batched.test_negative_control_a_row_of_the_batch_is_checked_against_its_own_chunk(real_vlm)
