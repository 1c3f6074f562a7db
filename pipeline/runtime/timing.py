"""Wall time of a phase of model work, in milliseconds, as the device sees it."""

from __future__ import annotations

import time

import torch


def wait_for(device: torch.device) -> None:
    """Until `device` has finished the work queued so far (a no-op on a CPU: its work is done when queued)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ms_since(started: float, device: torch.device, synced: bool = False) -> float:
    """Milliseconds since `started` (a `time.perf_counter()` reading), once `device` has finished the work
    queued so far: CUDA kernels run asynchronously, so without the wait a phase would read as only its launches.
    `synced`: the caller has just read a result of that work back (the read waited for it), so no second wait."""
    if not synced:
        wait_for(device)
    return (time.perf_counter() - started) * 1e3
