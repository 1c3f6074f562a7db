"""Publishing a serving generation: the last step of every job that changes what a store serves
(ingest, recompile, `qvpic publish`).

`publish_generation` checks that no table part the current generation was built from is lost
(pipeline/store/parts.py), snapshots the store's chunks and current entries (pipeline/store/snapshots.py:
streamed from the parts, reused while they are unchanged), builds the vector index once, writes the
generation record and points `serving/current.json` at it (pipeline/store/generations.py); replicas
follow that pointer (pipeline/store/reload.py). It then collects what no live generation needs
(pipeline/store/gc.py).
"""

from __future__ import annotations

from datetime import datetime, timezone

from pipeline.store.catalog import SEARCH
from pipeline.store.gc import collect_generations
from pipeline.store.generations import current_generation_number, list_generations, write_generation
from pipeline.store.parts import require_recorded_parts
from pipeline.store.snapshots import chunks_snapshot, entries_snapshot
from pipeline.store.store import Store
from schemas.generation import Generation, SearchInfo, SearchSpec

_PART_RETRIES = 5


def publish_generation(store: Store, job_id: str, spec: SearchSpec = SearchSpec(),
                       hmac_key: bytes | None = None) -> Generation:
    """Snapshot what `store` serves now into a new generation and make it current; then collect the
    generations no live service needs. Snapshots are streamed from the table parts (memory holds one
    bucket of rows at any store size) and reused while the parts are unchanged, so a recompile rebuilds
    only the entry table, and a rerun that changed nothing rebuilds nothing. With `hmac_key` the generation
    is sealed (pipeline/store/seal.py) before serving is pointed at it."""
    manifest = store.load_manifest_or_raise()
    require_recorded_parts(store, "not publishing (the new generation would silently serve less)")
    for attempt in range(_PART_RETRIES):
        try:
            chunks_rel, chunk_counts = chunks_snapshot(store, manifest, spec)
            entries_rel, entry_counts = entries_snapshot(store, manifest, chunks_rel)
            break
        except FileNotFoundError:  # a compaction replaced a part while it was read: list the parts again
            if attempt == _PART_RETRIES - 1:
                raise
    search = SearchInfo.model_validate(store.blobs.get_json(f"{chunks_rel}/{SEARCH}"))
    number = max([current_generation_number(store) or 0, *list_generations(store)]) + 1
    record = Generation(
        generation=number, manifest=manifest, chunks_dir=chunks_rel, entries_dir=entries_rel,
        num_chunks=chunk_counts["num_chunks"], num_documents=chunk_counts["num_documents"],
        num_entries=entry_counts["num_entries"], search=search, job_id=job_id, published_at=datetime.now(timezone.utc),
        collections=chunk_counts.get("collections", {}))  # a chunks dir from before collections: none recorded
    write_generation(store, record, hmac_key)
    collect_generations(store)
    return record


def ensure_generation(store: Store, spec: SearchSpec = SearchSpec()) -> int:
    """The current generation, publishing one first when no job has (a store written before generations
    existed, or by a job that does not publish)."""
    number = current_generation_number(store)
    return number if number is not None else publish_generation(store, "serve-bootstrap", spec).generation
