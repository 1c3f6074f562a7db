"""The ingestion graph on Ray Data: read → chunk → dedup → render → embed → compile → write → publish.

Small per-document facts (ids, content hashes) are gathered on the driver for the global checks
(duplicate ids, duplicate texts, what the store already holds); texts, pages and KV stay in Ray.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections import Counter
from collections.abc import Container
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pyarrow as pa
import ray
import ray.data
from ray.data import ActorPoolStrategy
from ray.data.expressions import col

from pipeline.chunker import Chunker
from pipeline.compile import (
    ENTRIES, ERROR, IMAGE_PATH, SLOTS, CompilePlan, CompileStage, RenderStage, slots_json,
)
from pipeline.duplicates import DocRef, cross_file_rejections
from pipeline.embed import Embedder
from pipeline.generations import publish_generation
from pipeline.readers import discover, read_file
from pipeline.runtime.model import model_identity, resolve_path
from pipeline.store import Store
from pipeline.summary import IngestSummary
from schemas.config import ModelSpec, RenderSpec, Variant
from schemas.corpus import Document, ReaderSpec, Rejection
from schemas.store import CacheKey, Manifest, StoredModel, StoreSpec


@dataclass(frozen=True)
class CompileResources:
    """The compile actor pool: one VLM per actor; GPUs per actor 0 = CPU."""

    workers: int = 1
    gpus_per_worker: float = 0.0
    cpus_per_worker: float = 1.0

    def __post_init__(self) -> None:
        if self.workers < 1 or self.gpus_per_worker < 0 or self.cpus_per_worker <= 0:
            raise ValueError("workers >= 1, gpus_per_worker >= 0 and cpus_per_worker > 0 are required")


@dataclass(frozen=True)
class IngestConfig:
    corpus: str
    store: StoreSpec
    model: ModelSpec = ModelSpec()
    render: RenderSpec = RenderSpec()
    chunk_tokens: int = 512
    variants: tuple[Variant, ...] = tuple(Variant)  # every mode servable side by side (`qvpic ingest --variants`)
    resources: CompileResources = CompileResources()
    embedder_dir: str | None = None
    reader: ReaderSpec = ReaderSpec()
    job_id: str = field(default_factory=lambda: f"ingest-{uuid.uuid4().hex[:12]}")

    def __post_init__(self) -> None:
        if self.chunk_tokens < 16:
            raise ValueError(f"chunk_tokens must be >= 16, got {self.chunk_tokens}")
        if Variant.TEMPLATE not in self.variants:
            raise ValueError("the template variant (what qvpic serves) must be compiled")


class ReadStage:
    """One corpus file → its documents and rejections, as flat rows."""

    def __init__(self, reader: ReaderSpec):
        self.reader = reader

    def __call__(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        for record in read_file(row["path"], row["root"], self.reader):
            if isinstance(record, Document):
                ref = DocRef.of(record)
                out.append({"kind": "doc", **record.to_row(), "text_key": ref.text_key,
                            "image_phash": ref.image_phash or "", "reason": "", "detail": ""})
            else:
                out.append({"kind": "rejection", "doc_id": record.doc_id or "", "text": "", "source": record.source,
                            "metadata_json": "{}", "text_key": "", "image_phash": "",
                            "reason": record.reason.value, "detail": record.detail})
        return out


class ChunkStage:
    """One document → its chunks, bounded by the VLM tokenizer's token count."""

    def __init__(self, model: ModelSpec, chunk_tokens: int):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resolve_path(model), local_files_only=True)

        # Repeated documents (and repeated pieces) are counted once: a corpus of 10^5 copies of one
        # text would otherwise spend minutes in the tokenizer. Bounded: pieces are at most a few KB.
        @functools.lru_cache(maxsize=4096)
        def count_tokens(text: str) -> int:
            return len(tokenizer(text, add_special_tokens=False).input_ids)

        self.chunker = Chunker(count_tokens, chunk_tokens)

    def __call__(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        doc = Document.from_row(row)
        # A page image is one chunk whatever its length: its pixels are what gets compiled.
        pieces = self.chunker.chunk(doc)
        if doc.image_path and pieces:
            pieces = [pieces[0].build(doc.doc_id, 0, doc.text, sum(p.num_text_tokens for p in pieces))]
        return [{**c.model_dump(), "source": doc.source, IMAGE_PATH: doc.image_path or ""} for c in pieces]


def new_manifest(model: ModelSpec, render: RenderSpec, variants: tuple[Variant, ...], embedder_name: str,
                 embedding_dim: int, job_id: str) -> Manifest:
    model_id, revision, family, template_prefix = model_identity(model)
    now = datetime.now(timezone.utc)
    return Manifest.create(
        StoredModel(id=model_id, revision=revision, dtype=model.dtype, family=family), template_prefix,
        render=render, variants=variants, embedder=embedder_name, embedding_dim=embedding_dim,
        created_at=now, updated_at=now, job_ids=(job_id,),
    )


def open_store(cfg: IngestConfig) -> tuple[Store, Manifest]:
    """Open (or start) the store; refuse one compiled for another model, page layout or embedder."""
    embedder = Embedder(cfg.embedder_dir)  # its name and width go into the manifest
    store = Store.open(cfg.store, create=True)
    manifest = store.read_manifest()
    fresh = new_manifest(cfg.model, cfg.render, cfg.variants, embedder.model_name, embedder.dim, cfg.job_id)
    if manifest is None:
        manifest = fresh
    else:
        manifest.check_model(fresh.model.id, fresh.model.revision, fresh.model.dtype, fresh.template_prefix)
        if manifest.render != cfg.render:
            raise ValueError("the store was rendered with another page layout or tiers: run `qvpic recompile`")
        if manifest.embedder != embedder.model_name:
            raise ValueError(f"the store's chunks were embedded with {manifest.embedder}, not {embedder.model_name}")
        manifest = manifest.model_copy(update={
            "variants": tuple(dict.fromkeys(manifest.variants + cfg.variants)), "updated_at": fresh.updated_at,
            "job_ids": manifest.job_ids + (cfg.job_id,)})
    store.write_manifest(manifest)
    return store, manifest


def entry_slots(manifest: Manifest, variants: tuple[Variant, ...]) -> list[tuple[str | None, Variant]]:
    """(tier, variant) of every KV entry a chunk needs: templated pages at every tier, the baselines'
    pages (plain, dummy prefix) at the lowest, each text variant once."""
    slots: list[tuple[str | None, Variant]] = []
    lowest = manifest.render.lowest_tier.name
    for variant in variants:
        tiers = {Variant.TEXT: [None], Variant.TEXT_PLAIN: [None], Variant.PLAIN: [lowest], Variant.DUMMY: [lowest]}.get(
            variant, [t.name for t in manifest.tiers])
        slots += [(tier, variant) for tier in tiers]
    return slots


def required_keys(manifest: Manifest, chunk_key_: str, variants: tuple[Variant, ...]) -> list[CacheKey]:
    return [CacheKey(chunk_key_, tier, variant, manifest.entry_fingerprint(variant, tier))
            for tier, variant in entry_slots(manifest, variants)]


def compile_missing(chunks: ray.data.Dataset, store: Store, manifest: Manifest, model: ModelSpec,
                    resources: CompileResources) -> list[dict]:
    """Render and compile every distinct chunk text that lacks an entry; returns per-chunk results."""
    keys = chunks.select_columns(["chunk_id", "chunk_key"]).take_all()
    first_id: dict[str, str] = {}
    for row in sorted(keys, key=lambda r: r["chunk_id"]):
        first_id.setdefault(row["chunk_key"], row["chunk_id"])
    needed = {k: required_keys(manifest, k, manifest.variants) for k in first_id}
    present = store.has_entries({key for ks in needed.values() for key in ks})
    # Only the missing slots are compiled: a renderer change leaves text entries alone, a crash
    # resumes where it stopped.
    missing = {first_id[k]: slots_json((key.tier, key.variant) for key in ks if key not in present)
               for k, ks in needed.items() if not set(ks) <= present}
    if not missing:
        return []
    plan = CompilePlan(model, store.spec, manifest.to_json())
    todo = chunks.filter(expr=col("chunk_id").is_in(list(missing)))
    todo = todo.map(lambda row: {**row, SLOTS: missing[row["chunk_id"]]})
    rendered = todo.map(RenderStage, fn_constructor_kwargs={"render": manifest.render},
                        compute=ActorPoolStrategy(min_size=1, max_size=resources.workers), num_cpus=0.5)
    compiled = rendered.map_batches(
        CompileStage, fn_constructor_kwargs={"plan": plan}, batch_size=4, batch_format="numpy",
        compute=ActorPoolStrategy(size=resources.workers), num_gpus=resources.gpus_per_worker,
        num_cpus=resources.cpus_per_worker, max_restarts=2, max_task_retries=2,
    )
    return compiled.take_all()


def failed_documents(chunks: ray.data.Dataset, failed: dict[str, str]) -> dict[str, tuple[str, str]]:
    """(source, error) of every document with a chunk that failed to render or compile."""
    if not failed:
        return {}
    rows = chunks.filter(expr=col("chunk_key").is_in(list(failed))).select_columns(["doc_id", "source", "chunk_key"])
    out: dict[str, tuple[str, str]] = {}
    for row in rows.take_all():
        out.setdefault(row["doc_id"], (row["source"], failed[row["chunk_key"]]))
    return out


def chunk_rows(batch: dict[str, np.ndarray], failed_docs: Container[str], unchanged: Container[tuple]) -> pa.Table:
    """A batch of embedded chunks as chunk-table rows, less failed documents and rows already stored.
    Embeddings travel as one float32 buffer: as Python floats they cost ~10x their bytes on the driver."""
    keep = np.array([doc_id not in failed_docs and key not in unchanged for doc_id, key in zip(
        batch["doc_id"], zip(batch["chunk_id"], batch["chunk_key"], batch["source"]))], dtype=bool)
    columns = {name: pa.array(batch[name][keep].tolist())
               for name in ("chunk_id", "doc_id", "order", "chunk_key", "text", "num_text_tokens", "source")}
    columns[IMAGE_PATH] = pa.array([path or None for path in batch[IMAGE_PATH][keep].tolist()], pa.string())
    embeddings = np.ascontiguousarray(batch["embedding"][keep], dtype=np.float32)  # [rows, dim]
    columns["embedding"] = pa.FixedSizeListArray.from_arrays(pa.array(embeddings.reshape(-1)), embeddings.shape[1])
    return pa.table(columns)


@dataclass
class ReadResult:
    docs: ray.data.Dataset  # documents that passed every per-file and cross-file check
    refs: list[DocRef]  # every document read, rejected or not
    rejected: list[Rejection]  # reader refusals and cross-file duplicates
    num_cross_file: int
    duplicate_docs: set[str]  # doc ids whose whole text repeats an earlier document's


def read(cfg: IngestConfig) -> ReadResult:
    """Corpus files → documents and rejections; global checks on the driver over short refs only."""
    files, refused = discover(cfg.corpus)
    records = ray.data.from_items([f.model_dump(mode="json") for f in files],
                                  override_num_blocks=max(1, min(len(files), 64)))
    records = records.flat_map(ReadStage, fn_constructor_kwargs={"reader": cfg.reader},
                               compute=ActorPoolStrategy(min_size=1, max_size=4), num_cpus=0.25).materialize()
    rejected = [Rejection(source=r["source"], doc_id=r["doc_id"] or None, reason=r["reason"], detail=r["detail"])
                for r in records.filter(expr=col("kind") == "rejection").take_all()] + list(refused)
    docs = records.filter(expr=col("kind") == "doc")  # Arrow-native filters: a Python lambda costs ~40 µs a row
    refs = [DocRef(source=r["source"], doc_id=r["doc_id"], text_key=r["text_key"], image_phash=r["image_phash"] or None)
            for r in docs.select_columns(["source", "doc_id", "text_key", "image_phash"]).take_all()]
    cross = cross_file_rejections(refs, cfg.reader)
    dropped = {r.source for r in cross}
    seen_texts: dict[str, str] = {}
    duplicate_docs = set()
    for ref in sorted(refs, key=lambda r: r.source):
        if ref.source not in dropped and seen_texts.setdefault(ref.text_key, ref.source) != ref.source:
            duplicate_docs.add(ref.doc_id)
    kept = docs.filter(expr=col("source").not_in(sorted(dropped))) if dropped else docs
    return ReadResult(kept, refs, rejected + cross, len(cross), duplicate_docs)


def chunk(docs: ray.data.Dataset, cfg: IngestConfig) -> ray.data.Dataset:
    return docs.flat_map(ChunkStage, fn_constructor_kwargs={"model": cfg.model, "chunk_tokens": cfg.chunk_tokens},
                         compute=ActorPoolStrategy(min_size=1, max_size=2), num_cpus=0.25).materialize()


def embed_and_publish(chunks: ray.data.Dataset, store: Store, failed_docs: Container[str],
                      embedder_dir: str | None) -> tuple[int, int]:
    """Embed every chunk and publish the rows of documents whose chunks all compiled, one bounded
    batch at a time (after their KV, so a published chunk is always servable). Returns
    (chunk occurrences, distinct chunk texts)."""
    stored = store.chunks().select(["chunk_id", "chunk_key", "source"]).to_pylist()
    unchanged = {(r["chunk_id"], r["chunk_key"], r["source"]) for r in stored}  # a rerun publishes nothing new
    embedded = chunks.map_batches(Embedder, fn_constructor_kwargs={"model_dir": embedder_dir}, batch_size=256,
                                  compute=ActorPoolStrategy(size=1), num_cpus=0.5)
    num_chunks, chunk_texts = 0, set()
    for batch in embedded.iter_batches(batch_size=4096, batch_format="numpy"):
        num_chunks += len(batch["chunk_id"])
        chunk_texts.update(batch["chunk_key"].tolist())
        store.publish_chunks(chunk_rows(batch, failed_docs, unchanged))
    return num_chunks, len(chunk_texts)


def ingest(cfg: IngestConfig) -> IngestSummary:
    started = time.perf_counter()
    store, manifest = open_store(cfg)
    corpus = read(cfg)
    chunks = chunk(corpus.docs, cfg)
    results = compile_missing(chunks, store, manifest, cfg.model, cfg.resources)  # dedup → render → compile → write
    failed = {r["chunk_key"]: r[ERROR] for r in results if r[ERROR]}
    failed_docs = failed_documents(chunks, failed)
    num_chunks, num_chunk_texts = embed_and_publish(chunks, store, failed_docs, cfg.embedder_dir)

    rejected = corpus.rejected + [Rejection(source=source, doc_id=doc_id, reason=error.partition(": ")[0],
                                            detail=error.partition(": ")[2])
                                  for doc_id, (source, error) in failed_docs.items()]
    store.quarantine([r.model_dump(mode="json") for r in rejected], cfg.job_id)
    publish_generation(store, cfg.job_id)  # what serving switches to: catalog, entries, vector index
    reader_rejections = len(corpus.rejected) - corpus.num_cross_file
    deduplicated = len(corpus.duplicate_docs - set(failed_docs))
    return IngestSummary(
        job_id=cfg.job_id, inputs=len(corpus.refs) + reader_rejections,
        indexed=len(corpus.refs) - corpus.num_cross_file - len(failed_docs) - deduplicated, deduplicated=deduplicated,
        quarantined=dict(Counter(r.reason.value for r in rejected)), num_chunks=num_chunks,
        num_chunk_texts=num_chunk_texts, num_chunks_compiled=len(results) - len(failed),
        entries=[e for r in results for e in json.loads(r[ENTRIES])], wall_s=time.perf_counter() - started,
    )
