"""Cache loader: a plan's KV entries from a byte-bounded host-memory LRU, misses read through the store.

KV leaves this deployment as numpy (bf16 as a uint16 view): Ray moves numpy buffers zero-copy, while a
bf16 torch tensor crossing as-is is ~10x slower. A quantised store's entries (pipeline/store/kv_quant.py) stay
quantised here — in the LRU (twice the entries per byte) and on the wire (half the bytes) — and are
dequantised on the generator's device as they enter its hot tier (`kv_tensor`). Checksums are
verified by the store on every read from it; what sits in the LRU was verified when it was read. An
entry whose shard is missing or corrupt is handed on as `LoadResult.unreadable`, with its low-tier entry loaded as a backup when there is one:
the generator rebuilds the entry from the chunk's source, or serves the backup and reports the
fallback, or refuses the request (503) — never a silent gap in the context. A pending entry (a lazily
compiled tier, serve/kv/pending.py) is handed on the same way, unread: the generator compiles it.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from pipeline.store import QuantizedKV, dequantize
from pipeline.store import ShardCorruptError, ShardReader
from pipeline.store import Store
from schemas.api import CacheReport, CacheStats
from schemas.config import DType, KVQuant
from schemas.generation import ReloadSpec
from schemas.store import StoreSpec
from serve.kv.lru import ByteLRU
from serve.metrics import serve_metrics
from serve.kv.pending import is_pending
from serve.plan import Entry, LoadedKV, LoadResult, Plan, Unreadable
from pipeline.store import LeaseKeeper

_WIRE = {torch.float32: (DType.FLOAT32, torch.float32), torch.float16: (DType.FLOAT16, torch.float16),
         torch.bfloat16: (DType.BFLOAT16, torch.uint16)}  # numpy has no bf16: ship its bits as uint16
LAZY_REASON = "not compiled yet: its tier is compiled on first promotion"  # the generator compiles it
_TORCH = {DType.FLOAT32: torch.float32, DType.FLOAT16: torch.float16, DType.BFLOAT16: torch.bfloat16}


def to_wire(tensor: torch.Tensor | QuantizedKV) -> tuple[np.ndarray, DType | KVQuant]:
    """A float KV as numpy of its bits, or a quantised entry as its uint8 record (its format as the dtype)."""
    if isinstance(tensor, QuantizedKV):
        array, dtype = tensor.record.cpu().numpy(), tensor.quant
    else:
        dtype, carrier = _WIRE[tensor.dtype]
        array = tensor.contiguous().view(carrier).numpy()
    array.flags.writeable = False  # shared by every request that hits it
    return array, dtype


def from_wire(array: np.ndarray, dtype: DType | KVQuant) -> torch.Tensor:
    """A tensor over `array`'s memory, no copy; read it, never write it.

    Arrays that arrive through Ray's object store, and those the LRU shares between requests, are
    read-only, and assembly only reads them. DLPack carries that read-only flag across (numpy >= 2.1),
    so the tensor is made without `torch.from_numpy`'s warning about non-writable arrays and without
    copying a context's worth of KV per request. A quantised entry comes back as its uint8 record."""
    return torch.from_dlpack(array).view(torch.uint8 if isinstance(dtype, KVQuant) else _TORCH[dtype])


def kv_tensor(kv: LoadedKV, device: torch.device | str, dtype: torch.dtype, copy: bool) -> torch.Tensor:
    """A loaded entry as KV `[layers, 2, kv_heads, tokens, head_dim]` on `device`.

    A quantised record crosses to the device as it is stored (half the bytes of bf16) and is
    dequantised there into `dtype`, a new tensor; a float entry is moved (copied when `copy`, which
    detaches it from the object store's or the LRU's buffer) and keeps its stored dtype."""
    tensor = from_wire(kv.array, kv.dtype)
    if isinstance(kv.dtype, KVQuant):
        record = QuantizedKV(kv.dtype, tuple(kv.entry.row["shape"]), tensor.to(device))
        return dequantize(record, dtype)
    return tensor.to(device, copy=copy)


class CacheLoader:
    def __init__(self, store: StoreSpec | str, max_nbytes: int, reload: ReloadSpec = ReloadSpec()):
        self.shards = ShardReader.open(store)  # the loader reads shards, nothing else of the store

        self.lru: ByteLRU[tuple[np.ndarray, DType | KVQuant]] = ByteLRU(max_nbytes, lambda item: item[0].nbytes)
        self._lock = threading.Lock()  # Serve runs sync methods on a thread pool
        self.metrics = serve_metrics()  # created here, inside the replica, so Ray tags it with the replica
        # Plans carry their index rows, so the loader holds no generation state of its own; it leases each
        # plan's generation so the shards it reads outlive a switch for as long as it may still read them.
        self.keeper = LeaseKeeper(Store.open(store), "loader", reload)

    def load(self, plan: Plan) -> LoadResult:
        started = time.perf_counter()
        if plan.generation:
            self.keeper.touch(plan.generation)
        entries = [c.entry for c in plan.chunks]
        report = CacheReport(hits=0, misses=0, nbytes_from_store=0)
        found, failed = self._fetch([e for e in entries if e is not None], report)
        backups = [c.fallback for c in plan.chunks if c.entry is not None and c.entry.key in failed and c.fallback]
        found_low, _ = self._fetch(backups, report)
        found.update(found_low)
        kvs: list[LoadedKV | None] = []
        unreadable: list[Unreadable] = []
        for position, chunk in enumerate(plan.chunks):
            if chunk.entry is not None and chunk.entry.key in failed:
                backup = chunk.fallback if chunk.fallback is not None and chunk.fallback.key in found else None
                unreadable.append(Unreadable(position, chunk.entry, failed[chunk.entry.key],
                                             backup and LoadedKV(*found[backup.key], backup)))
            kvs.append(None if chunk.entry is None or chunk.entry.key in failed
                       else LoadedKV(*found[chunk.entry.key], chunk.entry))
        load_ms = (time.perf_counter() - started) * 1e3
        return LoadResult(tuple(kvs), tuple(plan.fallbacks), report, load_ms, tuple(unreadable))

    def _fetch(self, entries: list[Entry], report: CacheReport) -> tuple[dict[str, tuple[np.ndarray, DType | KVQuant]],
                                                                         dict[str, str]]:
        """Arrays by entry key (LRU first, then one batched store read), and why each failed key failed."""
        found: dict[str, tuple[np.ndarray, DType | KVQuant]] = {}
        missing: dict[str, Entry] = {}
        with self._lock:
            for entry in entries:
                if entry.key in found or entry.key in missing:
                    continue
                item = self.lru.get(entry.key)
                if item is None:
                    missing[entry.key] = entry
                else:
                    found[entry.key] = item
        report.hits += len(found)
        report.misses += len(missing)
        failed: dict[str, str] = {key: LAZY_REASON for key, entry in missing.items() if is_pending(entry)}
        tensors = self._read([e for key, e in missing.items() if key not in failed], failed)
        with self._lock:
            for key, tensor in tensors.items():
                array, dtype = to_wire(tensor)
                self.lru.put(key, (array, dtype))
                found[key] = (array, dtype)
                report.nbytes_from_store += array.nbytes
        return found, failed

    def _read(self, entries: list[Entry], failed: dict[str, str]) -> dict[str, torch.Tensor | QuantizedKV]:
        """One batched read; when it hits a bad shard, each entry is retried alone to isolate it."""
        if len(entries) > 1:
            try:
                return dict(zip((e.key for e in entries), self.shards.load_many([e.row for e in entries])))
            except ShardCorruptError:
                pass
        out = {}
        for entry in entries:
            try:
                (out[entry.key],) = self.shards.load_many([entry.row])
            except ShardCorruptError as e:
                failed[entry.key] = str(e)
                self.metrics.corrupt_shards.inc()
        return out

    def stats(self) -> CacheStats:
        with self._lock:
            return self.lru.stats()

    def __del__(self) -> None:  # Serve calls it on graceful shutdown: drop this replica's lease
        if hasattr(self, "keeper"):
            self.keeper.close()
