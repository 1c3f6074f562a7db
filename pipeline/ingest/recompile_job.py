"""Rebuild a store for a new model, template, renderer or tier set — serving the old until the new is done.

The chunks table already holds every chunk's text (and page image path), so nothing is re-read or
re-chunked: the same streaming stages as ingest (dedup by content against the store's entries → render
→ compile) build exactly the entries the new manifest needs and the store lacks. Then the new manifest
is published in one atomic write, and only then are stale index rows and orphaned shards removed. A
crash before the publish leaves the old manifest — and everything it points at — intact.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import ray.data
from pydantic import Field

from pipeline.ingest.ingest_job import compile_kv, in_a_task, render, work_blocks
from pipeline.ingest.manifest import new_manifest
from pipeline.ingest.resources import JobResources, StagePlan, plan_stages
from pipeline.ingest.rows import Kind, conform_rows, of_kind
from pipeline.ingest.shuffle import read_parts
from pipeline.ingest.stages import CompilePlan, deduplicate, stored_entries
from pipeline.store import Store, StoreLease, entry_slots, hmac_key, publish_generation, remove_orphans
from schemas.config import KVQuant, ModelSpec
from schemas.corpus import ReaderSpec
from schemas.modes import Variant
from schemas.render import RenderSpec
from schemas.store import ORPHAN_GRACE_S, ImagesRoot, Manifest, StoreSpec

MAX_LISTED_FAILURES = 100  # in the summary; every failure is in the quarantine table
_TALLY = pa.schema([("units", pa.int64()), ("compiled", pa.int64()), ("nbytes", pa.int64()),
                    ("failures_json", pa.string())])


class RecompileConfig(JobResources):
    store: StoreSpec
    model: ModelSpec | None = None  # None: the store's own model (built-in names only)
    render: RenderSpec | None = None  # None: the store's page layout and tiers
    variants: tuple[Variant, ...] | None = None
    orphan_grace_s: float = Field(ORPHAN_GRACE_S, ge=0)  # shards younger than this may belong to a job still running
    job_id: str = Field(default_factory=lambda: f"recompile-{uuid.uuid4().hex[:12]}")
    kv_quant: KVQuant | None = None  # None: the store's own KV format; another one rebuilds every entry
    images_root: ImagesRoot | None = None  # the store's scanned pages are read only under it (None: not at all)
    hmac_key_file: Path | None = None  # seal the published generation (unset: QVPIC_HMAC_KEY, else no seal)


@dataclass
class RecompileSummary:
    job_id: str
    old_fingerprint: str
    new_fingerprint: str
    num_chunk_texts: int
    num_compiled: int
    num_failed: int
    failures: dict[str, str]  # chunk key -> error, the first MAX_LISTED_FAILURES
    num_entries_dropped: int
    num_orphans_removed: int
    kv_nbytes_compiled: int
    wall_s: float


def target_manifest(old: Manifest, cfg: RecompileConfig) -> tuple[Manifest, ModelSpec]:
    model = cfg.model or ModelSpec(path=old.model.id, dtype=old.model.dtype)
    fresh = new_manifest(model, cfg.render or old.render, cfg.variants or old.variants, old.embedder,
                         old.embedding_dim, cfg.job_id,
                         kv_quant=old.kv_quant if cfg.kv_quant is None else cfg.kv_quant,
                         ablation_tiers=old.ablation_tiers)
    above_lowest = {t.name for t in fresh.tiers} - {fresh.render.lowest_tier.name}
    lazy_tiers = tuple(t for t in old.lazy_tiers if t in above_lowest)  # a lazy store stays lazy
    return fresh.model_copy(update={"created_at": old.created_at, "job_ids": old.job_ids + (cfg.job_id,),
                                    "lazy_tiers": lazy_tiers}), model


def _chunk_rows(batch: pa.Table) -> pa.Table:
    columns = {name: batch[name] for name in batch.column_names}
    kinds = pa.array([Kind.CHUNK.value] * batch.num_rows, pa.string())
    return conform_rows(pa.table({**columns, "kind": kinds, "key": batch["chunk_key"]}))


def stored_chunks(store: Store, plan: StagePlan) -> ray.data.Dataset:
    """Every stored chunk occurrence as a CHUNK row: the sources of the entries to rebuild."""
    columns = ["chunk_id", "doc_id", "order", "chunk_key", "text", "num_text_tokens", "source", "image_path"]
    ds = read_parts(store, "chunks", columns, plan)
    if ds is None:
        return ray.data.from_arrow(conform_rows(pa.table({"kind": pa.array([], pa.string())})))
    return ds.map_batches(_chunk_rows, batch_format="pyarrow", num_cpus=plan.task_cpus)


class Tally:
    """Compiled units of one batch → failures quarantined, one tally row."""

    def __init__(self, store: StoreSpec, job_id: str, stamp_ns: int):
        self.spec, self.job_id, self.stamp_ns = store, job_id, stamp_ns

    def __call__(self, batch: pa.Table) -> pa.Table:
        units = of_kind(batch, Kind.UNIT).select(["chunk_key", "error", "entries_json"]).to_pylist()
        failures = {u["chunk_key"]: u["error"] for u in units if u["error"]}
        if failures:
            token = hashlib.sha256("\n".join([self.job_id, *sorted(failures)]).encode()).hexdigest()[:16]
            Store.open(self.spec).quarantine(
                [{"source": "recompile", "doc_id": None, "reason": e.partition(": ")[0],
                  "detail": f"chunk {k}: {e.partition(': ')[2]}"} for k, e in failures.items()],
                self.job_id, self.stamp_ns, token)
        entries = [e for u in units if not u["error"] for e in json.loads(u["entries_json"] or "[]")]
        return pa.Table.from_pylist([{
            "units": len(units),
            "compiled": sum(bool(json.loads(u["entries_json"] or "[]")) for u in units if not u["error"]),
            "nbytes": sum(e["nbytes"] for e in entries), "failures_json": json.dumps(failures)}], schema=_TALLY)


def _tally(batch: pa.Table, tally: Tally) -> pa.Table:
    return tally(batch)


def finish(spec: StoreSpec, job_id: str, new: Manifest | None, orphan_grace_s: float,
           key: bytes | None) -> tuple[int, int]:
    """Switch to `new` (None: a failed job, which only compacts what it appended), publish the generation
    serving follows (the generations it still serves stay live), drop stale rows and collect orphan
    shards. Returns (index rows dropped, shards removed)."""
    store = Store.open(spec)
    if new is None:
        store.compact()
        return 0, 0
    store.write_manifest(new)  # the switch: atomic, and only once every new entry exists
    publish_generation(store, job_id, hmac_key=key)
    before = store.index().num_rows
    store.compact(keep_fingerprints={new.entry_fingerprint(v, t)
                                      for t, v in entry_slots(new, new.variants, include_lazy=True)})
    return before - store.index().num_rows, remove_orphans(store, older_than_s=orphan_grace_s)


def recompile(cfg: RecompileConfig) -> RecompileSummary:
    started, stamp_ns = time.perf_counter(), time.time_ns()
    seal_key = hmac_key(cfg.hmac_key_file)  # an unreadable or short key fails here, before any work
    store = Store.open(cfg.store)
    plan = plan_stages(cfg.resources, cfg.resource_wait_s, stages=("render",))  # or a clear refusal
    plan.apply(cfg.stall_timeout_s)
    with StoreLease(store.blobs, cfg.job_id):
        old = store.load_manifest_or_raise()
        new, model = target_manifest(old, cfg)
        slots = entry_slots(new, new.variants)
        compile_plan = CompilePlan(model, store.spec, new.to_json(), cfg.resources.batch_size, stamp_ns, cfg.job_id)

        rows = stored_chunks(store, plan)
        existing = stored_entries(store, new, slots, plan)
        rows = deduplicate(rows, [existing] if existing is not None else [], slots, ReaderSpec(), plan)
        work, rest = work_blocks(rows, cfg.resources.batch_size, plan, needs=("slots_json",))
        # of the rest, the tally counts the units (with nothing to rebuild); the chunk rows it does not count
        rows = rest.map_batches(of_kind, fn_args=(Kind.UNIT,), batch_format="pyarrow", num_cpus=plan.task_cpus)
        if work is not None:
            rendered = render(work, new, plan, cfg.resources.batch_size, cfg.images_root)
            rows = compile_kv(rendered, compile_plan, plan).union(rows)
        tallies = rows.map_batches(_tally, fn_kwargs={"tally": Tally(store.spec, cfg.job_id, stamp_ns)},
                                   batch_format="pyarrow", batch_size=256, num_cpus=plan.task_cpus)
        units = compiled = nbytes = num_failed = 0
        failures: dict[str, str] = {}
        for table in tallies.iter_batches(batch_size=None, batch_format="pyarrow"):
            for row in table.to_pylist():
                units, compiled, nbytes = units + row["units"], compiled + row["compiled"], nbytes + row["nbytes"]
                batch_failures = json.loads(row["failures_json"])
                num_failed += len(batch_failures)
                failures.update(list(batch_failures.items())[:max(0, MAX_LISTED_FAILURES - len(failures))])
        switch = not num_failed  # else keep serving the old manifest: the new one would point at missing entries
        dropped, orphans = in_a_task(finish, plan, store.spec, cfg.job_id, new if switch else None, cfg.orphan_grace_s,
                                     seal_key)
    return RecompileSummary(
        job_id=cfg.job_id, old_fingerprint=old.fingerprint, new_fingerprint=new.fingerprint, num_chunk_texts=units,
        num_compiled=compiled, num_failed=num_failed, failures=failures, num_entries_dropped=dropped,
        num_orphans_removed=orphans, kv_nbytes_compiled=nbytes, wall_s=time.perf_counter() - started,
    )
