"""The one map between stored dtype names and torch dtypes."""

from __future__ import annotations

import torch

from schemas.config import DType

TORCH_DTYPES = {DType.FLOAT32: torch.float32, DType.BFLOAT16: torch.bfloat16, DType.FLOAT16: torch.float16}
DTYPE_OF = {torch_dtype: dtype for dtype, torch_dtype in TORCH_DTYPES.items()}
