"""Wall time of a phase of model work, in milliseconds, as the device sees it."""

from __future__ import annotations

import time

import torch


def ms_since(started: float, device: torch.device) -> float:
    """Milliseconds since `started` (a `time.perf_counter()` reading), once `device` has finished the work
    queued so far: CUDA kernels run asynchronously, so without the wait a phase would read as only its launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - started) * 1e3
