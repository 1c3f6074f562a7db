"""A simulated CUDA device for tests on a CPU-only torch: FakeTensorMode, plus stand-ins for what it refuses.

FakeTensorMode makes `device="cuda"` tensors (shapes, dtypes, devices; no data) and raises on a device mismatch.
It refuses every host read (`.item()`, `int(t)`, `.tolist()`, `.numpy()`). `HostReads` stands in for them: each
read is recorded — what it read, from which device, how many elements — and returns a placeholder (zeros), so the
code under test runs on and a test asserts on the reads: none of a device tensor by numpy, how many per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

CUDA = torch.device("cuda", 0)
_NUMPY = {torch.uint8: np.uint8, torch.uint16: np.uint16, torch.int32: np.int32, torch.int64: np.int64,
          torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


@dataclass(frozen=True)
class Read:
    kind: str  # item, int, float, tolist, numpy
    device: torch.device
    numel: int


def _zeros(shape: tuple[int, ...]) -> list | int:
    return 0 if not shape else [_zeros(shape[1:]) for _ in range(shape[0])]


@dataclass
class HostReads:
    reads: list[Read] = field(default_factory=list)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> HostReads:
        def recorded(kind, value):
            def read(tensor, *args, **kwargs):
                self.reads.append(Read(kind, tensor.device, tensor.numel()))
                return value(tensor)
            return read

        monkeypatch.setattr(torch.Tensor, "item", recorded("item", lambda t: 0))
        monkeypatch.setattr(torch.Tensor, "__int__", recorded("int", lambda t: 0))
        monkeypatch.setattr(torch.Tensor, "__float__", recorded("float", lambda t: 0.0))
        monkeypatch.setattr(torch.Tensor, "tolist", recorded("tolist", lambda t: _zeros(tuple(t.shape))))

        def numpy(tensor, *, force=False):
            # numpy reads host memory: what real torch refuses for a device tensor (a TypeError), this refuses too
            self.reads.append(Read("numpy", tensor.device, tensor.numel()))
            if tensor.device.type != "cpu":
                raise TypeError(f"can't convert {tensor.device} device type tensor to numpy")
            return np.zeros(tuple(tensor.shape), dtype=_NUMPY[tensor.dtype])

        monkeypatch.setattr(torch.Tensor, "numpy", numpy)
        return self

    def of(self, kind: str) -> list[Read]:
        return [r for r in self.reads if r.kind == kind]
