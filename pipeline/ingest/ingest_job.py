"""The ingestion job: one streaming Ray Data pipeline, read → chunk → dedup → render → embed → compile → write.

Stages overlap and Ray Data back-pressures between them; nothing is materialised on the driver, which
only adds up one small tally per partition of the last stage. Whole-corpus checks (duplicate ids,
repeated texts, what the store already holds) are hash-partitioned shuffles (pipeline/ingest/stages/dedup.py). The
job holds the store's write lease throughout (pipeline/store/leases.py), sizes its resource requests to what
the cluster has free (pipeline/ingest/resources.py), and ends by compacting what it appended.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any, Callable, TypeVar

import pyarrow as pa
import ray.data
from pydantic import Field, field_validator
from ray.data import ActorPoolStrategy

from pipeline.ingest.corpus import RemoteFiles, corpus_location, discover
from pipeline.ingest.manifest import target_manifest
from pipeline.ingest.record import run_key, skipped_summary, unchanged_since, write_record
from pipeline.ingest.resources import JobResources, StagePlan, plan_stages
from pipeline.ingest.rows import Kind, needing_work, not_needing_work, rows_table
from pipeline.ingest.stages import (
    ChunkStage,
    CompilePlan,
    CompileStage,
    EmbedStage,
    RenderStage,
    check_ids,
    deduplicate,
    read_files,
    rejected_row,
    stored_embeddings,
    stored_entries,
    write_documents,
)
from pipeline.ingest.summary import IngestSummary
from pipeline.store import Store, StoreLease, current_generation_number, entry_slots, hmac_key, publish_generation
from schemas.config import KVQuant, ModelSpec
from schemas.corpus import ReaderSpec
from schemas.modes import AblationTiers, Variant
from schemas.render import RenderSpec
from schemas.store import Manifest, StoreSpec

T = TypeVar("T")

class IngestConfig(JobResources):
    corpus: str
    store: StoreSpec
    model: ModelSpec = ModelSpec()
    render: RenderSpec = RenderSpec()
    chunk_tokens: int = Field(512, ge=16)
    variants: tuple[Variant, ...] = tuple(Variant)  # every mode servable side by side (`qvpic ingest --variants`)
    embedder_dir: str | None = None
    reader: ReaderSpec = ReaderSpec()
    job_id: str = Field(default_factory=lambda: f"ingest-{uuid.uuid4().hex[:12]}")
    kv_quant: KVQuant | None = None  # how entries are stored; None: the store's own (none for a new store)
    lazy_high_tier: bool = False  # compile the highest tier on first promotion, not here (`--lazy-high-tier`)
    # the ablation variants at the lowest tier (lean) or every tier (`--ablation-tiers`; `qvpic eval --paper`).
    # A store once widened stays so: its manifest keeps the wider choice.
    ablation_tiers: AblationTiers = AblationTiers.LOWEST
    legibility: bool = False  # OCR every image entry's pages into its index row (`--legibility`)
    force: bool = False  # run the pipeline even when the corpus and the store are unchanged since the last job
    # seal the published generation with this key (pipeline/store/seal.py); unset: QVPIC_HMAC_KEY, else no seal
    hmac_key_file: Path | None = None

    @property
    def corpus_location(self) -> StoreSpec | None:  # an s3:// corpus (None: a local path)
        return corpus_location(self.corpus, self.store)

    @field_validator("variants")
    @classmethod
    def _serves_template(cls, variants: tuple[Variant, ...]) -> tuple[Variant, ...]:
        if Variant.TEMPLATE not in variants:
            raise ValueError("the template variant (what qvpic serves) must be compiled")
        return variants


def open_store(cfg: IngestConfig) -> tuple[Store, Manifest]:
    """Open (or start) the store and write its manifest for this job (callers without a lease: tests, benchmarks)."""
    store = Store.open(cfg.store, create=True)
    manifest = target_manifest(store, cfg)
    store.write_manifest(manifest)
    return store, manifest


# ---- the stages, each sized by the plan ---------------------------------------------------------------
def read(corpus: str, location: StoreSpec | None, reader: ReaderSpec, plan: StagePlan) -> ray.data.Dataset:
    """Corpus files → documents, rejections and per-file record counts; names that cannot be files are refused.
    `location`: the corpus is on an object store there (each read task opens its objects itself)."""
    files, refused = discover(corpus) if location is None else RemoteFiles(location).discover()
    table = pa.table({"path": [f.path for f in files], "root": [f.root for f in files],
                      "relpath": [f.relpath for f in files]},
                     schema=pa.schema([("path", pa.string()), ("root", pa.string()), ("relpath", pa.string())]))
    per_block = max(1, -(-table.num_rows // 256))  # ≤ 256 blocks however many files; one read call per file
    blocks = [table.slice(i, per_block) for i in range(0, table.num_rows, per_block)] or [table]
    rows = ray.data.from_arrow(blocks).map_batches(read_files, fn_kwargs={"reader": reader, "location": location},
                                                   batch_size=1, batch_format="pyarrow", num_cpus=plan.task_cpus)
    if refused:
        counted = [{"kind": Kind.FILE.value, "key": "", "source": r.source, "count": 1} for r in refused]
        rows = rows.union(ray.data.from_arrow(rows_table([rejected_row(r) for r in refused] + counted)))
    return rows


def chunk(rows: ray.data.Dataset, cfg: IngestConfig, plan: StagePlan) -> ray.data.Dataset:
    return rows.map_batches(ChunkStage, fn_constructor_kwargs={"model": cfg.model, "chunk_tokens": cfg.chunk_tokens},
                            batch_format="pyarrow", batch_size=64, num_cpus=plan.chunk_cpus,
                            compute=ActorPoolStrategy(min_size=1, max_size=plan.pool_max))


def work_blocks(rows: ray.data.Dataset, batch_size: int, plan: StagePlan,
                needs: tuple[str, ...]) -> tuple[ray.data.Dataset | None, ray.data.Dataset]:
    """(the dedup's units that some model stage has work for, cut into small blocks — None when there are
    none —, every other row of its output).

    Small blocks (streaming, no shuffle) let render, embed and compile overlap batch by batch instead of
    waiting on a shuffle partition each. The rows that only pass through to the write (a document's marker,
    a rejection, a unit whose entries and embedding are all stored: `needs` names the columns that ask the
    job's stages for work) skip those stages, which leave them as they are: riding along in the same small
    blocks, the 100k duplicate documents of tests/e2e/test_hostile_corpus.py made ~3,000 blocks per stage,
    ~580 s of task overhead for one compiled chunk. With no work at all, no model actor starts (a forced
    rerun, a recompile with nothing to rebuild: ~20 s of actor start-up and model loads each on 2 cores).
    The dedup ends in a shuffle, a barrier already, so materializing its output costs no overlap."""
    rows = rows.materialize()
    units = rows.map_batches(needing_work, fn_args=(needs,), batch_format="pyarrow",
                             num_cpus=plan.task_cpus).materialize()
    rest = rows.map_batches(not_needing_work, fn_args=(needs,), batch_format="pyarrow", num_cpus=plan.task_cpus)
    if units.count() == 0:
        return None, rest
    return units.repartition(target_num_rows_per_block=rows_per_batch(batch_size)), rest


def rows_per_batch(batch_size: int) -> int:
    # Batches also carry rows that pass through (documents' markers); compile runs `batch_size` per forward.
    return 4 * batch_size


def corpus_images_root(corpus: str, location: StoreSpec | None = None) -> str | None:
    """Where this corpus's page images lie: the root the readers confined them to (a file's folder); None on
    an object store (remote.py rejects its page images)."""
    if location is not None:
        return None
    return os.path.abspath(corpus if os.path.isdir(corpus) else os.path.dirname(os.path.abspath(corpus)))


def render(rows: ray.data.Dataset, manifest: Manifest, plan: StagePlan, batch_size: int,
           images_root: str | None) -> ray.data.Dataset:
    return rows.map_batches(RenderStage, fn_constructor_kwargs={"render": manifest.render, "images_root": images_root},
                            batch_format="pyarrow", batch_size=rows_per_batch(batch_size), num_cpus=plan.render_cpus,
                            compute=ActorPoolStrategy(min_size=1, max_size=plan.pool_max))


def embed(rows: ray.data.Dataset, embedder_dir: str | None, plan: StagePlan, batch_size: int) -> ray.data.Dataset:
    return rows.map_batches(EmbedStage, fn_constructor_kwargs={"model_dir": embedder_dir, "preload": True},
                            batch_format="pyarrow",
                            batch_size=rows_per_batch(batch_size), num_cpus=plan.embed_cpus,
                            compute=ActorPoolStrategy(min_size=1, max_size=plan.pool_max))


def compile_kv(rows: ray.data.Dataset, compile_plan: CompilePlan, plan: StagePlan) -> ray.data.Dataset:
    # Ray Data restarts a dead compile actor and retries its batch (its defaults: max_restarts=-1,
    # max_task_retries=-1; there are no named parameters for them in Ray 2.60 and `**ray_remote_args`
    # is deprecated). A retried batch rewrites the same shards and index part. GPU actors: all
    # `compile_workers` start at once and each takes one batch at a time, since a pool that grows from one
    # actor, or queues several batches on the first actor ready, leaves GPU nodes idle on a small corpus.
    # CPU actors keep Ray Data's growing pool with batches queued per actor: they share the CPUs of the
    # stages around them, and pipelining is what keeps those busy.
    gpus = plan.compile_gpus or None
    pool = ActorPoolStrategy(min_size=plan.compile_workers, max_size=plan.compile_workers,
                             max_tasks_in_flight_per_actor=1) if gpus else \
        ActorPoolStrategy(min_size=1, max_size=plan.compile_workers)
    return rows.map_batches(CompileStage, fn_constructor_kwargs={"plan": compile_plan, "preload": True},
                            batch_format="pyarrow",
                            batch_size=rows_per_batch(compile_plan.batch_size), num_cpus=plan.compile_cpus,
                            num_gpus=gpus, compute=pool)


def in_a_task(fn: Callable[..., T], plan: StagePlan, *args: Any) -> T:
    """`fn(*args)` in a Ray task. The steps that end a job read whole tables (the chunk table holds ~1.6 KB
    of embedding a chunk: ~0.8 GiB of peak memory for 100k chunks in compaction and publish), so they
    run on a worker; the driver, which may share the head node with the Serve controller, stays flat."""
    return ray.get(ray.remote(fn).options(num_cpus=plan.task_cpus).remote(*args))


def finish(spec: StoreSpec, job_id: str, key: bytes | None) -> None:
    """Compact what the job appended, then publish the generation serving switches to (catalog, entries,
    vector index; sealed with `key`). Both are idempotent: a retried task redoes them."""
    store = Store.open(spec)
    store.compact()
    publish_generation(store, job_id, hmac_key=key)


def unchanged(cfg: IngestConfig) -> tuple[str, IngestSummary | None]:
    """(this run's key, the no-op summary when the store holds this corpus read this way and has not
    changed since; None when the pipeline must run). Needs no Ray: a no-op rerun never starts one."""
    started = time.perf_counter()
    store = Store.open(cfg.store, create=True)
    key = run_key(cfg.corpus, cfg.corpus_location, cfg.reader, cfg.chunk_tokens, cfg.variants,
                  target_manifest(store, cfg), {"legibility": cfg.legibility})
    record = None if cfg.force else unchanged_since(store, key, current_generation_number(store))
    if record is None:
        return key, None
    summary = skipped_summary(cfg.job_id, record)
    summary.wall_s = time.perf_counter() - started
    return key, summary


def ingest(cfg: IngestConfig, key: str | None = None) -> IngestSummary:
    """Run the job (`key`: what `unchanged(cfg)` returned, when the caller asked it first)."""
    started, stamp_ns = time.perf_counter(), time.time_ns()
    seal_key = hmac_key(cfg.hmac_key_file)  # an unreadable or short key fails here, before any work
    if key is None:
        key, skipped = unchanged(cfg)
        if skipped is not None:
            return skipped
    store = Store.open(cfg.store, create=True)
    plan = plan_stages(cfg.resources, cfg.resource_wait_s)  # or a clear refusal, before any write
    plan.apply(cfg.stall_timeout_s)
    with StoreLease(store.blobs, cfg.job_id):
        manifest = target_manifest(store, cfg)
        store.write_manifest(manifest)
        slots = entry_slots(manifest, manifest.variants)
        compile_plan = CompilePlan(cfg.model, store.spec, manifest.to_json(), cfg.resources.batch_size, stamp_ns,
                                   cfg.job_id, cfg.legibility)

        rows = read(cfg.corpus, cfg.corpus_location, cfg.reader, plan)
        rows = check_ids(rows, plan)
        rows = chunk(rows, cfg, plan)
        stored = [ds for ds in (stored_entries(store, manifest, slots, plan), stored_embeddings(store, plan)) if ds]
        rows = deduplicate(rows, stored, slots, cfg.reader, plan)  # one unit per distinct chunk text
        units, rest = work_blocks(rows, cfg.resources.batch_size, plan, needs=("slots_json", "needs_embedding"))
        rows = rest
        if units is not None:
            images_root = corpus_images_root(cfg.corpus, cfg.corpus_location)
            units = render(units, manifest, plan, cfg.resources.batch_size, images_root)
            units = embed(units, cfg.embedder_dir, plan, cfg.resources.batch_size)
            rows = compile_kv(units, compile_plan, plan).union(rest)
        tallies = write_documents(rows, store, cfg.job_id, stamp_ns, plan)  # whole docs, or quarantined

        summary = IngestSummary.from_tallies(cfg.job_id, tallies.iter_batches(batch_size=None, batch_format="pyarrow"))
        in_a_task(finish, plan, store.spec, cfg.job_id, seal_key)
        generation = current_generation_number(store)
        if generation is not None:  # under the lease: nothing else published in between
            write_record(store, key, summary, generation)
    summary.wall_s = time.perf_counter() - started
    return summary

