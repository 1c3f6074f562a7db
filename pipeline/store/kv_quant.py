"""Quantised KV entries in the KIVI layout: keys per channel, values per token.

A chunk's KV `[layers, 2, kv_heads, tokens, head_dim]` is stored as one packed record (uint8):

    payload      [layers, 2, kv_heads, tokens, head_dim]  int8 or float8_e4m3fn
    key scales   [layers, kv_heads, 1, head_dim]          bf16: one per (layer, head, channel), over tokens
    value scales [layers, kv_heads, tokens, 1]            bf16: one per (layer, head, token), over channels

Why these axes (KIVI, Liu et al. 2024): post-RoPE keys have outlier *channels* — a per-token scale
would be set by the outlier and crush every other channel of that token — while values have no fixed
outlier channels and are mixed per token by attention, so their error is kept per token. Scales are
absmax over their axis; quantisation divides by the scale *after* rounding it to bf16, so dequantising
with the stored scale is exact up to the payload's rounding: |error| ≤ scale / 2 per element for int8,
a 2⁻⁴ relative step for fp8 e4m3 (3 mantissa bits).

fp8 on a device: only casts (float → float8_e4m3fn → float) and byte views touch the fp8 payload — all
arithmetic is float32, and values are clamped to ±448 *before* the cast (torch's CPU cast saturates,
other kernels may give NaN; CPU has no fp8 add or clamp kernels). `check_device` probes a device once
so a job or replica on a device without those casts fails at start with a clear message, not per chunk.

One record per entry keeps the index's one-range-one-checksum contract (pipeline/store/shards.py): the
row's `dtype` names the format, its `shape` the logical KV shape, its `nbytes`/`checksum` the record.
Bytes per entry vs bf16: ½ for the payload, plus 1/head_dim for the value scales (2 bytes per token
and head over head_dim bytes of payload) and a key-scale row per entry — ≈0.51× at head_dim 64.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipeline.runtime import PAYLOAD_DTYPES, PAYLOAD_MAX, SCALE_DTYPE
from schemas.config import KVQuant

_SCALE_NBYTES = torch.tensor([], dtype=SCALE_DTYPE).element_size()


def _parts_nbytes(shape: Sequence[int]) -> tuple[int, int, int]:
    layers, two, heads, tokens, head_dim = shape
    if two != 2:
        raise ValueError(f"KV shape must be [layers, 2, kv_heads, tokens, head_dim], got {list(shape)}")
    return math.prod(shape), layers * heads * head_dim * _SCALE_NBYTES, layers * heads * tokens * _SCALE_NBYTES


def record_nbytes(shape: Sequence[int], quant: KVQuant) -> int:
    """Bytes of the packed record of a KV entry of `shape` (1-byte payload for both formats)."""
    if quant is KVQuant.NONE:
        raise ValueError("an unquantised entry has no record")
    return sum(_parts_nbytes(shape))


@dataclass(frozen=True)
class QuantizedKV:
    """One entry's packed record and views of its parts (no copies)."""

    quant: KVQuant
    shape: tuple[int, ...]  # logical KV shape [layers, 2, kv_heads, tokens, head_dim]
    record: torch.Tensor  # uint8 [record_nbytes(shape)]: payload, key scales, value scales

    def __post_init__(self) -> None:
        if self.quant is KVQuant.NONE:
            raise ValueError("QuantizedKV needs a quantised format, not 'none'")
        if self.record.dtype != torch.uint8 or self.record.dim() != 1:
            raise ValueError(f"a KV record is a 1-D uint8 tensor, got {self.record.dtype} {tuple(self.record.shape)}")
        if self.record.numel() != record_nbytes(self.shape, self.quant):
            raise ValueError(f"a {self.quant.value} record of KV {list(self.shape)} has "
                             f"{record_nbytes(self.shape, self.quant)} bytes, got {self.record.numel()}")

    @property
    def nbytes(self) -> int:
        return self.record.numel()

    def _part(self, index: int) -> torch.Tensor:
        sizes = _parts_nbytes(self.shape)
        begin = sum(sizes[:index])
        return self.record[begin:begin + sizes[index]]

    @property
    def payload(self) -> torch.Tensor:
        return self._part(0).view(PAYLOAD_DTYPES[self.quant]).view(self.shape)

    @property
    def key_scale(self) -> torch.Tensor:
        layers, _, heads, _, head_dim = self.shape
        return self._part(1).view(SCALE_DTYPE).view(layers, heads, 1, head_dim)

    @property
    def value_scale(self) -> torch.Tensor:
        layers, _, heads, tokens, _ = self.shape
        return self._part(2).view(SCALE_DTYPE).view(layers, heads, tokens, 1)


def absmax_scale(x: torch.Tensor, dim: int, quant: KVQuant) -> torch.Tensor:
    """absmax over `dim` (kept) / the payload's largest value, rounded to the scale dtype; never 0."""
    scale = (x.abs().amax(dim=dim, keepdim=True) / PAYLOAD_MAX[quant]).to(SCALE_DTYPE)
    return torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: any scale is exact


def to_payload(x: torch.Tensor, scale: torch.Tensor, quant: KVQuant) -> torch.Tensor:
    """x / scale in the payload dtype (clamped: the bf16-rounded scale may sit just under absmax / max)."""
    limit = PAYLOAD_MAX[quant]
    scaled = (x / scale.float()).clamp(-limit, limit)
    return (scaled.round() if quant is KVQuant.INT8 else scaled).to(PAYLOAD_DTYPES[quant])


def quantize(kv: torch.Tensor, quant: KVQuant) -> QuantizedKV:
    """`kv` [layers, 2, kv_heads, tokens, head_dim] (any float dtype, any device) as a record on its device."""
    shape = tuple(kv.shape)
    record = torch.empty(record_nbytes(shape, quant), dtype=torch.uint8, device=kv.device)
    out = QuantizedKV(quant, shape, record)
    x = kv.detach().float()
    keys, values = x[:, 0], x[:, 1]  # each [layers, kv_heads, tokens, head_dim]
    key_scale = absmax_scale(keys, dim=2, quant=quant)  # per channel: over tokens
    value_scale = absmax_scale(values, dim=3, quant=quant)  # per token: over channels
    out.key_scale.copy_(key_scale)
    out.value_scale.copy_(value_scale)
    payload = out.payload
    payload[:, 0] = to_payload(keys, key_scale, quant)
    payload[:, 1] = to_payload(values, value_scale, quant)
    return out


def dequantize(q: QuantizedKV, dtype: torch.dtype) -> torch.Tensor:
    """The record as KV [layers, 2, kv_heads, tokens, head_dim] in `dtype`, on the record's device."""
    out = torch.empty(q.shape, dtype=dtype, device=q.record.device)
    payload = q.payload
    out[:, 0] = payload[:, 0].float() * q.key_scale.float()
    out[:, 1] = payload[:, 1].float() * q.value_scale.float()
    return out


def stored(kv: torch.Tensor | QuantizedKV, quant: KVQuant) -> torch.Tensor | QuantizedKV:
    """What a store keeps of a compiled entry: the tensor itself, or its quantised record (a record
    read from the store already is one)."""
    if isinstance(kv, QuantizedKV):
        if kv.quant is not quant:
            raise ValueError(f"a {kv.quant.value} record in a store of {quant.value} KV")
        return kv
    return kv if quant is KVQuant.NONE else quantize(kv, quant)


def check_device(quant: KVQuant, device: torch.device | str) -> None:
    """Raise ValueError when `device` cannot quantise and dequantise `quant` (probed on a tiny KV)."""
    if quant is KVQuant.NONE:
        return
    probe = torch.linspace(-3, 3, 2 * 2 * 3 * 4, device=device).reshape(1, 2, 2, 3, 4)
    try:
        back = dequantize(quantize(probe, quant), torch.float32)
    except (RuntimeError, TypeError, NotImplementedError) as error:
        raise ValueError(f"{quant.value} KV is not supported on {device} by this torch: {error}; "
                         "use --kv-quant int8 or none") from error
    if not torch.allclose(back, probe, atol=0.1):
        raise ValueError(f"{quant.value} KV does not round-trip on {device} with this torch; "
                         "use --kv-quant int8 or none")
