"""KV copies between host memory and the engine's device, kept off the step (issue 59 item 4).

On CUDA a plain `.to(device)` runs on the stream the engine's forwards run on (the default stream, one per device,
shared by every thread): a demoted prefix-cache block's device→host copy, a promoted block's or a hot-tier miss's
host→device copy waits behind the decode step's kernels queued before it, and every kernel queued after waits behind
it. From pageable memory it is worse: the host thread blocks while the driver stages the bytes. So on CUDA each copy
goes through page-locked (pinned) host memory, `non_blocking`, on a side stream of its own:
- to the host (`to_host`): the side stream first waits for the work queued so far (the bytes must be written), the
  copy lands in pinned memory (torch pins a non-blocking device→host copy's destination) and the device tensor is
  marked used on the side stream (its memory is not reused before the copy has read it). The host copy is complete
  once the side stream gets there: a caller reads it only through `to_device` (the same stream, so in order) or
  after `wait_host`;
- to the device (`to_device`): a host tensor not pinned yet is pinned (one host memcpy, off the device), copied
  non-blocking on the side stream, and the result marked used on the caller's stream; then either the caller's
  stream waits for the side stream on the GPU (`fence=True`, for the engine's own thread: no host wait), or the
  caller gets the copies' event to wait on off its loop (a hot-tier miss arrives in the replica's event loop while
  the engine's thread runs steps: that stream must not wait for it).
Anywhere else (the CPU) both are the plain `.to`: nothing to overlap.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

HOST = torch.device("cpu")


class Staging:
    """Host↔device copies for one device: pinned, non-blocking, on a side stream where the device is CUDA."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._stream = None  # made at the first copy: a CPU engine (and the tests' fake CUDA) never needs one

    @property
    def stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def to_host(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each tensor in host memory (pinned on CUDA; complete once the side stream has run the copies)."""
        if not self.cuda:
            return [t.to(HOST) for t in tensors]
        side = self.stream
        side.wait_stream(torch.cuda.current_stream(self.device))  # the bytes are written before they are read
        with torch.cuda.stream(side):
            out = [t.to(HOST, non_blocking=True) for t in tensors]  # (a non-blocking copy's destination is pinned)
        for t in tensors:
            t.record_stream(side)
        return out

    def to_device(self, tensors: Sequence[torch.Tensor], fence: bool = True) -> list[torch.Tensor]:
        """Each host tensor on the device. `fence`: the caller's stream waits for the copies on the GPU; else
        nothing may read them before `landed()`'s event is set."""
        if not self.cuda:
            return [t.to(self.device) for t in tensors]
        side, current = self.stream, torch.cuda.current_stream(self.device)
        staged = [t if t.is_pinned() else t.pin_memory() for t in tensors]
        with torch.cuda.stream(side):
            out = [t.to(self.device, non_blocking=True) for t in staged]
        for t in out:  # allocated on the side stream, read on the caller's: not freed before that reads it
            t.record_stream(current)
        if fence:
            current.wait_stream(side)
        return out

    def landed(self):
        """An event set once every copy queued so far has landed (None off CUDA: they already have)."""
        return self.stream.record_event() if self.cuda else None

    def wait_host(self) -> None:
        """Block until every copy queued so far has landed (before the host reads what `to_host` returned)."""
        if self.cuda and self._stream is not None:
            self._stream.synchronize()
