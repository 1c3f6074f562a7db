"""Issue 59 item 2 (static shapes where they cost nothing): on CUDA a forward reads the slab's width rounded up to a
bucket, so a run of decode steps repeats a few shapes (a captured step, a compiled kernel's cache) where the exact
width took a new one every step; the extra columns are unwritten and masked, so the logits are the same. Counted
on the CPU with the bucketing switched on (it is what a CUDA slab sets). Control: bucketing off sees one width per
step (the count test fails)."""

from __future__ import annotations

import pytest
import torch

from pipeline.runtime.fused import FusedDecoder
from pipeline.runtime.model import VLM
from schemas.config import ForwardSpec, ModelSpec
from serve.engine.qvpic.batch import decode_step
from serve.engine.qvpic.slab import bucket_width
from tests.pipeline.runtime.test_fused_forward import ragged_slab

EXACT = 1e-5  # the suite's fp32 tolerance (tests/pipeline/runtime/test_runtime_exactness.py)
STEPS = 30
CONTEXT = [50, 60]  # two rows' context columns (random KV standing in for linked chunks)


def test_buckets_are_64_columns_apart_up_to_1024_then_8_per_doubling():
    assert [bucket_width(w) for w in (1, 64, 65, 1000, 1024, 1025, 1153, 2049, 32_768)] == [
        64, 64, 128, 1024, 1024, 1152, 1280, 2304, 32_768]
    assert len({bucket_width(w) for w in range(1, 32_769)}) == 16 + 5 * 8  # 64..1024, then 5 doublings to 32k
    assert all(w <= bucket_width(w) <= w + max(63, w // 8) for w in range(1, 32_769))


@pytest.fixture(scope="module")
def vlm() -> VLM:
    vlm = VLM(ModelSpec(path="tiny-qwen"))
    vlm.fused = FusedDecoder(vlm.model, ForwardSpec())
    return vlm


def decode(vlm: VLM, bucketed: bool) -> tuple[list[int], list[torch.Tensor]]:
    """`STEPS` greedy decode steps over two ragged rows: the width each forward read, the logits of each step."""
    slab = ragged_slab(vlm, room=STEPS, context=CONTEXT)
    slab.bucketed = bucketed  # what a CUDA slab sets
    widths, logits, tokens = [], [], [5, 9]
    for _ in range(STEPS):
        out = decode_step(vlm, slab, tokens)
        widths.append(slab.width)
        logits.append(out)
        tokens = out.argmax(-1).tolist()
    return widths, logits


def test_a_run_of_decode_steps_repeats_a_few_widths_and_computes_the_same(vlm):
    exact, plain = decode(vlm, bucketed=False)
    widths, bucketed = decode(vlm, bucketed=True)
    assert len(set(exact)) == STEPS  # the exact width: a new shape every step (61 .. 90 columns)
    assert sorted(set(widths)) == [64, 90]  # 61..64 → 64, then 128 capped by the slab's capacity (90)
    assert all(w >= e for w, e in zip(widths, exact))
    assert max(float((a - b).abs().max()) for a, b in zip(plain, bucketed)) <= EXACT
    assert [a.argmax(-1).tolist() for a in plain] == [b.argmax(-1).tolist() for b in bucketed]  # the same tokens
