"""The fused forward's small operations as native calls (decoder_ops.cpp): residual add + RMSNorm, SiLU × up, and
RoPE of the QKV output with the KV written into the slab — three calls where a layer ran ~30 torch operations.

Why: on the CPU every torch operation after a matrix product runs cold (the product streamed its weight through
the caches): ~6 ms of a 20 ms one-token bench-qwen forward went to operations around the products, whose bound
is the weights' read alone (docs/BENCHMARKS.md `limits`). The numbers are torch's: each result rounds where the
torch operation it replaces rounds (tests/pipeline/runtime/test_decoder_ops.py holds the two paths together, float32
and bf16).

Built on first use, once per process (pipeline/runtime/native.py); CPU float32 and bfloat16 tensors only. Where
there is no compiler, or on a GPU, the fused forward runs its torch operations (`native_decoder_ops` is None).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from pipeline.runtime.native import BuiltOnce, build_library

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decoder_ops.cpp")
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
FLAGS = ("-O3", "-ffp-contract=off", "-shared", "-fPIC", "-std=c++17")  # no FMA: torch's rounding


class DecoderOps:
    """The compiled operations; every tensor a CPU tensor of one dtype in `DTYPES`, rows of contiguous values."""

    def __init__(self, library: ctypes.CDLL):
        self.library = library  # kept: the functions below live in it
        p, i = ctypes.c_void_p, ctypes.c_int64
        self.norm, self.silu, self.rope = {}, {}, {}
        for dtype, name in DTYPES.items():
            norm = getattr(library, f"qvpic_add_rms_norm_{name}")
            norm.argtypes, norm.restype = [p, i, p, i, p, p, i, i, i, ctypes.c_float], None
            silu = getattr(library, f"qvpic_silu_mul_{name}")
            silu.argtypes, silu.restype = [p, p, i, i], None
            rope = getattr(library, f"qvpic_rope_qkv_{name}")
            rope.argtypes, rope.restype = [p] * 8 + [i] * 8, None
            self.norm[dtype], self.silu[dtype], self.rope[dtype] = norm, silu, rope

    @classmethod
    def build(cls, cxx: str | None = None) -> DecoderOps:
        return build_library(SOURCE, cls, cxx, FLAGS)

    def add_rms_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> torch.Tensor:
        """`hidden += delta` in place (when given), then `weight * rms_norm(hidden)` as a new tensor. hidden/delta
        `[..., dim]`: rows of contiguous values, evenly strided (a `[rows, new, dim]` tensor or its `[:, -1]`)."""
        dim = hidden.shape[-1]
        flat = hidden.view(-1, dim) if hidden.is_contiguous() else hidden
        if flat.dim() != 2 or flat.stride(-1) != 1 or weight.stride(-1) != 1:
            raise ValueError(f"rows of contiguous values expected, got {tuple(hidden.shape)} {hidden.stride()}")
        out = torch.empty(hidden.shape, dtype=hidden.dtype)
        if delta is not None:
            delta = delta.reshape(flat.shape)  # a view where it can be: the products return contiguous rows
            if delta.stride(-1) != 1:
                delta = delta.contiguous()
        self.norm[hidden.dtype](flat.data_ptr(), flat.stride(0), None if delta is None else delta.data_ptr(),
                                0 if delta is None else delta.stride(0), weight.data_ptr(), out.data_ptr(), dim,
                                flat.shape[0], dim, eps)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`silu(gate) * up` of gate_up `[..., 2 · inter]` (contiguous) → `[..., inter]`."""
        inter = gate_up.shape[-1] // 2
        out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype)
        self.silu[gate_up.dtype](gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter), inter)
        return out

    def rope_qkv(self, qkv: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                 positions: torch.Tensor, columns: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 heads: int) -> torch.Tensor:
        """qkv `[rows, new, (heads + 2 kv_heads) · head_dim]` (contiguous) → queries rotated, `[rows, heads, new,
        head_dim]`; keys rotated and values written into keys/values `[rows, kv_heads, capacity, head_dim]` at
        `columns` `[rows, new]`. cos/sin tables `[positions, head_dim]`, read at `positions` `[rows, new]`."""
        rows, new, _ = qkv.shape
        kv_heads, head_dim = keys.shape[1], keys.shape[3]
        q = torch.empty(rows, heads, new, head_dim, dtype=qkv.dtype)
        positions, columns = positions.contiguous(), columns.contiguous()
        self.rope[qkv.dtype](qkv.data_ptr(), cos_table.data_ptr(), sin_table.data_ptr(), positions.data_ptr(),
                             columns.data_ptr(), q.data_ptr(), keys.data_ptr(), values.data_ptr(), rows, new, heads,
                             kv_heads, head_dim, *keys.stride()[:3])
        return q


_ops = BuiltOnce(lambda: DecoderOps.build(), "the fused forward uses torch operations around its products, slower "
                 "on the CPU (docs/BENCHMARKS.md `limits`)", log)


def native_decoder_ops() -> DecoderOps | None:
    """This process's operations, built on the first call (the only one that pays for it); None without them."""
    return _ops.get()


def takes(*tensors: torch.Tensor) -> bool:
    """Whether the native operations take these tensors: CPU, one dtype of `DTYPES`, no autograd."""
    first = tensors[0]
    return (first.device.type == "cpu" and first.dtype in DTYPES
            and all(t.device.type == "cpu" and t.dtype == first.dtype and not t.requires_grad for t in tensors))
