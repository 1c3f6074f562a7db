"""Section 5 of benchmarks/perf/limits.py: re-anchoring 1,000 cached tokens into a slab row, each way qvpic can,
against the copy bound."""

from __future__ import annotations

import time

import torch

from benchmarks.perf import limit_rates
from benchmarks.perf.limit_rates import interleaved_ms
from pipeline.eval import markdown_table
from pipeline.runtime import VLM
from pipeline.runtime.kv import ChunkKV, assemble
from pipeline.runtime.reanchor import NativeRotation, native_kernel, torch_ops_only
from schemas.modes import ChunkKind

TARGET_REANCHOR_MS = 1.5  # assembly of 1,000 cached tokens, re-anchoring included


def reanchoring(label: str, vlm: VLM, bw: dict[str, float], repeats: int) -> str:
    """ms per 1,000 cached tokens of assembling 8 chunks of 125 tokens (re-anchored) into a slab row, the paths
    interleaved: the model's rotation as a matrix product; as per-channel factors (`RotationTable.halves`) applied
    by torch ops (what runs without a C++ compiler, and on a GPU) and by the native kernel (served on the CPU,
    pipeline/runtime/reanchor.py); a plain copy of the same bytes (what any layout into the row costs) — against
    the copy bound (K and V read and written once) and the target."""
    shape = vlm.prefix.kv.shape  # [layers, 2, kv_heads, tokens, head_dim]
    chunks = [ChunkKV(torch.randn(shape[0], 2, shape[2], 125, shape[4], device=vlm.device), 125, 17, ChunkKind.TEXT)
              for _ in range(8)]
    out = torch.empty(shape[0], 2, shape[2], 1000 + vlm.prefix.num_tokens, shape[4], device=vlm.device)

    def by_torch_ops():
        with torch_ops_only():
            assemble(vlm.prefix, chunks, vlm.rotations, out)

    paths = {"matrix product": lambda: assemble(vlm.prefix, chunks, lambda d, h: vlm.rotations(d, h), out),
             "per-channel factors, torch ops": by_torch_ops}
    build = ""
    if limit_rates.DEVICE.type == "cpu" and native_kernel() is not None:
        paths["per-channel factors, native kernel (served)"] = lambda: assemble(vlm.prefix, chunks, vlm.rotations,
                                                                                out)
        started = time.perf_counter()
        NativeRotation.build()
        build = (f" The native kernel's build, once per process on first use: {time.perf_counter() - started:.2f} s"
                 " (this run, one more time).")
    paths["copy only (no rotation)"] = lambda: [out[:, :, :, i * 125:(i + 1) * 125].copy_(c.kv)
                                                for i, c in enumerate(chunks)]
    nbytes = sum(c.nbytes for c in chunks)
    bound_ms = 2 * nbytes / (bw["copy"] * 1e9) * 1e3  # copy GB/s counts bytes read + written
    measured = interleaved_ms(paths, 10 * repeats)  # ~1 ms each: ten times the forwards' rounds
    rows = [[name, f"{ms:.2f}"] for name, ms in measured.items()]
    return (f"Re-anchoring, {label}: 8 chunks × 125 tokens ({nbytes / 1e6:.1f} MB of KV) assembled into "
            f"a slab row, medians of {10 * repeats} interleaved runs, torch threads: {torch.get_num_threads()}; the "
            f"copy bound (read + write once at {bw['copy']:.1f} GB/s) is {bound_ms:.2f} ms, the target "
            f"{TARGET_REANCHOR_MS} ms.{build}\n\n"
            + markdown_table(["assembly of 1,000 cached tokens", "ms"], rows) + "\n")
