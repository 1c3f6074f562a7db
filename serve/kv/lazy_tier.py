"""The lazily compiled tier, generator side: a pending entry compiled once, written back once.

A request that promotes a chunk whose tier the store compiles lazily (serve/kv/pending.py) gets the entry
here, in order of preference: written back already (by this replica or another: one small read, see
pipeline/store/writeback.py), or compiled now by the generator's model through `build_sized_entry` — the one
function that builds an entry, so it is what ingest would have stored — and written back. Concurrent
requests for one entry share one compile (`SingleFlight`); the generator's hot tier then serves it to
the requests that follow, and the next published generation lets every router plan it as stored.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from pipeline.runtime import ChunkKV
from pipeline.store import ShardCorruptError, Store, write_back, written_back
from schemas.store import CacheKey, Manifest
from serve.plan import Entry, PlannedChunk, entry_of

log = logging.getLogger(__name__)
T = TypeVar("T")


class SingleFlight(Generic[T]):
    """`run(key, fn)`: while one call for `key` runs, later calls wait for it and share its result or
    error instead of running `fn` again. Thread-safe (the generator compiles on worker threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[str, Future] = {}

    def run(self, key: str, fn: Callable[[], T]) -> tuple[T, bool]:
        """(`fn`'s result, whether this call ran it)."""
        with self._lock:
            call = self._calls.get(key)
            leader = call is None
            if leader:
                call = self._calls[key] = Future()
        if not leader:
            return call.result(), False
        try:
            result = fn()
            call.set_result(result)
            return result, True
        except BaseException as error:
            call.set_exception(error)
            raise
        finally:
            with self._lock:
                del self._calls[key]


@dataclass
class LazyStats:
    compiled: int = 0  # entries this replica compiled (each written back once)
    from_store: int = 0  # pending entries found written back (by this replica or another)
    shared: int = 0  # requests that waited on another request's compile instead of compiling
    write_failures: int = 0  # compiled and served, but not written back (read-only store, ...)


Compile = Callable[[PlannedChunk, Entry], tuple[ChunkKV, list[list[int]]]]


class LazyTier:
    def __init__(self, store: Store, manifest: Manifest, compile_entry: Compile):
        self.store, self.manifest, self.compile_entry = store, manifest, compile_entry
        self.flights: SingleFlight[tuple[torch.Tensor, Entry, str]] = SingleFlight()
        self.stats = LazyStats()
        self._lock = threading.Lock()

    def promote(self, chunk: PlannedChunk, pending: Entry) -> tuple[torch.Tensor, Entry, str]:
        """(KV [layers, 2, kv_heads, tokens, head_dim], the stored entry, how it was obtained: "lazy_stored"
        or "lazy_compiled") of a pending entry. Raises what `compile_entry` raises (a ValueError when
        the chunk's source cannot be rebuilt here)."""
        result, ran = self.flights.run(pending.key, lambda: self._obtain(chunk, pending))
        if not ran:
            with self._lock:
                self.stats.shared += 1
        return result

    def _obtain(self, chunk: PlannedChunk, pending: Entry) -> tuple[torch.Tensor, Entry, str]:
        key = CacheKey.parse(pending.key)
        row = written_back(self.store, key)
        if row is not None:
            try:
                kv = self.store.load_kv(row)
            except ShardCorruptError as error:  # torn or lost since: compile it again, and write it over
                log.warning("written-back %s is unreadable (%s); compiling it again", pending.key, error)
                self.store.blobs.delete(row["shard_path"])  # shards are content-named: a rewrite would keep it
            else:
                with self._lock:
                    self.stats.from_store += 1
                return kv, entry_of(row), "lazy_stored"
        kv, sizes_px = self.compile_entry(chunk, pending)
        with self._lock:
            self.stats.compiled += 1
        try:
            row = write_back(self.store, self.manifest, key, kv, sizes_px)
        except OSError as error:  # served all the same; the next promotion in a fresh replica compiles again
            with self._lock:
                self.stats.write_failures += 1
            log.warning("could not write back %s: %s", pending.key, error)
            return kv.kv, self._entry(pending, kv, sizes_px), "lazy_compiled"
        return kv.kv, entry_of(row), "lazy_compiled"

    @staticmethod
    def _entry(pending: Entry, kv: ChunkKV, sizes_px: list[list[int]]) -> Entry:
        """The entry as compiled (its counts, not the router's estimate), for a KV that was not written back."""
        row = pending.row._replace(compile_start=kv.compile_start, grid_thw=tuple(map(tuple, kv.grid_thw)),
                                   image_sizes_px=tuple(map(tuple, sizes_px)), pending=False)
        return dataclasses.replace(pending, num_tokens=kv.num_tokens, vision_tokens=kv.vision_tokens,
                                   position_span=kv.position_span, row=row)
