"""The repair path and the lazily compiled tier on a simulated CUDA device (tests/support/fake_cuda.py).

On a GPU the generator's model compiles a rebuilt or lazily promoted entry on the device; the repairer then puts
it on the wire (numpy: host memory only). These runs hand it KV on `cuda:0` and assert it crosses to the host
whole, once, before numpy reads it. Controls: KV left on the device fails them (numpy of a device tensor is the
TypeError real torch raises), and so does a catch that turns that fault into a served fallback.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from pipeline.runtime import ChunkKV
from pipeline.store import QuantizedKV
from pipeline.store.kv_quant import record_nbytes
from schemas.config import DType, KVQuant
from schemas.modes import ChunkKind, Variant
from schemas.report import CacheReport
from schemas.store import CacheKey
from serve.engine import repair as repair_module
from serve.engine.repair import Repairer
from serve.kv import lazy_tier, to_wire
from serve.kv import wire as wire_module
from serve.kv.lazy_tier import LazyTier
from serve.metrics import serve_metrics
from serve.plan import LoadedKV, LoadResult, Unreadable
from tests.support.fake_cuda import CUDA, HostReads

SHAPE = (3, 2, 2, 7, 8)  # [layers, 2, kv_heads, tokens, head_dim]


def entry(pending: bool, tier: str = "hi") -> SimpleNamespace:
    key = CacheKey("c" * 64, tier, Variant.TEMPLATE, "f" * 64).to_str()
    return SimpleNamespace(key=key, tier=tier, row=SimpleNamespace(pending=pending))


def compiled() -> ChunkKV:
    """What the generator's model compiles on a GPU: the KV on the device."""
    return ChunkKV(torch.empty(SHAPE, dtype=torch.bfloat16, device=CUDA), 7, 0, ChunkKind.TEXT)


def repairer(recompile, monkeypatch) -> Repairer:
    """A repairer whose compiles are `recompile(chunk, entry)`; the lazy tier is the real one, its store reads and
    writes stood in for (nothing written back before, a write-back that succeeds)."""
    repairer = Repairer.__new__(Repairer)
    repairer.kv_quant, repairer.metrics = KVQuant.NONE, serve_metrics()
    repairer.recompile = lambda chunk, e: recompile(chunk, e)
    repairer.compile_entry = lambda chunk, e: (recompile(chunk, e), [])
    repairer.lazy = LazyTier(store=None, manifest=None, compile_entry=repairer.compile_entry)
    written: list[torch.device] = []
    monkeypatch.setattr(lazy_tier, "written_back", lambda store, key: None)
    monkeypatch.setattr(lazy_tier, "write_back", lambda store, manifest, key, kv, sizes: written.append(kv.kv.device))
    monkeypatch.setattr(lazy_tier, "entry_of", lambda row: entry(pending=False))
    repairer.written = written
    return repairer


def load_result(*entries: SimpleNamespace, backup: LoadedKV | None = None) -> LoadResult:
    unreadable = tuple(Unreadable(i, e, "shard missing", backup) for i, e in enumerate(entries))
    return LoadResult(kvs=(None,) * len(entries), fallbacks=(), cache=CacheReport(hits=0, misses=1,
                      nbytes_from_store=0), load_ms=0.0, unreadable=unreadable)


def plan(n: int) -> SimpleNamespace:
    return SimpleNamespace(chunks=tuple(SimpleNamespace(chunk_id=f"chunk-{i}") for i in range(n)))


def host_copies(monkeypatch) -> list[tuple[torch.device, torch.device]]:
    """Each `Tensor.to` that moves a tensor between devices: (from, to)."""
    moves, real_to = [], torch.Tensor.to

    def to(tensor, *args, **kwargs):
        out = real_to(tensor, *args, **kwargs)
        if out.device != tensor.device:
            moves.append((tensor.device, out.device))
        return out

    monkeypatch.setattr(torch.Tensor, "to", to)
    return moves


def test_rebuilt_and_lazily_compiled_kv_cross_to_the_host_once_each_before_numpy(monkeypatch):
    reads = HostReads().install(monkeypatch)
    moves = host_copies(monkeypatch)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fixer = repairer(lambda chunk, e: compiled(), monkeypatch)
        repaired = fixer.repair(plan(2), load_result(entry(pending=False), entry(pending=True)))
    assert [kv.array.shape for kv in repaired.kvs] == [SHAPE, SHAPE]
    assert [kv.dtype for kv in repaired.kvs] == [DType.BFLOAT16] * 2
    assert repaired.fallbacks == () and repaired.unreadable == ()
    assert [(r.device.type, r.numel) for r in reads.of("numpy")] == [("cpu", 3 * 2 * 2 * 7 * 8)] * 2
    assert moves == [(CUDA, torch.device("cpu"))] * 2  # each entry whole, in one transfer: no per-layer copies
    assert fixer.written == [CUDA]  # the lazy tier's write-back got the compiled KV (the store's pack moves it)


def test_a_quantised_record_on_the_device_crosses_to_the_host_before_numpy(monkeypatch):
    reads = HostReads().install(monkeypatch)
    with FakeTensorMode(allow_non_fake_inputs=True):
        record = torch.empty(record_nbytes(SHAPE, KVQuant.INT8), dtype=torch.uint8, device=CUDA)
        array, dtype = to_wire(QuantizedKV(KVQuant.INT8, SHAPE, record))
    assert dtype is KVQuant.INT8 and array.shape == (record_nbytes(SHAPE, KVQuant.INT8),)
    assert [r.device.type for r in reads.of("numpy")] == ["cpu"]


def test_control_kv_left_on_the_device_fails_the_repair(monkeypatch):
    """The fault as it was: numpy of the device KV (a TypeError, which the repairer must not turn into a fallback)."""
    HostReads().install(monkeypatch)
    monkeypatch.setattr(wire_module, "on_host", lambda tensor: tensor.contiguous())
    with FakeTensorMode(allow_non_fake_inputs=True):
        fixer = repairer(lambda chunk, e: compiled(), monkeypatch)
        with pytest.raises(TypeError, match="cuda:0 device type tensor to numpy"):
            fixer.repair(plan(1), load_result(entry(pending=True), backup=backup()))


def backup() -> LoadedKV:
    array, dtype = to_wire(torch.zeros(SHAPE, dtype=torch.bfloat16))
    return LoadedKV(array=array, dtype=dtype, entry=entry(pending=False, tier="lo"))


def test_a_compile_out_of_device_memory_serves_the_backup_and_says_so():
    fixer = Repairer.__new__(Repairer)
    fixer.kv_quant, fixer.metrics = KVQuant.NONE, serve_metrics()
    fixer.recompile = lambda chunk, e: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory"))
    fallback = backup()
    repaired = fixer.repair(plan(1), load_result(entry(pending=False), backup=fallback))
    assert repaired.kvs == (fallback,)
    (report,) = repaired.fallbacks
    assert (report.requested_tier, report.served_tier) == ("hi", "lo") and "out of memory" in report.reason


def test_control_without_the_out_of_memory_catch_the_request_fails_though_a_backup_was_ready(monkeypatch):
    monkeypatch.setattr(repair_module, "NOT_REBUILT", (ValueError,))
    fixer = Repairer.__new__(Repairer)
    fixer.kv_quant, fixer.metrics = KVQuant.NONE, serve_metrics()
    fixer.recompile = lambda chunk, e: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory"))
    with pytest.raises(torch.OutOfMemoryError):
        fixer.repair(plan(1), load_result(entry(pending=False), backup=backup()))


def test_a_fault_in_the_repair_escapes_rather_than_falling_back():
    fixer = Repairer.__new__(Repairer)
    fixer.kv_quant, fixer.metrics = KVQuant.NONE, serve_metrics()
    fixer.recompile = lambda chunk, e: (_ for _ in ()).throw(TypeError("a bug"))
    with pytest.raises(TypeError, match="a bug"):
        fixer.repair(plan(1), load_result(entry(pending=False), backup=backup()))
