"""The engine's written-out forward (pipeline/runtime/fused.py) against transformers' own forward of the same
checkpoint over the same slab: logits and the KV it writes, for every family it claims, on ragged rows (pads,
different context lengths, a prefill then decode steps). Controls show the comparison catches a position off
by one and a wrong grouped-query head map; bf16 products are held to a stated tolerance (and must differ from
fp32, or the test would not be testing them)."""

from __future__ import annotations

import pytest
import torch

from pipeline.runtime import fused as fused_module
from pipeline.runtime.fused import FusedDecoder
from pipeline.runtime.model import VLM
from schemas.config import DType, EngineConfig, ForwardSpec, ModelSpec
from serve.engine.qvpic.batch import Slab, forward
from serve.engine.qvpic.engine import QvpicEngine

EXACT = 1e-5  # the suite's fp32 tolerance (tests/pipeline/runtime/test_runtime_exactness.py)
# bf16 products (fp32 accumulation, KV and attention in fp32), measured on oracle-qwen (the peakiest built-in
# model: logits' std ~1.1): KL 2e-4, max |Δlogit| 0.076 over 32 rows. Stated with headroom:
BF16_KL, BF16_LOGIT = 1e-3, 0.15
CONTEXT = [37, 52, 45]  # each row's context columns (random KV standing in for linked chunks)


@pytest.fixture(scope="module", params=["tiny-qwen", "tiny-qwen2", "tiny-llava"])
def vlm(request) -> VLM:
    return VLM(ModelSpec(path=request.param))


def ragged_slab(vlm: VLM, seed: int = 0, room: int = 8, context: list[int] = CONTEXT) -> Slab:
    """Rows (three by default) with contexts of different lengths at different positions, room for `room` more
    tokens each."""
    shape = vlm.prefix.kv  # [layers, 2, kv_heads, tokens, head_dim]
    generator = torch.Generator().manual_seed(seed)
    slab = Slab.empty(shape.shape[0], len(context), shape.shape[2], max(context) + room, shape.shape[4], vlm.dtype,
                      vlm.device)
    for row, length in enumerate(context):
        slab.kv[:, :, row, :, :length] = torch.randn(shape.shape[0], 2, shape.shape[2], length, shape.shape[4],
                                                     generator=generator)
        slab.valid[row, :length] = True
        slab.lengths[row], slab.next_positions[row] = length, 100 * row + length
    return slab.read_back()


def copy(slab: Slab) -> Slab:
    return Slab(slab.kv.clone(), slab.valid.clone(), slab.lengths.clone(), slab.next_positions.clone(),
                slab.host_lengths, slab.host_next_positions)


@torch.inference_mode()  # as the engine runs it
def run(vlm: VLM, decoder: FusedDecoder | None, slab: Slab) -> list[torch.Tensor]:
    """A left-padded prefill (rows of 4, 2 and 3 real tokens), then two decode steps: the logits of each."""
    vlm.fused = decoder
    try:
        ids = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10], [0, 11, 12, 13]])
        real = ids != 0
        out = [forward(vlm, slab, ids, real)]
        for step in range(2):
            ids = torch.tensor([[20 + step], [30 + step], [40 + step]])
            out.append(forward(vlm, slab, ids, torch.ones_like(ids, dtype=torch.bool)))
        return out
    finally:
        vlm.fused = None


def gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def test_fused_forward_equals_transformers(vlm):
    assert FusedDecoder.supports(vlm.model)
    decoder = FusedDecoder(vlm.model, ForwardSpec())
    reference, ours = ragged_slab(vlm), ragged_slab(vlm)
    expected, got = run(vlm, None, reference), run(vlm, decoder, ours)
    assert gap(expected, got) <= EXACT
    assert float((reference.kv - ours.kv).abs().max()) <= EXACT  # the KV it wrote, every column
    assert torch.equal(reference.valid, ours.valid) and torch.equal(reference.lengths, ours.lengths)


@torch.inference_mode()
def long_turn(vlm: VLM, decoder: FusedDecoder | None, slab: Slab, new: int) -> list[torch.Tensor]:
    """A left-padded prefill of `new` tokens (rows of new, new - 7 and new - 3 real ones), then one decode step."""
    vlm.fused = decoder
    try:
        ids = torch.arange(5, 5 + 3 * new).view(3, new)
        ids[1, :7] = ids[2, :3] = 0
        out = [forward(vlm, slab, ids, ids != 0)]
        ids = torch.tensor([[20], [30], [40]])
        return out + [forward(vlm, slab, ids, torch.ones_like(ids, dtype=torch.bool))]
    finally:
        vlm.fused = None


@pytest.mark.parametrize(("new", "native", "sdpa"), [(31, True, False), (40, True, True), (48, False, True)])
def test_a_long_query_turn_equals_transformers_through_either_attention(vlm, new, native, sdpa, monkeypatch):
    """A query turn of `SDPA_MIN_NEW` tokens or more runs fp32 attention in SDPA's tiled kernel, a shorter one as two
    products, a decode step SDPA on the stacked queries; a forward of more than `NATIVE_MAX_TOKENS` tokens (3 rows
    of `new`) runs torch's operations between the products, a smaller one the native calls (both counted, so a
    threshold that never fires fails). Every way equals transformers' forward, logits and KV."""
    assert fused_module.SDPA_MIN_NEW == 32 and fused_module.NATIVE_MAX_TOKENS == 128  # the cases' premise
    reference, ours = ragged_slab(vlm, room=new + 2), ragged_slab(vlm, room=new + 2)
    expected = long_turn(vlm, None, reference, new)
    decoder = FusedDecoder(vlm.model, ForwardSpec())
    calls, native_calls = [], []
    real, real_ops = fused_module.F.scaled_dot_product_attention, fused_module.native_decoder_ops
    monkeypatch.setattr(fused_module.F, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(k.get("enable_gqa", False)) or real(*a, **k))
    monkeypatch.setattr(fused_module, "native_decoder_ops", lambda: native_calls.append(1) or real_ops())
    got = long_turn(vlm, decoder, ours, new)
    monkeypatch.undo()
    layers = len(decoder.layers)  # the turn: SDPA with grouped-query heads (or products); the decode step after it:
    assert calls == [True] * (layers if sdpa else 0) + [False] * layers  # SDPA on each kv head's stacked queries
    assert len(native_calls) == (2 if native else 1)  # the prefill's (or not), then the decode step's
    assert gap(expected, got) <= EXACT
    assert float((reference.kv - ours.kv).abs().max()) <= EXACT


def test_fused_forward_without_prepacking_is_the_same(vlm):
    slab = ragged_slab(vlm)
    expected = run(vlm, None, copy(slab))
    assert gap(expected, run(vlm, FusedDecoder(vlm.model, ForwardSpec(prepack=False)), slab)) <= EXACT


def test_controls_a_shifted_position_and_a_wrong_head_map_are_caught(vlm, monkeypatch):
    decoder = FusedDecoder(vlm.model, ForwardSpec())
    slab = ragged_slab(vlm)
    expected = run(vlm, None, copy(slab))
    shifted = copy(slab)
    shifted.next_positions += 1  # RoPE Δ+1 on the new tokens only
    assert gap(expected, run(vlm, decoder, shifted)) > 100 * EXACT

    heads, kv_heads = vlm.model.config.get_text_config().num_attention_heads, decoder.num_kv_heads
    if heads == kv_heads:
        pytest.skip("no grouped-query heads in this model: nothing to map wrongly")
    attend = fused_module.attend

    def interleaved(q, keys, values, mask, scale):  # head h reads kv head h % kv_heads, not h // group
        group = heads // kv_heads
        order = torch.arange(heads).view(kv_heads, group).T.reshape(-1)  # regroup so the fused grouping is wrong
        return attend(q[:, order], keys, values, mask, scale)[:, torch.argsort(order)]

    monkeypatch.setattr(fused_module, "attend", interleaved)
    assert gap(expected, run(vlm, decoder, copy(slab))) > 100 * EXACT


def test_fusing_shares_the_models_weights(vlm):
    """QKV and gate/up are fused in place: the model's own projections become views of the fused weight."""
    layer = vlm.model.model.language_model.layers[0]
    decoder = FusedDecoder(vlm.model, ForwardSpec(prepack=False))
    fused_qkv = decoder.layers[0].qkv.weight
    assert layer.self_attn.q_proj.weight.data_ptr() == fused_qkv.data_ptr()
    assert layer.self_attn.k_proj.weight.untyped_storage().data_ptr() == fused_qkv.untyped_storage().data_ptr()


def test_bf16_products_within_the_stated_tolerance():
    vlm = VLM(ModelSpec(path="oracle-qwen"))
    slab = ragged_slab(vlm)
    exact = run(vlm, FusedDecoder(vlm.model, ForwardSpec()), copy(slab))
    low = run(vlm, FusedDecoder(vlm.model, ForwardSpec(matmul_dtype=DType.BFLOAT16)), slab)
    assert gap(exact, low) > 100 * EXACT  # control: the bf16 products did run
    assert gap(exact, low) <= BF16_LOGIT
    for p, q in zip(exact, low):
        p, q = p.log_softmax(-1), q.log_softmax(-1)
        assert float((p.exp() * (p - q)).sum(-1).max()) <= BF16_KL


def test_the_engine_picks_the_forward_its_spec_asks_for():
    qwen = VLM(ModelSpec(path="tiny-qwen"))
    QvpicEngine(qwen, EngineConfig(), start=False)
    assert isinstance(qwen.fused, FusedDecoder)
    QvpicEngine(qwen, EngineConfig(forward=ForwardSpec(fused=False)), start=False)
    assert qwen.fused is None
    glm = VLM(ModelSpec(path="tiny-glm"))  # its decoder (fused gate_up, post-norms) is not the Qwen2 one
    assert not FusedDecoder.supports(glm.model)
    QvpicEngine(glm, EngineConfig(), start=False)
    assert glm.fused is None
    with pytest.raises(ValueError, match="matmul_dtype"):
        QvpicEngine(glm, EngineConfig(forward=ForwardSpec(matmul_dtype=DType.BFLOAT16)), start=False)
    with pytest.raises(ValueError, match="matmul_dtype needs forward.fused"):
        ForwardSpec(fused=False, matmul_dtype=DType.BFLOAT16)


@pytest.mark.parametrize(("configured", "reserved", "threads"), [
    (None, 1.5, 2), (None, 0.1, 1), (None, 2.0, 2), (None, 1.0, 1), (None, None, None), (None, 0.0, None),
    (3, 0.1, 3), (1, 4.0, 1)])
def test_forward_threads_are_the_configured_count_else_the_reservation_rounded_up(configured, reserved, threads):
    from serve.engine.generator import forward_threads

    assert forward_threads(configured, reserved) == threads


def reference_attention(q, keys, values, mask, scale):
    """Attention in float64 by its definition, kv head h // group for query head h (transformers' repeat_kv)."""
    group = q.shape[1] // keys.shape[1]
    keys, values = (t.double().repeat_interleave(group, dim=1) for t in (keys, values))
    scores = q.double() @ keys.transpose(-1, -2) * scale + mask.double()
    return torch.softmax(scores, dim=-1) @ values


@pytest.mark.parametrize("new", [1, fused_module.SDPA_MIN_NEW - 1, fused_module.SDPA_MIN_NEW, 40])
def test_fp32_attention_either_way_equals_the_definition(new):
    """fp32 `attend`, as products below `SDPA_MIN_NEW` new tokens and SDPA's tiled kernel from it, on a slab's
    strided keys and values against the float64 definition; controls: the mask dropped, the head map interleaved."""
    generator = torch.Generator().manual_seed(4)
    rows, heads, kv_heads, dim, width, capacity = 2, 12, 2, 64, 120, 130
    slab = torch.randn(2, rows, kv_heads, capacity, dim, generator=generator)
    keys, values = slab[0][:, :, :width], slab[1][:, :, :width]
    q = torch.randn(rows, heads, new, dim, generator=generator)
    mask = torch.zeros(rows, 1, new, width)
    mask[0, :, :, 10:25] = torch.finfo(torch.float32).min
    mask[1, :, :, width - new:] = torch.triu(torch.full((new, new), torch.finfo(torch.float32).min), 1)  # causal
    expected = reference_attention(q, keys, values, mask, 0.125)
    got = fused_module.attend(q, keys, values, mask, 0.125).double()
    assert (got - expected).abs().max().item() < EXACT
    assert (got - reference_attention(q, keys, values, torch.zeros_like(mask), 0.125)).abs().max().item() > 1e-2
    interleaved = torch.arange(heads).view(heads // kv_heads, kv_heads).T.reshape(-1)
    wrong = reference_attention(q[:, interleaved], keys, values, mask, 0.125)[:, torch.argsort(interleaved)]
    assert (got - wrong).abs().max().item() > 1e-2


@pytest.mark.parametrize("new", [1, 5, fused_module.SDPA_MIN_NEW + 8])
def test_bf16_attention_reads_the_slab_in_place_within_bf16_rounding(new):
    """bf16 `attend` (SDPA on the slab's strided keys and values: the group's queries stacked under
    `SDPA_MIN_NEW` tokens, `enable_gqa` from it) against the definition: within bf16's rounding of the output, and
    the controls (the mask dropped; each token given another token's mask row; the head map interleaved) are not."""
    from pipeline.runtime.fused import attend

    generator = torch.Generator().manual_seed(3)
    rows, heads, kv_heads, dim, width, capacity = 3, 12, 2, 64, 40, 48
    slab = torch.randn(2, rows, kv_heads, capacity, dim, generator=generator).to(torch.bfloat16)
    keys, values = slab[0][:, :, :width], slab[1][:, :, :width]  # views: strided like a slab layer's
    q = torch.randn(rows, heads, new, dim, generator=generator).to(torch.bfloat16)
    mask = torch.zeros(rows, 1, new, width, dtype=torch.bfloat16)
    mask[0, :, :, 10:25] = torch.finfo(torch.bfloat16).min  # columns row 0 must not see
    mask[2, :, :, 33:] = torch.finfo(torch.bfloat16).min
    causal = torch.triu(torch.full((new, new), torch.finfo(torch.bfloat16).min), 1)
    mask[1, :, :, width - new:] = causal  # each token its own row: the new tokens in causal order
    expected = reference_attention(q, keys, values, mask, 0.125)
    got = attend(q, keys, values, mask, 0.125).double()
    tolerance = 8e-3  # bf16 keeps 8 bits of mantissa: |out| ≲ 1.5 here, so ~6e-3 at most from the final rounding
    assert (got - expected).abs().max().item() < tolerance
    unmasked = reference_attention(q, keys, values, torch.zeros_like(mask), 0.125)
    assert (got - unmasked).abs().max().item() > 10 * tolerance
    if new > 1:
        rolled = reference_attention(q, keys, values, mask.roll(1, dims=2), 0.125)  # token n under n - 1's mask row
        assert (got - rolled).abs().max().item() > 10 * tolerance
    group = heads // kv_heads
    interleaved = torch.arange(heads).view(group, kv_heads).T.reshape(-1)  # query head h reading kv head h % 2
    wrong = reference_attention(q[:, interleaved], keys, values, mask, 0.125)[:, torch.argsort(interleaved)]
    assert (got - wrong).abs().max().item() > 10 * tolerance
