"""Cache loader: a plan's KV entries through two cache tiers (serve/kv/tier.py) — a byte-bounded host-memory LRU
(`HostTier`), then the store's shards (`StoreTier`), what the store gives kept in the LRU.

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

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from pipeline.store import LeaseKeeper, QuantizedKV, ShardCorruptError, ShardReader, Store
from schemas.config import DType, KVQuant
from schemas.errors import public_reason
from schemas.report import CacheReport, KVOrigin
from schemas.service import CacheStats
from serve.config import LoaderConfig
from serve.kv.lru import ByteLRU
from serve.kv.pending import is_pending
from serve.kv.tier import KVTier, TierRead, Walk, fall_through
from serve.kv.wire import to_wire
from serve.metrics import serve_metrics
from serve.plan import Entry, EntryRow, LoadedKV, LoadResult, Plan, Unreadable

log = logging.getLogger(__name__)

LAZY_REASON = "not compiled yet: its tier is compiled on first promotion"  # the generator compiles it


def store_row(row: EntryRow) -> dict[str, Any]:
    """The index-row fields the store's verified reads take (`Store.load_kv`/`ShardReader.load_many`)."""
    if row.stored is None:  # pending, or compiled and not written back: nothing to read
        raise ValueError("the entry is not in the store")
    return row.stored._asdict()


WireKV = tuple[np.ndarray, DType | KVQuant]  # an entry as it sits in host memory and crosses to the generator


def loaded(found: dict[str, WireKV], entry: Entry) -> LoadedKV:
    array, dtype = found[entry.key]
    return LoadedKV(array=array, dtype=dtype, entry=entry)


class HostTier:
    """The host-memory tier: a byte-capped LRU of wire-form entries (serve/kv/lru.py). Thread-safe: Serve runs the
    loader's sync methods on a thread pool."""

    origin = KVOrigin.HOST

    def __init__(self, max_nbytes: int):
        self.lru: ByteLRU[WireKV] = ByteLRU(max_nbytes, lambda item: item[0].nbytes)
        self._lock = threading.Lock()

    def get_many(self, entries: Sequence[Entry]) -> TierRead[WireKV]:
        with self._lock:
            found = {entry.key: item for entry in entries if (item := self.lru.get(entry.key)) is not None}
        return TierRead(found)

    def put_many(self, values: Mapping[str, WireKV]) -> None:
        with self._lock:
            for key, value in values.items():
                self.lru.put(key, value)

    def clear(self) -> None:
        with self._lock:
            self.lru.clear()

    def stats(self) -> CacheStats:
        with self._lock:
            return self.lru.stats()


class StoreTier:
    """The store's shards: one batched, checksummed read (each entry alone when the batch hits a bad shard, to
    isolate it). A corrupt entry, or a pending one of a lazily compiled tier, is `failed`: the generator rebuilds
    it (serve/engine/repair.py)."""

    origin = KVOrigin.STORE

    def __init__(self, shards: ShardReader):
        self.shards = shards
        self.metrics = serve_metrics()

    def get_many(self, entries: Sequence[Entry]) -> TierRead[WireKV]:
        read: TierRead[WireKV] = TierRead(failed={e.key: LAZY_REASON for e in entries if is_pending(e)})
        stored = [e for e in entries if e.key not in read.failed]
        read.found = {key: to_wire(tensor) for key, tensor in self._read(stored, read.failed).items()}
        return read

    def put_many(self, values: Mapping[str, WireKV]) -> None:
        """Nothing: the store is written by ingest and write-back, never by a read."""

    def _read(self, entries: list[Entry], failed: dict[str, str]) -> dict[str, torch.Tensor | QuantizedKV]:
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
                failed[entry.key] = public_reason(e)  # a response quotes it: the code, not the shard's path
                log.warning("KV entry %s unreadable: %s", entry.key, e)
                self.metrics.corrupt_shards.inc()
        return out


class CacheLoader:
    def __init__(self, config: LoaderConfig):
        self.config = config
        self.host = HostTier(config.max_nbytes)
        self.tiers: tuple[KVTier[WireKV], ...] = (self.host, StoreTier(ShardReader.open(config.store)))
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
        walk = self._fetch([e for e in entries if e is not None], report)
        backups = [c.fallback for c in plan.chunks
                   if c.entry is not None and c.entry.key in walk.failed and c.fallback]
        low = self._fetch(backups, report)
        found, failed, origins = walk.found | low.found, walk.failed, walk.origins | low.origins
        kvs: list[LoadedKV | None] = []
        sources: list[KVOrigin | None] = []
        unreadable: list[Unreadable] = []
        for position, chunk in enumerate(plan.chunks):
            served = chunk.entry
            if chunk.entry is not None and chunk.entry.key in failed:
                backup = chunk.fallback if chunk.fallback is not None and chunk.fallback.key in found else None
                unreadable.append(Unreadable(position=position, entry=chunk.entry, reason=failed[chunk.entry.key],
                                             backup=backup and loaded(found, backup)))
                served = backup
            kvs.append(None if chunk.entry is None or chunk.entry.key in failed else loaded(found, chunk.entry))
            sources.append(None if served is None else origins[served.key])
        load_ms = (time.perf_counter() - started) * 1e3
        return LoadResult(kvs=tuple(kvs), fallbacks=tuple(plan.fallbacks), cache=report, load_ms=load_ms,
                          unreadable=tuple(unreadable), sources=tuple(sources))

    def _fetch(self, entries: list[Entry], report: CacheReport) -> Walk[WireKV]:
        """`entries` through the host tier, then the store (what it reads kept in the host tier), counted in
        `report`: a host hit is a hit, anything else a miss; bytes read from the store."""
        walk = fall_through(self.tiers, entries)
        hits = sum(origin is KVOrigin.HOST for origin in walk.origins.values())
        report.hits += hits
        report.misses += len({e.key for e in entries}) - hits
        report.nbytes_from_store += sum(walk.found[key][0].nbytes for key, origin in walk.origins.items()
                                        if origin is KVOrigin.STORE)
        return walk

    def clear(self) -> None:
        """Empty the host cache: every entry's next load reads the store (a cold measurement, `qvpic eval`)."""
        self.host.clear()

    def stats(self) -> CacheStats:
        return self.host.stats()

    def close(self) -> None:
        """Stop renewing this loader's lease and drop it (an in-process loader's owner calls it when done)."""
        self.keeper.close()

    def __del__(self) -> None:  # Serve calls it on graceful shutdown: drop this replica's lease
        if hasattr(self, "keeper"):
            self.close()
