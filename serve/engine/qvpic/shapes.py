"""The static shapes a forward over a slab takes on CUDA (issue 59 item 2): its width and its rows rounded up to
buckets, so a run of decode steps repeats a few shapes (a captured step, a compiled kernel's cache) where the exact
ones took a new shape at every step, join or finish. serve/engine/qvpic/slab.py says why the extra columns and rows
change nothing the real rows compute."""

from __future__ import annotations

import torch

# A forward's width on CUDA is rounded up to a multiple of max(WIDTH_BUCKET_MIN, the power of two at or above it
# / (2 · WIDTH_BUCKETS_PER_OCTAVE)): 8 widths per doubling past 1,024 columns (16 below it, 64 apart), at most 63
# more columns than the rows need up to 512, at most 1/8 more past it (4.4 % on average from 512 to 32k: of the
# attention only, all masked); 56 distinct widths from 1 to 32k columns, each repeated over many decode steps, where
# the exact width took a new shape at every step. The CPU keeps the exact width: it has no graph to capture, and
# the extra columns would cost it time.
WIDTH_BUCKET_MIN = 64
WIDTH_BUCKETS_PER_OCTAVE = 8


# A decode step's rows on CUDA: 1, 2, 4, then multiples of ROW_BUCKET_STEP (vLLM's CUDA graph capture sizes): at
# most 7 padding rows (3 up to 8 rows, 1/8 of the rows or less past 56); 19 shapes from 1 to 128 rows where every
# join and finish took a new one. Each padding row costs a row of the slab's memory (its capacity's columns).
ROW_BUCKET_STEP = 8


def bucket_width(width: int) -> int:
    """`width` rounded up to its bucket (see `WIDTH_BUCKET_MIN`)."""
    step = max(WIDTH_BUCKET_MIN, (1 << max(width - 1, 0).bit_length()) // (2 * WIDTH_BUCKETS_PER_OCTAVE))
    return -(-width // step) * step


def bucket_rows(rows: int) -> int:
    """`rows` rounded up to its bucket (see `ROW_BUCKET_STEP`); 0 stays 0."""
    if rows <= ROW_BUCKET_STEP // 2:
        return 1 << max(rows - 1, 0).bit_length() if rows else 0
    return -(-rows // ROW_BUCKET_STEP) * ROW_BUCKET_STEP


def buckets_on(device: torch.device) -> bool:
    """Whether slabs on `device` bucket their widths and rows: on CUDA only (the CPU has no graph to capture, and
    the masked columns and padding rows would cost it time). The one switch: tests turn it on for the CPU."""
    return device.type == "cuda"


def slab_rows(rows: int, device: torch.device | str) -> int:
    """The rows a slab of `rows` real rows allocates on `device` (its padding rows included)."""
    return bucket_rows(rows) if buckets_on(torch.device(device)) else rows
