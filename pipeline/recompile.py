"""Rebuild a store for a new model, template, renderer or tier set — serving the old until the new is done.

The chunks table already holds every chunk's text (and page image path), so nothing is re-read or
re-chunked: the entries the new manifest needs but the store lacks are rendered and compiled, then the
new manifest is published in one atomic write, and only then are stale index rows and orphaned shards
removed. A crash before the publish leaves the old manifest — and everything it points at — intact.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

import ray.data

from pipeline.compile import ENTRIES, ERROR
from pipeline.generations import publish_generation
from pipeline.ingest import CompileResources, compile_missing, entry_slots, new_manifest
from pipeline.store import Store
from schemas.config import ModelSpec, RenderSpec, Variant
from schemas.store import Manifest, StoreSpec


@dataclass(frozen=True)
class RecompileConfig:
    store: StoreSpec
    model: ModelSpec | None = None  # None: the store's own model (built-in names only)
    render: RenderSpec | None = None  # None: the store's page layout and tiers
    variants: tuple[Variant, ...] | None = None
    resources: CompileResources = CompileResources()
    orphan_grace_s: float = 3600.0  # shards younger than this may belong to a job still running
    job_id: str = field(default_factory=lambda: f"recompile-{uuid.uuid4().hex[:12]}")


@dataclass
class RecompileSummary:
    job_id: str
    old_fingerprint: str
    new_fingerprint: str
    num_chunk_texts: int
    num_compiled: int
    num_failed: int
    failures: dict[str, str]
    num_entries_dropped: int
    num_orphans_removed: int
    kv_nbytes_compiled: int
    wall_s: float


def target_manifest(old: Manifest, cfg: RecompileConfig) -> tuple[Manifest, ModelSpec]:
    model = cfg.model or ModelSpec(path=old.model.id, dtype=old.model.dtype)
    fresh = new_manifest(model, cfg.render or old.render, cfg.variants or old.variants, old.embedder,
                         old.embedding_dim, cfg.job_id)
    return fresh.model_copy(update={"created_at": old.created_at, "job_ids": old.job_ids + (cfg.job_id,)}), model


def recompile(cfg: RecompileConfig) -> RecompileSummary:
    started = time.perf_counter()
    store = Store.open(cfg.store)
    old = store.load_manifest_or_raise()
    new, model = target_manifest(old, cfg)
    chunks_table = store.chunks()
    chunks = ray.data.from_arrow(chunks_table.drop_columns(["embedding"]))
    results = compile_missing(chunks, store, new, model, cfg.resources)
    failures = {r["chunk_key"]: r[ERROR] for r in results if r[ERROR]}
    dropped = orphans = 0
    if failures:  # keep serving the old manifest: the new one would point at missing entries
        store.quarantine([{"source": "recompile", "doc_id": None, "reason": e.partition(": ")[0],
                           "detail": f"chunk {k}: {e.partition(': ')[2]}"} for k, e in failures.items()], cfg.job_id)
    else:
        store.write_manifest(new)  # the switch: atomic, and only once every new entry exists
        publish_generation(store, cfg.job_id)  # serving follows; the generations it still serves stay live
        before = store.index().num_rows
        store.compact(keep_fingerprints={new.entry_fingerprint(v, t) for t, v in entry_slots(new, new.variants)})
        dropped = before - store.index().num_rows
        orphans = store.remove_orphans(older_than_s=cfg.orphan_grace_s)
    return RecompileSummary(
        job_id=cfg.job_id, old_fingerprint=old.fingerprint, new_fingerprint=new.fingerprint,
        num_chunk_texts=len(set(chunks_table["chunk_key"].to_pylist())), num_compiled=len(results) - len(failures),
        num_failed=len(failures), failures=failures, num_entries_dropped=dropped, num_orphans_removed=orphans,
        kv_nbytes_compiled=sum(e["nbytes"] for r in results for e in json.loads(r[ENTRIES])),
        wall_s=time.perf_counter() - started,
    )
