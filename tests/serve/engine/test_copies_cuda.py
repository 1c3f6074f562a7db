"""Issue 59 item 4, copies off the step, on a simulated CUDA device (tests/support/fake_cuda.py): a request's new
prefix-cache blocks leave its slab row in one gather and one batched copy (not a clone per block); demoted blocks go
to pinned host memory, non-blocking, on a side stream that first waits for the step's stream; promoted blocks and
hot-tier misses come back pinned, non-blocking, on that side stream, the step's stream fenced on the GPU (never the
host) or, for a miss, the copies' event waited on off the event loop. On the CPU all of it is the plain path.

Work is counted, not timed: every aten operation is recorded (a TorchDispatchMode) with the stream it was issued on
(torch.cuda's stream calls are stood in for: this torch has no CUDA). Controls (see the report of the change that
added this file): a clone per block put back, and a demotion by a plain `.to("cpu")`, both fail here."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from schemas.config import DType
from serve.engine.qvpic.prefix_cache import PrefixCache, batched_copies
from serve.kv import wire
from tests.support.fake_cuda import CUDA

aten = torch.ops.aten
SHAPE = (2, 2, 1, 32, 8)  # [layers, 2, kv_heads, columns, head_dim]: 8 blocks of 4 columns
BLOCK_NBYTES = 2 * 2 * 1 * 4 * 8 * 4  # one block, float32


@dataclass
class Stream:
    name: str
    waited_for: list[str] = field(default_factory=list)
    events: int = 0

    def wait_stream(self, other: Stream) -> None:
        self.waited_for.append(other.name)

    def record_event(self):
        self.events += 1
        return SimpleNamespace(synchronize=lambda: None)


@dataclass
class Op:
    name: str
    stream: str
    device: str | None = None  # `_to_copy`'s target
    non_blocking: bool = False


class Recorder(TorchDispatchMode):
    """Every aten operation, with the stream active when it was issued."""

    def __init__(self, streams: Streams):
        super().__init__()
        self.streams, self.ops = streams, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        self.ops.append(Op(func.overloadpacket.__name__, self.streams.active.name,
                           None if device is None else torch.device(device).type, bool(kwargs.get("non_blocking"))))
        return func(*args, **kwargs)

    def named(self, name: str) -> list[Op]:
        return [op for op in self.ops if op.name == name]


class Streams:
    """torch.cuda's streams, stood in for: the step's ("compute") and any side stream made."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.compute = Stream("compute")
        self.active, self.made, self.record_stream, self.pinned = self.compute, [], [], 0

        def make(device):
            self.made.append(Stream(f"side{len(self.made)}"))
            return self.made[-1]

        @contextmanager
        def on(stream):
            previous, self.active = self.active, stream
            try:
                yield
            finally:
                self.active = previous

        def pin(tensor):
            self.pinned += 1
            return tensor

        monkeypatch.setattr(torch.cuda, "Stream", make)
        monkeypatch.setattr(torch.cuda, "stream", on)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.active)
        monkeypatch.setattr(torch.Tensor, "record_stream",
                            lambda t, s: self.record_stream.append((t.device.type, s.name)))
        monkeypatch.setattr(torch.Tensor, "pin_memory", pin)


def hashes(n: int) -> list[bytes]:
    return [bytes([i]) * 32 for i in range(n)]


def test_new_blocks_leave_in_one_gather_and_one_batched_copy_and_demotion_is_pinned_on_a_side_stream(monkeypatch):
    streams = Streams(monkeypatch)
    with FakeTensorMode():
        cache = PrefixCache(block_tokens=4, device_nbytes=3 * BLOCK_NBYTES, host_nbytes=8 * BLOCK_NBYTES, device=CUDA)
        kv = torch.empty(SHAPE, device=CUDA)
        with Recorder(streams) as recorded:
            cache.insert(hashes(8), kv, np.arange(1, 33))
    # 8 new blocks: one gather and one batched copy, on the step's stream; no clone, no per-block copy
    assert [(op.name, op.stream) for op in recorded.named("index_select")] == [("index_select", "compute")]
    assert len(recorded.named("_foreach_copy_")) == 1
    assert recorded.named("clone") == [] and recorded.named("copy_") == []
    # 5 of them demoted (the device holds 3): each a non-blocking copy to the host on the side stream, which waited
    # for the step's stream first; each device block marked used there (its memory not reused before it is read)
    side, = streams.made
    to_host = [op for op in recorded.named("_to_copy") if op.device == "cpu"]
    assert [(op.stream, op.non_blocking) for op in to_host] == [(side.name, True)] * 5
    assert side.waited_for == ["compute"] * 5 and streams.record_stream == [("cuda", side.name)] * 5
    assert cache.stats.demoted_blocks == 5 and cache.stats.device_nbytes == 3 * BLOCK_NBYTES


def test_promoted_blocks_come_back_pinned_on_the_side_stream_and_the_steps_stream_waits_on_the_gpu(monkeypatch):
    streams = Streams(monkeypatch)
    with FakeTensorMode():
        cache = PrefixCache(block_tokens=4, device_nbytes=3 * BLOCK_NBYTES, host_nbytes=8 * BLOCK_NBYTES, device=CUDA)
        cache.insert(hashes(8), torch.empty(SHAPE, device=CUDA), np.arange(1, 33))  # blocks 0-4 on the host
        with Recorder(streams) as recorded:
            found = cache.match(hashes(2))
    assert len(found) == 2 and all(block.kv.device == CUDA for block in found)
    side, = streams.made
    to_device = [op for op in recorded.named("_to_copy") if op.device == "cuda"]
    assert [(op.stream, op.non_blocking) for op in to_device] == [(side.name, True)] * 2
    assert streams.pinned == 2  # (the fake's host tensors are not pinned: a real demotion's already are)
    assert streams.compute.waited_for == ["side0"]  # one fence for both, on the GPU; no host wait
    assert side.events == 0


def test_a_hot_tier_miss_crosses_pinned_on_the_side_stream_unfenced_until_it_has_landed(monkeypatch):
    streams = Streams(monkeypatch)
    staging = wire.Staging(CUDA)
    with FakeTensorMode():
        host = torch.empty(SHAPE)
        monkeypatch.setattr(wire, "from_wire", lambda array, dtype: host)
        loaded = SimpleNamespace(array=None, dtype=DType.FLOAT32)
        with Recorder(streams) as recorded:
            tensor = wire.kv_tensor(loaded, CUDA, torch.float32, copy=True, staging=staging)
    assert tensor.device == CUDA and streams.pinned == 1
    assert [(op.stream, op.non_blocking) for op in recorded.named("_to_copy")] == [("side0", True)]
    assert streams.compute.waited_for == []  # the engine's stream never waits for a miss
    staging.landed()
    assert streams.made[0].events == 1  # what serve/engine/context.py waits on, off the loop


def test_on_the_cpu_it_is_the_plain_path():
    cache = PrefixCache(block_tokens=4, device_nbytes=3 * BLOCK_NBYTES, host_nbytes=8 * BLOCK_NBYTES,
                        device=torch.device("cpu"))
    kv = torch.arange(np.prod(SHAPE), dtype=torch.float32).view(SHAPE)
    cache.insert(hashes(8), kv, np.arange(1, 33))
    assert cache.staging._stream is None  # no stream made
    found = cache.match(hashes(8)[3:5])
    assert [torch.equal(b.kv, kv[:, :, :, 4 * i:4 * i + 4]) for b, i in zip(found, (3, 4))] == [True, True]


def test_the_batched_copies_are_the_blocks_each_in_memory_of_its_own():
    """The GPU's path computed on the CPU (the same operations): block i is columns [4i, 4i + 4) of a strided
    slab row, its own storage, contiguous. Control: a gather along the wrong axis is caught."""
    slab = torch.randn(2, 2, 3, 1, 40, 8)  # [layers, 2, rows, kv_heads, capacity, head_dim]
    row = slab[:, :, 1, :, :32]  # a row's columns, as the engine stores them: a strided view
    got = batched_copies(row, [1, 2, 5, 7], 4)
    assert all(torch.equal(block, row[:, :, :, 4 * i:4 * i + 4]) for block, i in zip(got, [1, 2, 5, 7]))
    assert all(block.is_contiguous() for block in got)
    assert len({block.untyped_storage().data_ptr() for block in got}) == 4  # evicted one by one, each one's bytes go
