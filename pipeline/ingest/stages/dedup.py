"""Distributed dedup stages: whole-corpus checks as hash-partitioned shuffles, never sets in the driver.

`check_ids` partitions documents by id: the first in source order keeps it, the others are rejected.
`dedup` partitions by content key (chunk_key for chunks, the whole-text key for documents;
a scanned page is one chunk, so its two keys are equal): documents repeating an earlier one's text
are marked duplicates, near-duplicate page images rejected, and every distinct chunk text becomes one
UNIT — carrying all its occurrences, and joined with what the store already holds for that key (its
entries, its embedding), so only what is missing gets rendered, embedded and compiled.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray.data

from pipeline.ingest.corpus import DocRef, near_duplicate_images
from pipeline.ingest.resources import StagePlan
from pipeline.ingest.rows import Kind, conform_rows, not_of_kind, of_kind, require_columns, rows_table
from pipeline.ingest.shuffle import read_parts, shuffle
from pipeline.store import Store, slot_name
from schemas.corpus import ReaderSpec, RejectReason
from schemas.modes import Variant
from schemas.store import CacheKey, Manifest

NEEDS = ("kind", "key", "doc_id", "source", "order_key", "text_key", "image_phash", "image_path", "chunk_id",
         "chunk_key", "text", "order", "num_text_tokens", "collection", "slot", "embedding")
ADDS = ("duplicate", "occurrences", "slots_json", "needs_embedding", "error")


def first_per_id(batch: pa.Table) -> pa.Table:
    """One partition: of the documents sharing an id, the first in source order stays; the rest are rejected."""
    require_columns(batch, NEEDS, "dedup")
    docs = of_kind(batch, Kind.DOC)
    if docs.num_rows < 2:
        return batch
    docs = docs.take(pc.sort_indices(docs, [("doc_id", "ascending"), ("order_key", "ascending")]))
    ids = np.asarray(docs["doc_id"].to_pylist(), dtype=object)
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    first = starts[np.searchsorted(starts, np.arange(len(ids)), side="right") - 1]
    repeated = np.arange(len(ids)) != first
    if not repeated.any():
        return batch
    sources = docs["source"].to_pylist()
    rejected = [{"kind": Kind.REJECTED.value, "key": ids[i], "doc_id": ids[i], "source": sources[i],
                 "reason": RejectReason.DUPLICATE_ID.value, "detail": f"doc_id already used at {sources[first[i]]}"}
                for i in np.flatnonzero(repeated)]
    kept = docs.filter(pa.array(~repeated))
    return pa.concat_tables([not_of_kind(batch, Kind.DOC), kept, rows_table(rejected)])


def check_ids(rows: ray.data.Dataset, plan: StagePlan) -> ray.data.Dataset:
    return shuffle(rows, plan).map_batches(first_per_id, batch_size=None, batch_format="pyarrow",
                                           num_cpus=plan.task_cpus)


class ContentUnits:
    """One partition keyed by content: markers → (duplicate?) markers keyed by doc id, chunk occurrences
    plus stored rows → one UNIT per chunk key that still needs work or occurs in this corpus."""

    def __init__(self, slots: Sequence[tuple[str | None, Variant]], reader: ReaderSpec):
        self.slots = [(tier, Variant(variant)) for tier, variant in slots]
        self.reader = reader

    def __call__(self, batch: pa.Table) -> pa.Table:
        require_columns(batch, NEEDS, "dedup")
        markers, rejected, dropped_docs = self.markers(of_kind(batch, Kind.MARKER))
        present: dict[str, set[str]] = defaultdict(set)
        entries = of_kind(batch, Kind.STORED_ENTRY)
        for key, slot in zip(entries["key"].to_pylist(), entries["slot"].to_pylist()):
            present[key].add(slot)
        stored = of_kind(batch, Kind.STORED_CHUNK)
        embedding_row = {key: i for i, key in enumerate(stored["key"].to_pylist())}
        occurrences: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for row in of_kind(batch, Kind.CHUNK).drop_columns(["embedding", "occurrences", "pages"]).to_pylist():
            if row["doc_id"] not in dropped_docs:
                occurrences[row["chunk_key"]].append(row)
        units, stored_at = [], []
        for key, occ in occurrences.items():
            occ.sort(key=lambda r: r["chunk_id"])
            rep = occ[0]  # deterministic: the repair path picks the same text (first chunk id with this key)
            missing = [(t, v.value) for t, v in self.slots if slot_name(t, v) not in present[key]]
            units.append({
                "kind": Kind.UNIT.value, "key": key, "chunk_key": key, "text": rep["text"],
                "image_path": rep["image_path"],
                "occurrences": [{f: r[f] for f in ("chunk_id", "doc_id", "order", "text", "num_text_tokens", "source",
                                                   "image_path", "collection")} for r in occ],
                "slots_json": json.dumps(missing), "needs_embedding": key not in embedding_row, "error": ""})
            stored_at.append(embedding_row.get(key))
        units_table = rows_table(units)
        if stored.num_rows and units:
            embeddings = stored["embedding"].take(pa.array(stored_at, pa.int64()))
            units_table = units_table.set_column(units_table.schema.get_field_index("embedding"), "embedding",
                                                 embeddings)
        passed = not_of_kind(batch, Kind.MARKER, Kind.CHUNK, Kind.STORED_ENTRY, Kind.STORED_CHUNK)
        return pa.concat_tables([passed, units_table, rows_table(markers + rejected)])

    def markers(self, table: pa.Table) -> tuple[list[dict], list[dict], set[str]]:
        """(markers keyed by doc id with `duplicate` set, near-duplicate image rejections, their doc ids)."""
        groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for row in table.select(["key", "doc_id", "source", "order_key", "text_key", "image_phash",
                                 "image_path"]).to_pylist():
            groups[row["key"]].append(row)
        markers, rejected, dropped = [], [], set()
        for group in groups.values():
            refs = [DocRef(source=r["source"], doc_id=r["doc_id"], text_key=r["text_key"], image_phash=r["image_phash"])
                    for r in group]
            for rejection in near_duplicate_images(refs, self.reader):
                dropped.add(rejection.doc_id)
                rejected.append({"kind": Kind.REJECTED.value, "key": rejection.doc_id, "doc_id": rejection.doc_id,
                                 "source": rejection.source, "reason": rejection.reason.value,
                                 "detail": rejection.detail})
            kept = sorted((r for r in group if r["doc_id"] not in dropped), key=lambda r: r["order_key"])
            markers += [{"kind": Kind.MARKER.value, "key": r["doc_id"], "doc_id": r["doc_id"], "source": r["source"],
                         "duplicate": i > 0} for i, r in enumerate(kept)]
        return markers, rejected, dropped


def deduplicate(rows: ray.data.Dataset, stored: list[ray.data.Dataset], slots: Sequence[tuple[str | None, Variant]],
                  reader: ReaderSpec, plan: StagePlan) -> ray.data.Dataset:
    for extra in stored:
        rows = rows.union(extra)
    return shuffle(rows, plan).map_batches(_content_units, fn_kwargs={"units": ContentUnits(slots, reader)},
                                           batch_size=None, batch_format="pyarrow", num_cpus=plan.task_cpus)


def _content_units(batch: pa.Table, units: ContentUnits) -> pa.Table:
    return units(batch)


# ---- what the store already holds, as pipeline rows ----------------------------------------------------
def _entry_rows(batch: pa.Table, required: list[str]) -> pa.Table:
    tier = pc.fill_null(batch["tier"], CacheKey.NO_TIER)
    slot = pc.binary_join_element_wise(tier, batch["variant"], "/")
    keyed = pc.binary_join_element_wise(slot, batch["fingerprint"], "/")
    batch = batch.filter(pc.is_in(keyed, value_set=pa.array(required, pa.string())))
    slot = pc.binary_join_element_wise(pc.fill_null(batch["tier"], CacheKey.NO_TIER), batch["variant"], "/")
    return conform_rows(pa.table({"kind": pa.array([Kind.STORED_ENTRY.value] * batch.num_rows, pa.string()),
                                  "key": batch["chunk_key"], "slot": slot}))


def stored_entries(store: Store, manifest: Manifest, slots: Sequence[tuple[str | None, Variant]],
                   plan: StagePlan) -> ray.data.Dataset | None:
    """The store's entries of the slots this job needs, under the manifest's fingerprints."""
    required = [f"{slot_name(t, v)}/{manifest.entry_fingerprint(v, t)}" for t, v in slots]
    ds = read_parts(store, "index", ["chunk_key", "tier", "variant", "fingerprint"], plan)
    return None if ds is None else ds.map_batches(_entry_rows, fn_kwargs={"required": required},
                                                  batch_format="pyarrow", num_cpus=plan.task_cpus)


def _embedding_rows(batch: pa.Table) -> pa.Table:
    kinds = pa.array([Kind.STORED_CHUNK.value] * batch.num_rows, pa.string())
    return conform_rows(pa.table({"kind": kinds, "key": batch["chunk_key"], "embedding": batch["embedding"]}))


def stored_embeddings(store: Store, plan: StagePlan) -> ray.data.Dataset | None:
    """One row per stored chunk row: its key and embedding (the embedder is the store's)."""
    ds = read_parts(store, "chunks", ["chunk_key", "embedding"], plan)
    return None if ds is None else ds.map_batches(_embedding_rows, batch_format="pyarrow", num_cpus=plan.task_cpus)
