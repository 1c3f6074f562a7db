"""Issue 59 item 2 (static shapes where they cost nothing), the batch dimension: on CUDA a slab allocates its rows
rounded up to a bucket (serve/engine/qvpic/shapes.py `bucket_rows`) and a decode step runs over the padding rows
too, so rows joining and leaving change the step's shape only when they cross a bucket. Padding rows are inert:
each writes at column 0 of its own row and sees only that, and its logits are cut off before the sampler. Counted on
the CPU with the bucketing switched on (`shapes.buckets_on`, what a CUDA device answers).

Expected tokens come from the same engine unpadded (the CPU's default), not from the code under test. Controls (see
the report of the change that added this file): the unpadded run is checked to see row counts off the buckets (the
bucket assertion fails on it); padding rows aliased to the last real row (they write its column 0) and a sampler
drawing for the padding rows from a seeded row's generator both fail the token/logit equality."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipeline.runtime.fused import FusedDecoder
from pipeline.runtime.model import VLM
from schemas.config import EngineConfig, ForwardSpec, ModelSpec
from serve.engine.qvpic import batch, shapes
from serve.engine.qvpic.batch import decode_step
from serve.engine.qvpic.scheduler import Scheduler
from serve.engine.qvpic.shapes import bucket_rows
from serve.engine.sequence import Status
from tests.pipeline.runtime.test_fused_forward import ragged_slab
from tests.serve.engine.test_engine import Recorder, linked
from tests.serve.engine.test_syncs import ONE_READ, phases
from tests.support.sync_counter import counting_syncs

BUCKETS = {1, 2, 4, 8, 16, 24}
TOLERANCE = 1e-5  # the engine tests' fp32 tolerance (tests/serve/engine/test_engine.py)


def test_buckets_are_1_2_4_then_multiples_of_8():
    assert [bucket_rows(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 128)] == [
        0, 1, 2, 4, 4, 8, 8, 16, 16, 24, 40, 128]
    assert len({bucket_rows(n) for n in range(1, 129)}) == 3 + 16
    assert all(n <= bucket_rows(n) <= n + 7 for n in range(1, 1025))


def test_the_kv_cap_counts_the_padding_rows():
    """Three rows of 100 columns fit a cap of 3 rows' bytes unpadded; padded to 4 they do not."""
    config = EngineConfig(max_kv_nbytes=3 * 100, max_batch_size=8)
    plain, padded = Scheduler(config, 1), Scheduler(config, 1, bucket_rows)
    for scheduler in (plain, padded):
        scheduler.join([SimpleNamespace(id=i) for i in range(2)], {0: 100, 1: 100})
    joining = [SimpleNamespace(id=9, members=[None], max_columns=100, num_query_tokens=1,
                               context=SimpleNamespace(online=True))]
    assert plain._fits(joining) and not padded._fits(joining)


@pytest.fixture(scope="module")
def fused_qwen() -> VLM:
    vlm = VLM(ModelSpec(path="tiny-qwen"))
    vlm.fused = FusedDecoder(vlm.model, ForwardSpec())
    return vlm


def decode(vlm: VLM, monkeypatch, padded: bool, steps: int = 8) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Five ragged rows decoded greedily, widths bucketed either way: the slab's KV and each step's logits."""
    monkeypatch.setattr(shapes, "buckets_on", lambda device: padded)
    # a padding token whose KV is not zero (token 0's is, in the tiny models: zero embedding, zero biases), so a
    # padding row's write shows wherever it lands
    monkeypatch.setattr(batch, "PADDING_TOKEN", 5)
    slab = ragged_slab(vlm, room=steps, context=[30, 41, 25, 50, 33])
    slab.bucketed = True
    out, tokens = [], [5, 9, 11, 7, 3]
    for _ in range(steps):
        logits = decode_step(vlm, slab, tokens)
        assert slab.forward_rows == (8 if padded else 5) and logits.shape[0] == 5
        out.append(logits.clone())
        tokens = logits.argmax(-1).tolist()
    return slab.kv, out


@pytest.mark.parametrize("forward", ["fused", "transformers"])
def test_a_padded_decode_step_computes_the_real_rows_alike(fused_qwen, monkeypatch, forward):
    """5 rows in a step of 8: logits and KV equal to the 5-row step's, bit for bit on the fused forward (the
    engine's on Qwen); transformers' products round by their row count (as a join does today): to ≤1e-5 there."""
    monkeypatch.setattr(fused_qwen, "fused", fused_qwen.fused if forward == "fused" else None)
    plain_kv, plain = decode(fused_qwen, monkeypatch, padded=False)
    padded_kv, padded = decode(fused_qwen, monkeypatch, padded=True)
    assert padded_kv.shape[2] == 8 and plain_kv.shape[2] == 5
    tolerance = 0.0 if forward == "fused" else TOLERANCE
    assert max(float((a - b).abs().max()) for a, b in zip(plain, padded)) <= tolerance
    assert float((padded_kv[:, :, :5] - plain_kv).abs().max()) <= tolerance
    # padding rows wrote their scratch column 0 (every step) and nothing else
    assert padded_kv[:, :, 5:, :, 0].abs().amin(-1).gt(0).all() and not padded_kv[:, :, 5:, :, 1:].any()


def run_engine(vlm: VLM, chunks, monkeypatch, padded: bool) -> tuple[list, list[int], list[int], list[dict]]:
    """Rows joining (3, then 2 more) and leaving (different lengths): each request's tokens and logits, the
    rows of every decode forward and its real rows, and each step's host reads."""
    with monkeypatch.context() as patch:
        return _run_engine(vlm, chunks, patch, padded)


def _run_engine(vlm: VLM, chunks, monkeypatch, padded: bool) -> tuple[list, list[int], list[int], list[dict]]:
    monkeypatch.setattr(shapes, "buckets_on", lambda device: padded)
    shapes_seen, real_seen = [], []
    real_forward = batch.forward

    def forward(vlm, slab, ids, real, columns=None, *args, **kwargs):
        if columns is None:  # a decode step (a prefill places its tokens explicitly)
            shapes_seen.append(ids.shape[0])
            real_seen.append(slab.num_rows)
        return real_forward(vlm, slab, ids, real, columns, *args, **kwargs)

    monkeypatch.setattr(batch, "forward", forward)
    rec = Recorder(vlm)
    questions = [("When does it ship?", 9, {}), ("Which part?", 3, dict(temperature=0.8, seed=7)),
                 ("How long is the warranty?", 6, {})]
    later = [("What ships in April?", 7, dict(temperature=1.1, top_p=0.9, seed=3)), ("Hi", 4, {})]
    seqs = [rec.submit(linked(vlm, chunks, q), n, **f) for q, n, f in questions]
    with counting_syncs(monkeypatch) as syncs:
        for _ in range(2):  # (not counted: the phases are counted from here to the end)
            rec.engine.step()
        seqs += [rec.submit(linked(vlm, chunks[::-1], q), n, **f) for q, n, f in later]
        steps = phases(rec, monkeypatch, syncs)
    assert all(s.status is Status.FINISHED for s in seqs)
    return [(s.token_ids, rec.logits[s.id]) for s in seqs], shapes_seen, real_seen, steps


@pytest.mark.parametrize("vlm", ["tiny-qwen", "tiny-glm"], indirect=True)  # the fused forward, transformers'
def test_rows_joining_and_leaving_see_only_bucketed_shapes_and_the_same_tokens(vlm, monkeypatch):
    chunks = [vlm.compile_text("Part QZ-19 ships on 3 April."), vlm.compile_text("The warranty covers two years.")]
    expected, plain_shapes, plain_real, _ = run_engine(vlm, chunks, monkeypatch, padded=False)
    got, shapes_seen, real_seen, steps = run_engine(vlm, chunks, monkeypatch, padded=True)
    assert not set(plain_shapes) <= BUCKETS  # unpadded, the run has a row count off the buckets (3)
    assert real_seen == plain_real
    assert len(set(real_seen)) > len(set(shapes_seen))
    assert set(shapes_seen) <= BUCKETS and shapes_seen == [bucket_rows(n) for n in real_seen]
    for (tokens, logits), (want, want_logits) in zip(got, expected):
        assert tokens == want and len(logits) == len(want_logits)
        assert max(float((a - b).abs().max()) for a, b in zip(logits, want_logits)) <= TOLERANCE
    decodes = [s["decode"] for s in steps if "decode" in s]
    assert decodes and all(counts == ONE_READ for counts in decodes)  # still one read back a step: the ids
