"""The fused forward's native small operations (pipeline/runtime/decoder_ops.py) against the torch operations
they replace, written out here: residual add + RMSNorm (contiguous and strided rows), SiLU × up, RoPE with the
K/V write into the slab. float32 to float rounding, bf16 rounding as torch rounds (each emulated rounding point
checked bit for bit where the order of a sum cannot differ). Then the whole forward: the native path is taken
and equals the torch-ops path; transformers' forward is the reference of tests/pipeline/runtime/test_fused_forward.py,
which runs
the native path by default. Controls: a key written one column off, a rotation of the wrong sign."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from pipeline.runtime import decoder_ops
from pipeline.runtime.fused import FusedDecoder, rotate
from pipeline.runtime.model import VLM
from pipeline.runtime.native import KernelUnavailable
from schemas.config import ForwardSpec, ModelSpec
from tests.pipeline.runtime.test_fused_forward import EXACT, copy, gap, ragged_slab, run

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ops() -> decoder_ops.DecoderOps:
    built = decoder_ops.native_decoder_ops()
    if built is None:
        pytest.skip("no C++ compiler here: the torch operations serve (tested by the fused forward's own tests)")
    return built


def close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    else:  # a sum of squares in another order: at most one bf16 step apart
        step = 2.0 ** -7 * expected.float().abs().clamp(min=2.0 ** -20)
        assert ((got.float() - expected.float()).abs() <= step).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_is_the_residual_add_then_qwen2s_rms_norm(ops, dtype):
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(3, 4, 64, generator=g) * 3).to(dtype)
    delta = torch.randn(3, 4, 64, generator=g).to(dtype)
    weight = (torch.rand(64, generator=g) + 0.5).to(dtype)
    summed = hidden + delta  # torch's add, rounded to the dtype
    x32 = summed.float()
    expected = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)  # Qwen2RMSNorm

    work = hidden.clone()
    out = ops.add_rms_norm(work, delta, weight, 1e-6)
    assert torch.equal(work, summed)  # the add, in place, rounded as torch's
    close(out, expected, dtype)
    close(ops.add_rms_norm(summed.clone(), None, weight, 1e-6), expected, dtype)  # no delta: the norm alone
    # strided rows: each row's last token, as the forward's last layer passes them
    work = hidden.clone()
    last = ops.add_rms_norm(work[:, -1], delta[:, -1], weight, 1e-6)
    assert torch.equal(work[:, -1], summed[:, -1]) and torch.equal(work[:, :-1], hidden[:, :-1])
    close(last, expected[:, -1], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_silu_of_the_gate_times_up(ops, dtype):
    gate_up = (torch.randn(2, 3, 2 * 48, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    got = ops.silu_mul(gate_up)
    assert got.shape == (2, 3, 48)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6)  # exp: libm's against torch's vectorised
    else:
        close(got, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_qkv_rotates_queries_and_writes_rotated_keys_and_values_at_the_columns(ops, dtype):
    rows, new, heads, kv_heads, dim, capacity = 2, 3, 4, 2, 16, 10
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(rows, new, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    angles = torch.rand(50, dim // 2, generator=g) * 6
    cos_table = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin_table = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
    positions = torch.tensor([[7, 8, 9], [40, 41, 42]])
    columns = torch.tensor([[2, 3, 4], [5, 6, 9]])
    kv = torch.randn(2, rows, kv_heads, capacity, dim, generator=g).to(dtype)  # a slab layer's [K, V]
    before = kv.clone()

    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    cos, sin = cos_table[positions][:, None], sin_table[positions][:, None]  # [rows, 1, new, dim]
    expected_q = rotate(q.view(rows, new, heads, dim).transpose(1, 2), cos, sin)
    expected_k = rotate(k.view(rows, new, kv_heads, dim).transpose(1, 2), cos, sin)
    expected = before.clone()
    index = torch.arange(rows)[:, None]
    expected[0][index, :, columns] = expected_k.transpose(1, 2)
    expected[1][index, :, columns] = v.view(rows, new, kv_heads, dim)

    got_q = ops.rope_qkv(qkv, cos_table, sin_table, positions, columns, kv[0], kv[1], heads)
    assert torch.equal(got_q, expected_q) and torch.equal(kv, expected)  # the same roundings, bit for bit
    wrong = expected.clone()  # the control: a key one column off is seen
    wrong[0][index, :, columns - 1] = expected_k.transpose(1, 2)
    assert not torch.equal(kv, wrong)


@pytest.fixture(scope="module")
def qwen() -> VLM:
    return VLM(ModelSpec(path="tiny-qwen"))


def test_the_forward_runs_the_native_operations_and_equals_its_torch_operations(ops, qwen, monkeypatch):
    """On a ragged prefill and two decode steps: the native path is taken (each operation called) and gives the
    torch-ops path's logits and KV; a rotation of the wrong sign (the control) does not."""
    calls = {"norm": 0, "silu": 0, "rope": 0}
    spy = decoder_ops.DecoderOps(ops.library)
    for name, method in (("norm", "add_rms_norm"), ("silu", "silu_mul"), ("rope", "rope_qkv")):
        real = getattr(spy, method)

        def counted(*args, _real=real, _name=name):
            calls[_name] += 1
            return _real(*args)
        setattr(spy, method, counted)
    monkeypatch.setitem(decoder_ops._ops.state, "built", spy)
    slab = ragged_slab(qwen)
    torch_slab = copy(slab)
    decoder = FusedDecoder(qwen.model, ForwardSpec())
    native = run(qwen, decoder, slab)
    layers = len(decoder.layers)
    assert calls == {"norm": 3 * (2 * layers + 1), "silu": 3 * layers, "rope": 3 * layers}  # 3 forwards
    plain = run(qwen, FusedDecoder(qwen.model, ForwardSpec(native_ops=False)), torch_slab)
    assert gap(native, plain) <= EXACT and float((slab.kv - torch_slab.kv).abs().max()) <= EXACT
    assert calls["rope"] == 3 * layers  # the torch path called nothing native

    decoder = FusedDecoder(qwen.model, ForwardSpec())
    decoder._sin = -decoder._sin  # the control: every rotation turned the other way
    assert gap(run(qwen, decoder, ragged_slab(qwen)), plain) > 100 * EXACT


def test_without_a_compiler_the_forward_runs_torch_operations(qwen, monkeypatch, caplog):
    def unavailable(cls, cxx=None):
        raise KernelUnavailable("no C++ compiler on PATH (g++, c++ or $CXX)")

    monkeypatch.setattr(decoder_ops.DecoderOps, "build", classmethod(unavailable))
    monkeypatch.setattr(decoder_ops._ops, "state", {})
    with caplog.at_level(logging.WARNING, logger=decoder_ops.__name__):
        assert decoder_ops.native_decoder_ops() is None
    assert "torch operations" in caplog.text
    plain = run(qwen, FusedDecoder(qwen.model, ForwardSpec(native_ops=False)), ragged_slab(qwen))
    assert gap(run(qwen, FusedDecoder(qwen.model, ForwardSpec()), ragged_slab(qwen)), plain) == 0.0
