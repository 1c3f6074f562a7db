"""Cache loader: a plan's KV entries from a byte-bounded host-memory LRU, misses read through the store.

KV leaves this deployment in the wire codec's form (serve/kv/wire.py: numpy, zero-copy through Ray). A
quantised store's entries (pipeline/store/kv_quant.py) stay quantised here — in the LRU (twice the entries
per byte) and on the wire (half the bytes) — and are dequantised on the generator's device as they enter
its hot tier. Plans carry typed rows (`EntryRow`); `store_row` turns one back into the mapping the store's
reads take. Checksums are verified by the store on every read from it; what sits in the LRU was verified
when it was read. An entry whose shard is missing or corrupt is handed on as `LoadResult.unreadable`, with
its low-tier entry loaded as a backup when there is one: the generator rebuilds the entry from the chunk's
source, or serves the backup and reports the fallback, or refuses the request (503) — never a silent gap
in the context. A pending entry (a lazily compiled tier, serve/kv/pending.py) is handed on the same way,
unread: the generator compiles it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import torch

from pipeline.store import LeaseKeeper, QuantizedKV, ShardCorruptError, ShardReader, Store
from schemas.api import CacheReport, CacheStats, KVSource
from schemas.config import DType, KVQuant
from serve.config import LoaderConfig
from serve.kv.lru import ByteLRU
from serve.kv.pending import is_pending
from serve.kv.wire import to_wire
from serve.metrics import serve_metrics
from serve.plan import Entry, EntryRow, LoadedKV, LoadResult, Plan, Unreadable

LAZY_REASON = "not compiled yet: its tier is compiled on first promotion"  # the generator compiles it


def store_row(row: EntryRow) -> dict[str, Any]:
    """The index-row fields the store's verified reads take (`Store.load_kv`/`ShardReader.load_many`)."""
    if row.stored is None:  # pending, or compiled and not written back: nothing to read
        raise ValueError("the entry is not in the store")
    return row.stored._asdict()


def loaded(found: dict[str, tuple[np.ndarray, DType | KVQuant]], entry: Entry) -> LoadedKV:
    array, dtype = found[entry.key]
    return LoadedKV(array=array, dtype=dtype, entry=entry)


class CacheLoader:
    def __init__(self, config: LoaderConfig):
        self.config = config
        self.shards = ShardReader.open(config.store)  # the loader reads shards, nothing else of the store
        self.lru: ByteLRU[tuple[np.ndarray, DType | KVQuant]] = ByteLRU(config.max_nbytes,
                                                                         lambda item: item[0].nbytes)
        self._lock = threading.Lock()  # Serve runs sync methods on a thread pool
        self.metrics = serve_metrics()  # created here, inside the replica, so Ray tags it with the replica
        # Plans carry their index rows, so the loader holds no generation state of its own; it leases each
        # plan's generation so the shards it reads outlive a switch for as long as it may still read them.
        self.keeper = LeaseKeeper(Store.open(config.store), "loader", config.reload)

    def load(self, plan: Plan) -> LoadResult:
        started = time.perf_counter()
        if plan.generation:
            self.keeper.touch(plan.generation)
        entries = [c.entry for c in plan.chunks]
        report = CacheReport(hits=0, misses=0, nbytes_from_store=0)
        found, failed, source = self._fetch([e for e in entries if e is not None], report)
        backups = [c.fallback for c in plan.chunks if c.entry is not None and c.entry.key in failed and c.fallback]
        found_low, _, source_low = self._fetch(backups, report)
        found.update(found_low)
        source.update(source_low)
        kvs: list[LoadedKV | None] = []
        sources: list[KVSource | None] = []
        unreadable: list[Unreadable] = []
        for position, chunk in enumerate(plan.chunks):
            served = chunk.entry
            if chunk.entry is not None and chunk.entry.key in failed:
                backup = chunk.fallback if chunk.fallback is not None and chunk.fallback.key in found else None
                unreadable.append(Unreadable(position=position, entry=chunk.entry, reason=failed[chunk.entry.key],
                                             backup=backup and loaded(found, backup)))
                served = backup
            kvs.append(None if chunk.entry is None or chunk.entry.key in failed else loaded(found, chunk.entry))
            sources.append(None if served is None else source[served.key])
        load_ms = (time.perf_counter() - started) * 1e3
        return LoadResult(kvs=tuple(kvs), fallbacks=tuple(plan.fallbacks), cache=report, load_ms=load_ms,
                          unreadable=tuple(unreadable), sources=tuple(sources))

    def _fetch(self, entries: list[Entry], report: CacheReport) -> tuple[dict[str, tuple[np.ndarray, DType | KVQuant]],
                                                                         dict[str, str], dict[str, KVSource]]:
        """Arrays by entry key (LRU first, then one batched store read), why each failed key failed, and
        where each found one came from."""
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
        source = dict.fromkeys(found, KVSource.HOST) | dict.fromkeys(missing, KVSource.STORE)
        failed: dict[str, str] = {key: LAZY_REASON for key, entry in missing.items() if is_pending(entry)}
        tensors = self._read([e for key, e in missing.items() if key not in failed], failed)
        with self._lock:
            for key, tensor in tensors.items():
                array, dtype = to_wire(tensor)
                self.lru.put(key, (array, dtype))
                found[key] = (array, dtype)
                report.nbytes_from_store += array.nbytes
        return found, failed, source

    def _read(self, entries: list[Entry], failed: dict[str, str]) -> dict[str, torch.Tensor | QuantizedKV]:
        """One batched read; when it hits a bad shard, each entry is retried alone to isolate it."""
        if len(entries) > 1:
            try:
                return dict(zip((e.key for e in entries), self.shards.load_many([store_row(e.row) for e in entries])))
            except ShardCorruptError:
                pass
        out = {}
        for entry in entries:
            try:
                (out[entry.key],) = self.shards.load_many([store_row(entry.row)])
            except ShardCorruptError as e:
                failed[entry.key] = str(e)
                self.metrics.corrupt_shards.inc()
        return out

    def clear(self) -> None:
        """Empty the host cache: every entry's next load reads the store (a cold measurement, `qvpic eval`)."""
        with self._lock:
            self.lru.clear()

    def stats(self) -> CacheStats:
        with self._lock:
            return self.lru.stats()

    def close(self) -> None:
        """Stop renewing this loader's lease and drop it (an in-process loader's owner calls it when done)."""
        self.keeper.close()

    def __del__(self) -> None:  # Serve calls it on graceful shutdown: drop this replica's lease
        if hasattr(self, "keeper"):
            self.close()
