"""Serving generations of a store: publish one at the end of a job, find the current one, read the leases
serving replicas hold, and collect what no live generation needs.

`publish_generation` is the last step of every job that changes what a store serves (ingest,
recompile): it snapshots the store's chunks and current entries into a generation (see
schemas/generation.py for the layout), builds the vector index once, and points
`serving/current.json` at it. Replicas follow that pointer (pipeline/store/reload.py).

Garbage collection never takes what a live service may still read: a generation is live while it is
current or named by an unexpired lease (`live_generations`); `protected_shards` are the shards of
live generations, which `Store.remove_orphans` keeps whatever the index says; `collect_generations`
removes records and snapshot files only live generations do not use. A replica writes its lease
before it reads a generation and then re-reads the pointer (`pipeline/store/reload.py`); the publisher moves
the pointer before it reads leases; so a generation is never collected between a replica choosing it
and its lease becoming visible.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from pipeline.store.catalog import CATALOG, COUNTS, ENTRIES, SEARCH
from pipeline.store.catalog import parts_digest, table_parts, write_chunks_dir, write_entries_dir
from pipeline.store.part_record import PartsCheck, compare_parts, describe, read_parts_record, write_parts_record
from pipeline.store.serving_blobs import (
    COMPLETE, STAGING_PREFIX, abs_path, is_complete, publish_dir, read_json, staging_dir, write_json,
)
from pipeline.store.blobs import StoreError
from pipeline.store.store import Store
from schemas.config import Variant
from schemas.generation import (
    CHUNKS_DIR, CURRENT, ENTRIES_DIR, GENERATIONS_DIR, LEASES_DIR, SERVING_DIR, Generation, Lease, SearchInfo,
    SearchSpec, generation_path,
)
from schemas.store import Manifest

STAGING_GRACE_S = 3600.0  # staging dirs older than this were left by a crashed job
_PART_RETRIES = 5


# ---- generations ---------------------------------------------------------------------------------
def current_generation_number(store: Store) -> int | None:
    pointer = read_json(store, CURRENT)
    return None if pointer is None else int(pointer["generation"])


def read_generation(store: Store, generation: int) -> Generation:
    record = read_json(store, generation_path(generation))
    if record is None:
        raise FileNotFoundError(f"store {store.uri} has no serving generation {generation}")
    return Generation.model_validate(record)


def current_generation(store: Store) -> Generation | None:
    number = current_generation_number(store)
    return None if number is None else read_generation(store, number)


def list_generations(store: Store) -> list[int]:
    selector = pafs.FileSelector(abs_path(store, GENERATIONS_DIR), allow_not_found=True)
    return sorted(int(i.base_name[:-5]) for i in store.fs.get_file_info(selector)
                  if i.base_name.endswith(".json") and i.base_name[:-5].isdigit())


def publish_generation(store: Store, job_id: str, spec: SearchSpec = SearchSpec()) -> Generation:
    """Snapshot what `store` serves now into a new generation and make it current; then collect the
    generations no live service needs. Snapshots are streamed from the table parts (memory holds one
    bucket of rows at any store size) and reused while the parts are unchanged, so a recompile rebuilds
    only the entry table, and a rerun that changed nothing rebuilds nothing."""
    manifest = store.load_manifest_or_raise()
    require_recorded_parts(store, "not publishing (the new generation would silently serve less)")
    for attempt in range(_PART_RETRIES):
        try:
            chunks_rel, chunk_counts = _chunks_snapshot(store, manifest, spec)
            entries_rel, entry_counts = _entries_snapshot(store, manifest, chunks_rel)
            break
        except FileNotFoundError:  # a compaction replaced a part while it was read: list the parts again
            if attempt == _PART_RETRIES - 1:
                raise
    search = SearchInfo.model_validate(read_json(store, f"{chunks_rel}/{SEARCH}"))
    number = max([current_generation_number(store) or 0, *list_generations(store)]) + 1
    record = Generation(
        generation=number, manifest=manifest, chunks_dir=chunks_rel, entries_dir=entries_rel,
        num_chunks=chunk_counts["num_chunks"], num_documents=chunk_counts["num_documents"],
        num_entries=entry_counts["num_entries"], search=search, job_id=job_id, published_at=datetime.now(timezone.utc))
    write_json(store, generation_path(number), record.model_dump_json(indent=2))
    write_json(store, CURRENT, json.dumps({"generation": number}))  # the switch
    collect_generations(store)
    return record


def _chunks_snapshot(store: Store, manifest: Manifest, spec: SearchSpec) -> tuple[str, dict]:
    parts = table_parts(store, "chunks")
    salt = f"{manifest.embedder}\n{manifest.embedding_dim}\n{spec.model_dump_json()}"
    rel = f"{CHUNKS_DIR}/{parts_digest(parts, salt)}"

    def write(out: Path) -> dict:
        _, num_chunks, num_documents = write_chunks_dir(store, parts, manifest.embedding_dim, spec, out)
        write_parts_record(store, parts, out)
        return {"num_chunks": num_chunks, "num_documents": num_documents}

    return rel, _snapshot(store, rel, write)


def _entries_snapshot(store: Store, manifest: Manifest, chunks_rel: str) -> tuple[str, dict]:
    parts = table_parts(store, "index")
    slots = [(tier, variant) for variant in Variant for tier in (None, *(t.name for t in manifest.tiers))]
    served = sorted(f"{t} {v.value} {served_fingerprint(manifest, t, v)}" for t, v in slots)
    rel = f"{ENTRIES_DIR}/{parts_digest(parts, chr(10).join([chunks_rel, *served]))}"

    def write(out: Path) -> dict:
        with contextlib.ExitStack() as stack:
            source = stack.enter_context(store.fs.open_input_file(abs_path(store, f"{chunks_rel}/{CATALOG}")))
            catalog = pa.ipc.open_file(source)
            num_entries = write_entries_dir(store, parts, lambda t, v: served_fingerprint(manifest, t, v), catalog, out)
        write_parts_record(store, parts, out)
        return {"num_entries": num_entries}

    return rel, _snapshot(store, rel, write)


def _snapshot(store: Store, rel: str, write: Callable[[Path], dict]) -> dict:
    """Counts of snapshot dir `rel`, written first (into a local staging dir, published whole) unless a
    complete one exists."""
    if not is_complete(store, rel):
        staging = staging_dir(store)
        try:
            counts = write(staging)
            (staging / COUNTS).write_text(json.dumps(counts))
            publish_dir(store, staging, rel)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    counts = read_json(store, f"{rel}/{COUNTS}")
    if counts is None:
        raise FileNotFoundError(f"snapshot {rel} of store {store.uri} has no {COUNTS}")
    return counts


def parts_checks(store: Store) -> list[PartsCheck]:
    """The index and chunk parts now listed against those the current generation was built from: one
    listing per table and two small reads (pipeline/store/part_record.py). Unchecked (generation None) when
    no generation exists or it predates part records."""
    record = current_generation(store)
    checks = []
    for table, rel in (("index", record and record.entries_dir), ("chunks", record and record.chunks_dir)):
        recorded = read_parts_record(store, rel) if rel else None
        listed = [p for p in table_parts(store, table) if p.type == pafs.FileType.File]  # not compacted away meanwhile
        checks.append(compare_parts(table, record.generation if recorded is not None else None, recorded, listed))
    return checks


def require_recorded_parts(store: Store, refusal: str) -> None:
    """Raise `StoreError` naming every missing or changed part (`parts_checks`), with `refusal` and the fix."""
    damaged = [check for check in parts_checks(store) if not check.ok]
    if damaged:  # list once more: a compaction between a listing and its file infos looks like a loss
        damaged = [check for check in parts_checks(store) if not check.ok]
    if damaged:
        raise StoreError(f"store {store.uri}: {describe(damaged)}; {refusal}. Run `qvpic verify --store {store.uri} "
                         "--repair`: it restores lost index rows from the current generation")


def ensure_generation(store: Store, spec: SearchSpec = SearchSpec()) -> int:
    """The current generation, publishing one first when no job has (a store written before generations
    existed, or by a job that does not publish)."""
    number = current_generation_number(store)
    return number if number is not None else publish_generation(store, "serve-bootstrap", spec).generation


def served_fingerprint(manifest: Manifest, tier: str | None, variant) -> str | None:
    """The entry fingerprint `manifest` serves for (tier, variant), or None when it serves no such slot."""
    if variant not in manifest.variants:
        return None
    if tier is not None and tier not in {t.name for t in manifest.tiers}:
        return None
    try:
        return manifest.entry_fingerprint(variant, tier)
    except (KeyError, ValueError):
        return None


# ---- leases and collection ----------------------------------------------------------------------
def read_leases(store: Store) -> list[Lease]:
    selector = pafs.FileSelector(abs_path(store, LEASES_DIR), allow_not_found=True)
    leases = []
    for info in store.fs.get_file_info(selector):
        if info.type != pafs.FileType.File or not info.base_name.endswith(".json"):
            continue
        with contextlib.suppress(FileNotFoundError, ValueError):  # removed or torn meanwhile: not a claim
            with store.fs.open_input_file(info.path) as f:
                leases.append(Lease.model_validate_json(f.read()))
    return leases


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
        with contextlib.suppress(FileNotFoundError):
            record = read_generation(store, number)
            with store.fs.open_input_file(abs_path(store, f"{record.entries_dir}/{ENTRIES}")) as f:
                schema = pa.ipc.open_file(f).schema
                only = pa.ipc.IpcReadOptions(included_fields=[schema.get_field_index("shard_path")])
                reader = pa.ipc.open_file(f, options=only)
                for i in range(reader.num_record_batches):
                    shards.update(pc.unique(reader.get_batch(i)["shard_path"]).to_pylist())
    return shards


def collect_generations(store: Store, now: datetime | None = None, min_dir_age_s: float = STAGING_GRACE_S) -> list[int]:
    """Delete generation records no live service may serve, snapshot dirs no remaining record uses
    (once older than `min_dir_age_s`: a concurrent publisher may not have written its record yet),
    expired leases and stale staging dirs. Returns the generations removed."""
    live = live_generations(store, now)
    removed = []
    for number in list_generations(store):
        if number not in live:
            with contextlib.suppress(FileNotFoundError):
                store.fs.delete_file(abs_path(store, generation_path(number)))
            removed.append(number)
    kept_dirs = set()
    for number in list_generations(store):
        with contextlib.suppress(FileNotFoundError, ValueError):
            record = read_generation(store, number)
            kept_dirs |= {record.chunks_dir, record.entries_dir}
    staging_cutoff_ns = time.time_ns() - int(STAGING_GRACE_S * 1e9)
    dir_cutoff_ns = time.time_ns() - int(min_dir_age_s * 1e9)
    for parent in (CHUNKS_DIR, ENTRIES_DIR, SERVING_DIR):
        selector = pafs.FileSelector(abs_path(store, parent), allow_not_found=True)
        for info in store.fs.get_file_info(selector):
            if info.type != pafs.FileType.Directory:
                continue
            rel = f"{parent}/{info.base_name}"
            if info.base_name.startswith(STAGING_PREFIX):
                if (info.mtime_ns or 0) <= staging_cutoff_ns:
                    store.fs.delete_dir(info.path)
            elif parent != SERVING_DIR and rel not in kept_dirs:
                marker = store.fs.get_file_info(f"{info.path}/{COMPLETE}")
                if marker.type == pafs.FileType.File:
                    if (marker.mtime_ns or 0) <= dir_cutoff_ns:
                        store.fs.delete_dir(info.path)
                elif _newest_mtime_ns(store, info.path) <= staging_cutoff_ns:  # torn: its writer is long gone
                    store.fs.delete_dir(info.path)
    now = now or datetime.now(timezone.utc)
    selector = pafs.FileSelector(abs_path(store, LEASES_DIR), allow_not_found=True)
    for info in store.fs.get_file_info(selector):
        with contextlib.suppress(FileNotFoundError, ValueError):
            with store.fs.open_input_file(info.path) as f:
                lease = Lease.model_validate_json(f.read())
            if not lease.live(now):
                store.fs.delete_file(info.path)
    return removed


def _newest_mtime_ns(store: Store, path: str) -> int:
    files = store.fs.get_file_info(pafs.FileSelector(path, allow_not_found=True, recursive=True))
    return max((f.mtime_ns or 0 for f in files), default=0)


def write_lease(store: Store, lease: Lease) -> None:
    write_json(store, f"{LEASES_DIR}/{lease.holder}.json", lease.model_dump_json())


def drop_lease(store: Store, holder: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        store.fs.delete_file(abs_path(store, f"{LEASES_DIR}/{holder}.json"))
