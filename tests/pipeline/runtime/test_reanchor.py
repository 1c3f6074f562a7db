"""Re-anchoring by per-channel factors (pipeline/runtime/reanchor.py): the native kernel and the torch ops that
stand in for it equal the factors' matrix product at the head dims the kernel unrolls and at others, in every
layout the assembly hands them; bf16 rounds to nearest even as torch does; without a compiler the torch ops
serve; the assembly calls the kernel. The model families' own factors: tests/serve/engine/test_engine.py."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest
import torch

from pipeline.runtime import kv as kv_module
from pipeline.runtime import native as native_build
from pipeline.runtime import reanchor
from schemas.modes import ChunkKind

TOLERANCE = 1e-5


def native() -> reanchor.NativeRotation:
    kernel = reanchor.native_kernel()
    if kernel is None:
        if os.environ.get("CI"):  # .ci/run: a kernel test that skips there proves nothing
            pytest.fail("no native re-anchoring kernel: CI's image has g++")
        pytest.skip("no C++ compiler here: re-anchoring runs on torch ops")
    return kernel


def factors_matrix(diag: torch.Tensor, cross: torch.Tensor, partner_shift: int | None = None) -> torch.Tensor:
    """M with keys @ M = the factors applied, written out entry by entry: M[i, i] = diag[i] and
    M[i ± head_dim/2, i] = cross[i] (`partner_shift` other than head_dim/2: a wrong pairing, for controls)."""
    head_dim = diag.numel()
    shift = head_dim // 2 if partner_shift is None else partner_shift
    matrix = torch.zeros(head_dim, head_dim)
    for i in range(head_dim):
        matrix[i, i] = diag[i]
        matrix[(i + shift) % head_dim, i] += cross[i]
    return matrix


@pytest.mark.parametrize("path", ["native kernel", "torch ops"])
@pytest.mark.parametrize("head_dim", [16, 24, 64, 128])  # 64 and 128: the kernel's unrolled cases
def test_the_factors_are_their_matrix_product_in_every_layout(path, head_dim):
    rotate = native() if path == "native kernel" else reanchor.rotate_halves_torch
    generator = torch.Generator().manual_seed(head_dim)
    diag, cross = torch.randn(2, head_dim, generator=generator)
    keys = torch.randn(3, 2, 100, head_dim, generator=generator)  # head_dim ≥ 64: past the grain, threads split it
    assert (keys.numel() >= reanchor.PARALLEL_GRAIN) == (head_dim >= 64)
    expected = keys @ factors_matrix(diag, cross)
    assert float((keys @ factors_matrix(diag, cross, partner_shift=1) - expected).abs().max()) > 1e-2  # control
    slab = torch.full((3, 2, 2, 110, head_dim), float("nan"))  # [layers, K/V, heads, width, head_dim]
    cases = [(keys, slab[:, 0, :, 5:105]),  # a chunk's keys into a slab row's strided columns
             (keys[1], torch.empty(2, 100, head_dim)),  # 3-D, 2-D, 1-D: leading dims filled in
             (keys[1, 0], torch.empty(100, head_dim)), (keys[1, 0, 3], torch.empty(head_dim)),
             (keys.transpose(1, 2), torch.empty(3, 100, 2, head_dim))]  # strided input
    for source, out in cases:
        if path == "native kernel":
            assert rotate.accepts(source, diag, cross, out)
        rotate(source, diag, cross, out)
        reference = source @ factors_matrix(diag, cross)
        assert float((out - reference).abs().max()) <= TOLERANCE
    assert slab[:, 0, :, :5].isnan().all() and slab[:, 0, :, 105:].isnan().all() and slab[:, 1].isnan().all()


@pytest.mark.parametrize("path", ["native kernel", "torch ops"])
def test_bfloat16_keys_round_once_to_nearest_even(path):
    """Keys of ones (bf16), one cross term: out = diag + cross·1 in float32, rounded once to bf16 — hand-worked:
    1 + 2⁻⁸ is a tie and goes to 1 (even), 1 + 3·2⁻⁸ a tie that goes up to 1 + 2⁻⁶, 1 + 2⁻⁸ + 2⁻¹⁶ rounds up to
    1 + 2⁻⁷; a NaN stays NaN. Truncating instead would give 1 + 2⁻⁷ for the second."""
    rotate = native() if path == "native kernel" else reanchor.rotate_halves_torch
    keys = torch.ones(2, 1, 3, 4, dtype=torch.bfloat16)
    keys[1, 0, 2, 0] = float("nan")
    diag = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-16, 1.0])
    cross = torch.tensor([0.0, 0.0, 2**-8, -0.5])
    out = torch.empty_like(keys)
    if path == "native kernel":
        assert rotate.accepts(keys, diag, cross, out)
    rotate(keys, diag, cross, out)
    expected = torch.tensor([1.0, 1 + 2**-6, 1 + 2**-7, 0.5])
    assert torch.equal(out[0].float(), expected.expand(1, 3, 4))
    assert torch.equal(out[1, 0, :2].float(), expected.expand(2, 4))
    assert out[1, 0, 2, 0].isnan() and out[1, 0, 2, 2].isnan()  # channel 2's partner is channel 0
    assert torch.equal(out[1, 0, 2, [1, 3]].float(), expected[[1, 3]])


def test_without_a_compiler_the_torch_ops_serve_and_say_so(monkeypatch, caplog):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(reanchor.KernelUnavailable, match="no C\\+\\+ compiler"):
        reanchor.NativeRotation.build()
    with pytest.raises(reanchor.KernelUnavailable, match="could not build"):
        reanchor.NativeRotation.build("/bin/false")  # a compiler that fails
    with pytest.raises(reanchor.KernelUnavailable, match="does not load"):
        reanchor.NativeRotation.build("/bin/true")  # "succeeds" and leaves no library
    monkeypatch.setattr(reanchor._kernel, "state", {})  # a process that has not tried yet
    with caplog.at_level(logging.WARNING, logger=reanchor.__name__):
        assert reanchor.native_kernel() is None
    assert "torch ops" in caplog.text and "no C++ compiler" in caplog.text
    keys, (diag, cross) = torch.randn(2, 5, 8), torch.randn(2, 8)
    out = torch.empty_like(keys)
    kv_module.rotate_halves(keys, diag, cross, out)
    assert float((out - keys @ factors_matrix(diag, cross)).abs().max()) <= TOLERANCE


def test_the_assembly_rotates_cpu_keys_with_the_kernel_and_the_rest_with_torch_ops(monkeypatch):
    """Every shifted chunk's keys go through the kernel (float32 and bf16 on the CPU); float16, which it does
    not take, through torch ops, with the same result."""
    kernel, calls = native(), []

    def spy(keys, diag, cross, out):
        calls.append(keys.dtype)
        kernel(keys, diag, cross, out)

    spy.accepts = kernel.accepts
    monkeypatch.setattr(reanchor, "native_kernel", lambda: spy)
    head_dim, angles = 8, torch.arange(1, 5) * 0.3

    def matrices(deltas: torch.Tensor, _head_dim: int = head_dim) -> torch.Tensor:  # rotate-half RoPE by Δ
        by_delta = []
        for delta in deltas.tolist():
            cos, sin = torch.cos(angles * delta), torch.sin(angles * delta)
            by_delta.append(factors_matrix(torch.cat([cos, cos]), torch.cat([-sin, sin])))
        return torch.stack(by_delta)

    table = kv_module.RotationTable(matrices)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        calls.clear()
        chunks = [kv_module.ChunkKV(torch.randn(2, 2, 1, 6, head_dim).to(dtype), 6, start, ChunkKind.TEXT)
                  for start in (0, 3, 6)]  # placed at 0, 6, 12: shifted by 0, 3 and 6
        context = kv_module.assemble(None, chunks, table)
        product = kv_module.assemble(None, chunks, matrices)  # not a RotationTable: the matrix product
        assert calls == ([dtype] * 2 if dtype != torch.float16 else [])
        one_ulp = TOLERANCE if dtype == torch.float32 else 2**-7  # bf16, float16 (2⁻¹⁰): each rounds once
        for (keys, _), (expected, _) in zip(context.layers, product.layers):
            assert ((keys.float() - expected.float()).abs() <= one_ulp * expected.float().abs().clamp(min=1)).all()


def test_the_kernel_is_built_from_the_package_source_in_a_private_directory_then_removed(monkeypatch):
    """What docs/SECURITY.md says: a native library qvpic builds is its own source (here rotate_halves.cpp), compiled
    into a fresh directory only this user can enter, which is gone once the library is loaded."""
    native()
    seen = []
    run = native_build.subprocess.run

    def recording(command, **kwargs):
        target = Path(command[command.index("-o") + 1])
        seen.append((list(command), target.parent, stat.S_IMODE(target.parent.stat().st_mode)))
        return run(command, **kwargs)

    monkeypatch.setattr(native_build.subprocess, "run", recording)
    kernel = reanchor.NativeRotation.build()
    (command, directory, mode), = seen
    assert str(reanchor.SOURCE) in command and reanchor.SOURCE.parent == Path(reanchor.__file__).parent
    assert mode == 0o700 and not directory.exists()
    keys, (diag, cross) = torch.randn(3, 8), torch.randn(2, 8)
    out = torch.empty_like(keys)
    kernel(keys, diag, cross, out)  # loaded and working after its directory went
    assert float((out - keys @ factors_matrix(diag, cross)).abs().max()) <= TOLERANCE


def test_the_rotation_table_stays_within_its_stated_bytes():
    """Issue 59 item 4: the table of re-anchoring matrices is bounded in bytes (`ROTATION_TABLE_NBYTES`, 64 MiB),
    not in entries (8,192 of them were 520 MiB of device memory at head_dim 128). At head_dim 128 in float32 an
    entry is (128² + 2·128)·4 = 66,560 bytes, so 1,008 shifts fit; a call asking for more than fit still gets
    every one it asked for, right. Control: the eviction removed keeps all 3,000 (the test fails)."""
    head_dim, eye = 128, torch.eye(128)

    def compute(deltas, head_dim):  # a matrix that names its Δ
        return [eye * float(d) for d in deltas.tolist()]

    table = kv_module.RotationTable(compute)
    assert table.max_nbytes == 64 * 2 ** 20
    for start in range(0, 3_000, 500):
        got = table(list(range(start, start + 500)), head_dim, torch.device("cpu"))
        assert torch.equal(got[:, 0, 0], torch.arange(start, start + 500, dtype=torch.float32))
    assert len(table) == 1_008 and table.nbytes == 1_008 * 66_560 <= 64 * 2 ** 20
    wide = table(list(range(10_000, 11_100)), head_dim, torch.device("cpu"))  # more than fit in one call
    assert torch.equal(wide[:, 1, 1], torch.arange(10_000, 11_100, dtype=torch.float32)) and len(table) == 1_008
