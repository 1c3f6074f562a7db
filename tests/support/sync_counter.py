"""Counting the host syncs a piece of engine work forces: what would drain a GPU's stream, counted on any device.

- scalar reads: `aten._local_scalar_dense` (`aten.item`, `aten.is_nonzero` under inference mode), seen by a
  TorchDispatchMode (`.item()`, `int(t)`, `float(t)`, `bool(t)`, `t.__index__()` and C++ callers alike), plus
  operators whose output shape depends on the data (`nonzero`, boolean indexing, `masked_select`, `unique`...: a
  CUDA kernel's host must read the count back before it can allocate);
- device→host copies: `Tensor.tolist`, `.cpu` (C++ paths that read the data without the dispatcher; `.numpy` is
  not one: torch refuses it for a device tensor, so it always follows a `.cpu()` already counted);
- synchronizes: `torch.cuda.synchronize` and pipeline/runtime/timing.py's `wait_for` (which calls it only on a CUDA
  device: counted here on a CPU too, where the engine runs in the tests).

On this CPU-only torch the engine's "device" tensors are host tensors, so every read is counted: the engine must read
nothing it could know on the host (its own bookkeeping), which is the point.
"""

from __future__ import annotations

import sys
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline.runtime import timing

SCALAR_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,
                torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default}
DATA_DEPENDENT = {torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default,
                  torch.ops.aten._unique2.default, torch.ops.aten.unique_consecutive.default,
                  torch.ops.aten.unique_dim.default, torch.ops.aten.repeat_interleave.Tensor}
ROOT = Path(__file__).resolve().parents[2]
SCALAR, COPY, SYNC = "scalar reads", "device→host copies", "synchronizes"


@dataclass
class Syncs:
    """What was counted, by kind and by where (`label`, e.g. "tolist"), since the last `take`."""

    counts: Counter = field(default_factory=Counter)
    sites: Counter = field(default_factory=Counter)

    def add(self, kind: str, label: str) -> None:
        self.counts[(kind, label)] += 1
        self.sites[(kind, _site())] += 1

    def where(self) -> dict[str, int]:
        """Each read's kind and the product line that forced it ("scalar reads at serve/…/engine.py:270")."""
        return {f"{kind} at {site}": n for (kind, site), n in sorted(self.sites.items())}

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def by_kind(self) -> dict[str, int]:
        out: Counter = Counter()
        for (kind, _), n in self.counts.items():
            out[kind] += n
        return {kind: out[kind] for kind in (SCALAR, COPY, SYNC)}

    def take(self) -> Syncs:
        """The counts so far, and zero from here (one step's worth at a time)."""
        taken, self.counts, self.sites = Syncs(self.counts, self.sites), Counter(), Counter()
        return taken


def _site() -> str:
    """The innermost frame in qvpic's own code (serve/, pipeline/) of the current call: where a read came from."""
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(ROOT) and path.relative_to(ROOT).parts[0] in ("serve", "pipeline"):
            return f"{path.relative_to(ROOT)}:{frame.f_lineno}"
        frame = frame.f_back
    return "elsewhere"


class _ScalarReads(TorchDispatchMode):
    def __init__(self, syncs: Syncs):
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SCALAR_READS:  # `item` where inference mode dispatches it whole, else its scalar read
            self.syncs.add(SCALAR, "scalar")
        elif func in DATA_DEPENDENT:
            self.syncs.add(SCALAR, func.__name__)
        elif func is torch.ops.aten.index.Tensor and any(
                i is not None and i.dtype == torch.bool for i in args[1]):
            self.syncs.add(SCALAR, "boolean index")
        return func(*args, **kwargs)


@contextmanager
def counting_syncs(monkeypatch: pytest.MonkeyPatch):
    """Count every host sync inside the block; yields a `Syncs` (call `take()` between steps)."""
    syncs = Syncs()

    def counted(kind: str, label: str, real):
        def wrapper(*args, **kwargs):
            syncs.add(kind, label)
            return real(*args, **kwargs)
        return wrapper

    for name in ("tolist", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, counted(COPY, name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch.cuda, "synchronize", counted(SYNC, "cuda.synchronize", torch.cuda.synchronize))
    monkeypatch.setattr(timing, "wait_for", counted(SYNC, "wait_for", timing.wait_for))
    with _ScalarReads(syncs):
        yield syncs
