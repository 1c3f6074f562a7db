"""The wire codec: KV as it moves between deployments (loader → generator) and sits in the loader's LRU.

KV crosses as numpy (bf16 as a uint16 view): Ray moves numpy buffers zero-copy, while a bf16 torch
tensor crossing as-is is ~10x slower. A quantised store's entries (pipeline/store/kv_quant.py) stay
quantised on the wire (half the bytes) and are dequantised on the generator's device (`kv_tensor`).
"""

from __future__ import annotations

import numpy as np
import torch

from pipeline.store import QuantizedKV, dequantize
from schemas.config import DType, KVQuant
from serve.kv.staging import Staging
from serve.plan import LoadedKV

_WIRE = {torch.float32: (DType.FLOAT32, torch.float32), torch.float16: (DType.FLOAT16, torch.float16),
         torch.bfloat16: (DType.BFLOAT16, torch.uint16)}  # numpy has no bf16: ship its bits as uint16
_TORCH = {DType.FLOAT32: torch.float32, DType.FLOAT16: torch.float16, DType.BFLOAT16: torch.bfloat16}


def to_wire(tensor: torch.Tensor | QuantizedKV) -> tuple[np.ndarray, DType | KVQuant]:
    """A float KV as numpy of its bits, or a quantised entry as its uint8 record (its format as the dtype).

    numpy reads host memory only, and a KV compiled by the generator's model (the repair path, a lazily compiled
    tier) is on its device: it comes to the host first, whole, in one copy — one sync, not one per layer. A host
    tensor is not copied."""
    if isinstance(tensor, QuantizedKV):
        array, dtype = on_host(tensor.record).numpy(), tensor.quant
    else:
        dtype, carrier = _WIRE[tensor.dtype]
        array = on_host(tensor).view(carrier).numpy()
    array.flags.writeable = False  # shared by every request that hits it
    return array, dtype


def on_host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` contiguous in host memory: itself when it is already; from a device, one transfer."""
    return tensor.detach().to("cpu").contiguous()  # `to` keeps a dense tensor's strides: order it on the host


def from_wire(array: np.ndarray, dtype: DType | KVQuant) -> torch.Tensor:
    """A tensor over `array`'s memory, no copy; read it, never write it.

    Arrays that arrive through Ray's object store, and those the LRU shares between requests, are
    read-only, and assembly only reads them. DLPack carries that read-only flag across (numpy >= 2.1),
    so the tensor is made without `torch.from_numpy`'s warning about non-writable arrays and without
    copying a context's worth of KV per request. A quantised entry comes back as its uint8 record."""
    return torch.from_dlpack(array).view(torch.uint8 if isinstance(dtype, KVQuant) else _TORCH[dtype])


def kv_tensor(kv: LoadedKV, device: torch.device | str, dtype: torch.dtype, copy: bool,
              staging: Staging | None = None) -> torch.Tensor:
    """A loaded entry as KV `[layers, 2, kv_heads, tokens, head_dim]` on `device`.

    A quantised record crosses to the device as it is stored (half the bytes of bf16) and is
    dequantised there into `dtype`, a new tensor; a float entry is moved (copied when `copy`, which
    detaches it from the object store's or the LRU's buffer) and keeps its stored dtype. With a CUDA
    `staging` (serve/kv/staging.py) the host→device copy goes pinned, on its side stream: a float entry's is
    not fenced (the caller waits for `staging.landed()` before anything reads it), a quantised record's is
    (its dequantisation reads it on the caller's stream)."""
    tensor = from_wire(kv.array, kv.dtype)
    staged = staging is not None and staging.cuda
    if isinstance(kv.dtype, KVQuant):
        moved = staging.to_device([tensor])[0] if staged else tensor.to(device)
        return dequantize(QuantizedKV(kv.dtype, kv.entry.row.stored.shape, moved), dtype)
    return staging.to_device([tensor], fence=False)[0] if staged else tensor.to(device, copy=copy)
