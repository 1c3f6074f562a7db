"""Re-anchoring rotate-half keys (Qwen) by per-channel factors: out = keys · diag + swap_halves(keys) · cross.

Two ways, the same numbers (≤ 1e-5 in float32; bf16 rounds once, to nearest even, either way):
- `NativeRotation`: rotate_halves.cpp, one pass that reads each key once and writes it once into its slab row,
  rows over torch's threads. Built on first use, once per process (pipeline/runtime/native.py: ~0.2 s).
- `rotate_halves_torch`: torch ops, for CUDA, float16, a layout the kernel does not take, or no compiler.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from pipeline.runtime.native import BuiltOnce, KernelUnavailable, build_library  # noqa: F401  (KernelUnavailable: re-exported)

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("rotate_halves.cpp")
# Below this many elements one thread does the work, as torch's own grain (at::internal::GRAIN_SIZE): waking a
# second thread costs more than it saves, and on a busy machine a parallel region can wait milliseconds for it.
PARALLEL_GRAIN = 32_768


class NativeRotation:
    """The compiled kernel, for float32 and bfloat16 keys on the CPU."""

    def __init__(self, library: ctypes.CDLL):
        self.library = library  # kept: the functions below live in it
        pointer, index = ctypes.c_void_p, ctypes.c_int64
        self.functions = {}
        for dtype in (torch.float32, torch.bfloat16):
            function = getattr(library, f"qvpic_rotate_halves_{str(dtype).removeprefix('torch.')}")
            function.argtypes = [pointer] * 4 + [index] * 10 + [ctypes.c_int]
            function.restype = None
            self.functions[dtype] = function

    @classmethod
    def build(cls, cxx: str | None = None) -> NativeRotation:
        return build_library(SOURCE, cls, cxx)

    def accepts(self, keys: torch.Tensor, diag: torch.Tensor, cross: torch.Tensor, out: torch.Tensor) -> bool:
        return (keys.device.type == out.device.type == diag.device.type == cross.device.type == "cpu"
                and keys.dtype == out.dtype and keys.dtype in self.functions
                and diag.dtype == cross.dtype == torch.float32
                and keys.shape == out.shape and 1 <= keys.dim() <= 4 and keys.shape[-1] % 2 == 0
                and diag.shape == cross.shape == keys.shape[-1:]
                and keys.stride(-1) == out.stride(-1) == 1 and not keys.requires_grad)

    def __call__(self, keys: torch.Tensor, diag: torch.Tensor, cross: torch.Tensor, out: torch.Tensor) -> None:
        lead = 4 - keys.dim()  # fewer than 3 leading dims: size 1, stride 0
        shape = (1,) * lead + tuple(keys.shape)
        key_strides = (0,) * lead + keys.stride()
        out_strides = (0,) * lead + out.stride()
        diag, cross = diag.contiguous(), cross.contiguous()
        threads = torch.get_num_threads() if keys.numel() >= PARALLEL_GRAIN else 1
        self.functions[keys.dtype](keys.data_ptr(), out.data_ptr(), diag.data_ptr(), cross.data_ptr(), *shape,
                                   *key_strides[:3], *out_strides[:3], threads)


_kernel = BuiltOnce(lambda: NativeRotation.build(),
                    "re-anchoring uses torch ops, slower on the CPU (docs/BENCHMARKS.md `limits`)", log)


def native_kernel() -> NativeRotation | None:
    """This process's kernel, built on the first call (the only one that pays for it); None without one."""
    return _kernel.get()


@contextmanager
def torch_ops_only() -> Iterator[None]:
    """Within it, this process re-anchors by torch ops as a machine without a compiler does (benchmarks time
    both paths side by side; tests hold the fallback to the same numbers). Not for serving: process-wide."""
    kernel = native_kernel()
    _kernel.state["built"] = None
    try:
        yield
    finally:
        _kernel.state["built"] = kernel


def rotate_halves_torch(keys: torch.Tensor, diag: torch.Tensor, cross: torch.Tensor, out: torch.Tensor) -> None:
    """The factors applied by torch ops in float32: one product over whole rows (contiguous), then each half's
    cross term added in place — three passes where the halves alone took four."""
    half = keys.shape[-1] // 2
    keys = keys.float()
    work = out if out.dtype == torch.float32 else torch.empty_like(keys)
    torch.mul(keys, diag, out=work)
    work[..., :half].addcmul_(keys[..., half:], cross[:half])
    work[..., half:].addcmul_(keys[..., :half], cross[half:])
    if work is not out:
        out.copy_(work)


def rotate_halves(keys: torch.Tensor, diag: torch.Tensor, cross: torch.Tensor, out: torch.Tensor) -> None:
    """out = keys · diag + swap_halves(keys) · cross (`[..., head_dim]`, any dtype), computed in float32 and
    written into `out`: by the native kernel where it takes these tensors, else by torch ops."""
    kernel = native_kernel() if keys.device.type == out.device.type == "cpu" else None  # a GPU builds nothing
    if kernel is not None and kernel.accepts(keys, diag, cross, out):
        kernel(keys, diag, cross, out)
    else:
        rotate_halves_torch(keys, diag, cross, out)
