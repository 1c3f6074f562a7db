"""Rebuilding KV entries the loader could not read, and a lazily compiled tier's pending ones.

An entry the loader could not read (missing or corrupt shard) is rebuilt before assembly, the way ingest
built it: the chunk's stored source text (or page image), rendered with the store's RenderSpec and
compiled by this replica's model — the same bytes on the same hardware. Only when that is impossible (a
page image this replica cannot read) does the request take the loader's lower-tier backup, reported as
a fallback, or fail with 503. Each outcome is counted in `qvpic_kv_recompiles`. A pending entry of a
lazily compiled tier takes the same path, through serve/kv/lazy_tier.py: compiled once, written back.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import pyarrow.compute as pc
import torch

from pipeline.runtime import VLM, ChunkKV, Renderer, off_loop
from pipeline.store import Store, build_sized_entry, stored
from schemas.errors import UnservableError, public_reason
from schemas.report import FallbackReport
from schemas.store import Manifest
from serve.kv import LazyTier, is_pending, to_wire
from serve.metrics import serve_metrics
from serve.plan import Entry, LoadedKV, LoadResult, Plan, PlannedChunk

log = logging.getLogger(__name__)

# What means "this entry cannot be rebuilt here", so the backup is served (or the request is a 503): a source this
# replica cannot compile (UnservableError, RenderError, PageImageError: ValueErrors), or no room on the device for
# the compile. Anything else (a TypeError, ...) is a fault in qvpic and escapes: served as a fallback it would hide
# a path that never works behind reports that look like bad shards.
NOT_REBUILT = (ValueError, torch.OutOfMemoryError)


class Repairer:
    def __init__(self, store: Store, manifest: Manifest, vlm: VLM, renderer: Renderer, model_lock: threading.Lock,
                 images_root: str | None):
        self.store = store  # its chunk table is read only to rebuild an unreadable entry
        self.vlm, self.renderer = vlm, renderer
        self.images_root = images_root  # a scanned page outside it is refused: the entry is not rebuilt
        self.model_lock = model_lock  # the engine's: a compile runs between its steps
        self.kv_quant = manifest.kv_quant  # a rebuilt entry is stored as the store's own are
        self.metrics = serve_metrics()
        self.lazy = LazyTier(store, manifest, self.compile_entry)  # a lazily compiled tier's entries

    async def repaired(self, plan: Plan, loaded: LoadResult) -> LoadResult:
        """`repair`, off the event loop when there is anything to rebuild."""
        return loaded if not loaded.unreadable else await off_loop(self.repair, plan, loaded)

    def repair(self, plan: Plan, loaded: LoadResult) -> LoadResult:
        """`loaded` with every unreadable entry rebuilt (its time added to `load_ms`), or replaced by its
        lower-tier backup and reported as a fallback; `UnservableError` when an entry has neither."""
        if not loaded.unreadable:
            return loaded
        started = time.perf_counter()
        kvs, fallbacks, unservable = list(loaded.kvs), list(loaded.fallbacks), []
        for item in loaded.unreadable:
            chunk = plan.chunks[item.position]
            try:
                tensor, entry, outcome = (self.lazy.promote(chunk, item.entry) if is_pending(item.entry)  # lazy tier
                                          else (self.recompile(chunk, item.entry).kv, item.entry, "recompiled"))
                # as the store keeps it; the KV was compiled on the model's device, and to_wire brings it to the host
                array, dtype = to_wire(stored(tensor, self.kv_quant))
            except NOT_REBUILT as error:
                log.warning("chunk %s: KV entry not rebuilt: %s", chunk.chunk_id, error)  # with its path, if any
                error = public_reason(error)  # what a response may say: no host path
                outcome = "unservable" if item.backup is None else "backup"
                self.metrics.kv_recompiles.inc(outcome=outcome)
                if item.backup is None:
                    unservable.append(f"{chunk.chunk_id}: {item.reason}; not rebuilt: {error}")
                    continue
                kvs[item.position] = item.backup
                fallbacks.append(FallbackReport(chunk_id=chunk.chunk_id, requested_tier=item.entry.tier or "-",
                                                served_tier=item.backup.entry.tier or "-",
                                                reason=f"{item.reason}; not rebuilt: {error}"))
                continue
            self.metrics.kv_recompiles.inc(outcome=outcome)
            kvs[item.position] = LoadedKV(array=array, dtype=dtype, entry=entry)  # exact: no fallback to report
        if unservable:
            raise UnservableError(f"KV entries unreadable and not rebuildable here: {unservable[:5]}")
        load_ms = loaded.load_ms + (time.perf_counter() - started) * 1e3
        return dataclasses.replace(loaded, kvs=tuple(kvs), fallbacks=tuple(fallbacks), unreadable=(), load_ms=load_ms)

    def recompile(self, chunk: PlannedChunk, entry: Entry) -> ChunkKV:
        return self.compile_entry(chunk, entry)[0]

    def compile_entry(self, chunk: PlannedChunk, entry: Entry) -> tuple[ChunkKV, list[list[int]]]:
        """`entry` compiled (again) as ingest compiles it, and its pages' sizes: the text of the first chunk
        (by id) with its content key, which is the one ingest compiled, rendered at the entry's tier."""
        table = self.store.chunks()
        rows = table.filter(pc.equal(table["chunk_key"], entry.cache_key.chunk_key))
        if rows.num_rows == 0:
            raise UnservableError(f"chunk {chunk.chunk_id} has no source text in the store")
        source = min(rows.select(["chunk_id", "text", "image_path"]).to_pylist(), key=lambda r: r["chunk_id"])
        with self.model_lock:  # between engine steps
            return build_sized_entry(self.vlm, self.renderer, source["text"], source["image_path"], entry.tier,
                                     entry.variant, images_root=self.images_root)
