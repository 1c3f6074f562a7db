"""Garbage collection: what no live serving generation needs, and what crashed writers left.

A generation is live while it is current or named by an unexpired serving lease (`live_generations`).
`protected_shards` are the shards of live generations: `remove_orphans` keeps them whatever the index
says, so a recompile never deletes a shard a running replica still serves. `collect_generations`
removes records and snapshot dirs only dead generations use, expired leases and stale staging dirs.

Why collection cannot take a generation a replica is about to serve: a replica writes its lease before
it reads a generation and then re-reads the pointer (pipeline/store/reload.py); the publisher moves the
pointer before it reads leases (pipeline/store/publish.py); so a generation is never collected between
a replica choosing it and its lease becoming visible.
"""

from __future__ import annotations

import time
from datetime import datetime

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from pipeline.store.blobs import TMP_PREFIX
from pipeline.store.catalog import ENTRIES
from pipeline.store.generations import current_generation_number, list_generations, read_generation
from pipeline.store.leases import drop_expired_leases, read_leases
from pipeline.store.snapshots import COMPLETE
from pipeline.store.store import Store
from schemas.generation import CHUNKS_DIR, ENTRIES_DIR, SERVING_DIR, generation_path, seal_path
from schemas.store import ORPHAN_GRACE_S

STAGING_GRACE_S = 3600.0  # staging dirs older than this were left by a crashed job


def live_generations(store: Store, now: datetime | None = None) -> set[int]:
    """The current generation and every generation an unexpired lease names."""
    live = {g for lease in read_leases(store) if lease.live(now) for g in lease.generations}
    current = current_generation_number(store)
    return live | ({current} if current is not None else set())


def protected_shards(store: Store) -> set[str]:
    """Shard paths (relative to the store root) that some live generation's entries point at; the
    entry tables are read one record batch and one column at a time."""
    shards: set[str] = set()
    for number in live_generations(store):
        try:
            record = read_generation(store, number)
            with store.blobs.open_input(f"{record.entries_dir}/{ENTRIES}") as f:
                schema = pa.ipc.open_file(f).schema
                only = pa.ipc.IpcReadOptions(included_fields=[schema.get_field_index("shard_path")])
                reader = pa.ipc.open_file(f, options=only)
                for i in range(reader.num_record_batches):
                    shards.update(pc.unique(reader.get_batch(i)["shard_path"]).to_pylist())
        except FileNotFoundError:
            continue
    return shards


def remove_orphans(store: Store, older_than_s: float = ORPHAN_GRACE_S) -> int:
    """Delete shards no index row references, and temp files left by crashed writes, that are older than
    `older_than_s` (a grace period for jobs between writing a shard and publishing its rows). Rows hidden
    by a newer duplicate still protect their shard until compaction drops them, and shards of a live
    serving generation are never removed. Returns the number of files deleted."""
    referenced = store.tables["index"].distinct("shard_path")  # streamed: a part and a column at a time
    referenced |= protected_shards(store)  # what a live service may still read
    cutoff_ns = time.time_ns() - int(older_than_s * 1e9)
    removed = 0
    for info in store.blobs.list("", recursive=True):
        rel = store.blobs.rel(info.path)
        is_temp = info.base_name.startswith(TMP_PREFIX)
        is_orphan = rel.startswith("shards/") and rel not in referenced
        if (is_temp or is_orphan) and (info.mtime_ns or 0) <= cutoff_ns:
            store.blobs.delete(rel)
            removed += 1
    return removed


def collect_generations(store: Store, now: datetime | None = None, min_dir_age_s: float = STAGING_GRACE_S) -> list[int]:
    """Delete generation records no live service may serve, snapshot dirs no remaining record uses
    (once older than `min_dir_age_s`: a concurrent publisher may not have written its record yet),
    expired leases and stale staging dirs. Returns the generations removed."""
    live = live_generations(store, now)
    removed = [number for number in list_generations(store) if number not in live]
    for number in removed:
        store.blobs.delete(generation_path(number))
        if store.blobs.exists([seal_path(number)])[0]:
            store.blobs.delete(seal_path(number))
    kept_dirs = set()
    for number in list_generations(store):
        try:
            record = read_generation(store, number)
        except (FileNotFoundError, ValueError):
            continue
        kept_dirs |= {record.chunks_dir, record.entries_dir}
    staging_cutoff_ns = time.time_ns() - int(STAGING_GRACE_S * 1e9)
    dir_cutoff_ns = time.time_ns() - int(min_dir_age_s * 1e9)
    for parent in (CHUNKS_DIR, ENTRIES_DIR, SERVING_DIR):
        for info in store.blobs.dirs(parent):
            rel = f"{parent}/{info.base_name}"
            if info.base_name.startswith(TMP_PREFIX):
                if (info.mtime_ns or 0) <= staging_cutoff_ns:
                    store.blobs.delete_dir(rel)
            elif parent != SERVING_DIR and rel not in kept_dirs:
                (marker,) = store.blobs.stat([f"{rel}/{COMPLETE}"])
                if marker.type == pafs.FileType.File:
                    if (marker.mtime_ns or 0) <= dir_cutoff_ns:
                        store.blobs.delete_dir(rel)
                elif _newest_mtime_ns(store, rel) <= staging_cutoff_ns:  # torn: its writer is long gone
                    store.blobs.delete_dir(rel)
    drop_expired_leases(store, now)
    return removed


def _newest_mtime_ns(store: Store, rel: str) -> int:
    return max((f.mtime_ns or 0 for f in store.blobs.list(rel, recursive=True)), default=0)
