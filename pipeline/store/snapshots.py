"""The snapshot dirs a serving generation reads: its chunks dir and entries dir (layout:
pipeline/store/catalog/reader.py), built from the store's table parts, and local copies of them.

A snapshot dir is named by a digest of the parts it was built from (and of what else shapes it), so
it is immutable and shared by every generation built from the same parts: a recompile rebuilds only
the entries dir, a rerun that changed nothing rebuilds nothing. It is built in a local staging dir and
put whole (`Blobs.put_dir`) with its `COMPLETE` marker last: a dir without the marker is being written,
or was torn.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import pyarrow as pa

from pipeline.store.blobs import TMP_PREFIX, install_dir
from pipeline.store.catalog import CATALOG, COUNTS, TEXTS, parts_digest, write_chunks_dir, write_entries_dir
from pipeline.store.parts import write_parts_record
from pipeline.store.store import Store
from schemas.generation import CHUNKS_DIR, ENTRIES_DIR, SERVING_DIR, SearchSpec
from schemas.modes import Variant
from schemas.store import Manifest

COMPLETE = "complete.json"  # written last into a snapshot dir: a dir without it is being written (or was torn)


def is_complete(store: Store, rel: str) -> bool:
    return store.blobs.exists([f"{rel}/{COMPLETE}"])[0]


def chunks_snapshot(store: Store, manifest: Manifest, spec: SearchSpec) -> tuple[str, dict]:
    """(rel, counts) of the chunks dir of the chunk table now, written first unless it exists."""
    log = store.tables["chunks"]
    parts = log.parts()
    salt = f"{manifest.embedder}\n{manifest.embedding_dim}\n{spec.model_dump_json()}"
    rel = f"{CHUNKS_DIR}/{parts_digest(parts, salt)}"

    def write(out: Path) -> dict:
        _, num_chunks, num_documents, collections = write_chunks_dir(store, parts, manifest.embedding_dim, spec,
                                                                     out)
        write_parts_record(log, parts, out)
        return {"num_chunks": num_chunks, "num_documents": num_documents, "collections": collections}

    return rel, _snapshot(store, rel, write)


def entries_snapshot(store: Store, manifest: Manifest, chunks_rel: str) -> tuple[str, dict]:
    """(rel, counts) of the entries dir of the index now under `manifest`, for chunks dir `chunks_rel`."""
    log = store.tables["index"]
    parts = log.parts()
    slots = [(tier, variant) for variant in Variant for tier in (None, *(t.name for t in manifest.tiers))]
    served = sorted(f"{t} {v.value} {served_fingerprint(manifest, t, v)}" for t, v in slots)
    rel = f"{ENTRIES_DIR}/{parts_digest(parts, chr(10).join([chunks_rel, *served]))}"

    def write(out: Path) -> dict:
        with store.blobs.open_input(f"{chunks_rel}/{CATALOG}") as source:
            catalog = pa.ipc.open_file(source)
            num_entries = write_entries_dir(store, parts, lambda t, v: served_fingerprint(manifest, t, v), catalog, out)
        write_parts_record(log, parts, out)
        return {"num_entries": num_entries}

    return rel, _snapshot(store, rel, write)


def _snapshot(store: Store, rel: str, write: Callable[[Path], dict]) -> dict:
    """Counts of snapshot dir `rel`, written first (into a local staging dir, put whole) unless a
    complete one exists."""
    if not is_complete(store, rel):
        staging = store.blobs.staging_dir(SERVING_DIR)
        try:
            counts = write(staging)
            (staging / COUNTS).write_text(json.dumps(counts))
            (staging / COMPLETE).write_text(json.dumps({"completed_at": datetime.now(timezone.utc).isoformat()}))
            store.blobs.put_dir(staging, rel, last=COMPLETE)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    counts = store.blobs.get_json(f"{rel}/{COUNTS}")
    if counts is None:
        raise FileNotFoundError(f"snapshot {rel} of store {store.uri} has no {COUNTS}")
    return counts


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


def local_copy(store: Store, rel: str, cache_root: Path) -> Path:
    """A local directory holding snapshot dir `rel` (itself for a local store; else downloaded once into
    `cache_root`, keyed by the content-addressed name, so it never goes stale). texts.arrow is not
    downloaded: it is read by range."""
    in_place = store.blobs.local_path(rel)
    if in_place is not None:
        return in_place
    target = cache_root / rel
    if (target / COMPLETE).exists():
        return target
    cache_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=cache_root))
    try:
        store.blobs.get_dir(rel, staging, skip=frozenset({TEXTS, COMPLETE}))
        (staging / COMPLETE).write_text("{}")
        install_dir(staging, target, COMPLETE)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
