"""The one map between stored dtype names and torch dtypes.

An index row's `dtype` names how its entry's bytes are laid out: a float `DType` (the tensor as
compiled) or a quantised `KVQuant` format (a packed record, pipeline/store/kv_quant.py). `stored_format`
reads that column; the payload and scale dtypes of the quantised formats are mapped here too.
"""

from __future__ import annotations

import torch

from schemas.config import DType, KVQuant

TORCH_DTYPES = {DType.FLOAT32: torch.float32, DType.BFLOAT16: torch.bfloat16, DType.FLOAT16: torch.float16}
DTYPE_OF = {torch_dtype: dtype for dtype, torch_dtype in TORCH_DTYPES.items()}

# Quantised KV: the payload's element type, the largest magnitude it holds, and the scales' dtype
# (bf16: fp32's range at half the bytes; quantisation divides by the bf16-rounded scale, so the
# scale's rounding costs nothing on dequantisation).
PAYLOAD_DTYPES = {KVQuant.INT8: torch.int8, KVQuant.FP8: torch.float8_e4m3fn}
PAYLOAD_MAX = {KVQuant.INT8: 127.0, KVQuant.FP8: float(torch.finfo(torch.float8_e4m3fn).max)}  # fp8 e4m3: 448
SCALE_DTYPE = torch.bfloat16

StoredFormat = DType | KVQuant


def stored_format(value: str) -> StoredFormat:
    """An index row's `dtype` column: a float DType, or a quantised record's KVQuant (never NONE)."""
    try:
        return DType(value)
    except ValueError:
        pass
    quant = KVQuant(value)  # ValueError for anything else
    if quant is KVQuant.NONE:
        raise ValueError("an index row's dtype is a float dtype or a quantised format, never 'none'")
    return quant
