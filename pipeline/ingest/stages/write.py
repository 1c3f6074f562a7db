"""The write stage: whole documents published, everything else quarantined, one tally per partition.

Units are exploded back into their chunk occurrences (each with its unit's embedding and outcome) and
shuffled by document id together with the documents' markers, their rejections and the chunk rows the
store already holds for them. A partition then sees every chunk of each of its documents: a document
whose chunks all built is published (only rows that are new or changed), one with a failed chunk is
quarantined whole with that chunk's reason. Parts are named by the job and their rows, so a retried
task rewrites its parts instead of duplicating them. Chunk rows are written after their units' KV
entries (compile runs upstream), so a published chunk is always servable.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray.data

from pipeline.ingest.resources import StagePlan
from pipeline.ingest.rows import Kind, conform_rows, not_of_kind, of_kind, require_columns
from pipeline.ingest.shuffle import read_parts, shuffle
from pipeline.ingest.summary import TALLY_SCHEMA, entry_groups, node_work
from pipeline.store import Store
from schemas.corpus import DEFAULT_COLLECTION
from schemas.store import StoreSpec
from schemas.tables import CHUNKS_SCHEMA

_OCCURRENCE_FIELDS = ("chunk_id", "doc_id", "order", "text", "num_text_tokens", "source", "image_path", "collection")
_UNIT_FIELDS = ("chunk_key", "embedding", "error", "entries_json", "needs_embedding", "slots_json")
NEEDS = ("kind", "key", "occurrences", "count", "reason", "detail", "duplicate", *_OCCURRENCE_FIELDS,
         *_UNIT_FIELDS)
ADDS = ("representative", "stored_at")  # and the partition's tally (summary.TALLY_SCHEMA) in place of its rows


def explode_units(batch: pa.Table) -> pa.Table:
    """Each UNIT → one OCCURRENCE per chunk occurrence, keyed by its document; the first (the unit's
    representative) also carries what the job built for the unit."""
    require_columns(batch, NEEDS, "write")
    units = of_kind(batch, Kind.UNIT)
    if units.num_rows == 0:
        return batch
    units = units.combine_chunks()
    occurrences = units["occurrences"].chunk(0)  # ListArray<struct>, one list per unit
    parents, flat = pc.list_parent_indices(occurrences), occurrences.flatten()
    first = np.diff(parents.to_numpy(), prepend=-1) != 0  # each unit's first occurrence: its representative
    columns: dict[str, Any] = {name: flat.field(name) for name in _OCCURRENCE_FIELDS}
    columns.update({name: units[name].take(parents) for name in _UNIT_FIELDS})
    columns.update(kind=pa.array([Kind.OCCURRENCE.value] * len(flat), pa.string()), key=flat.field("doc_id"),
                   representative=pa.array(first))
    return pa.concat_tables([not_of_kind(batch, Kind.UNIT), conform_rows(pa.table(columns))])


def _stored_rows(batch: pa.Table) -> pa.Table:
    kinds = pa.array([Kind.STORED_CHUNK.value] * batch.num_rows, pa.string())
    # parts written before collections existed lack the column (a read of only those omits it): the default
    collection = (pc.fill_null(batch["collection"], DEFAULT_COLLECTION) if "collection" in batch.column_names
                  else pa.array([DEFAULT_COLLECTION] * batch.num_rows, pa.string()))
    return conform_rows(pa.table({"kind": kinds, "key": batch["doc_id"], "chunk_id": batch["chunk_id"],
                                  "chunk_key": batch["chunk_key"], "source": batch["source"],
                                  "collection": collection, "stored_at": batch["path"]}))


def stored_chunk_rows(store: Store, plan: StagePlan) -> ray.data.Dataset | None:
    """The store's chunk rows keyed by document, with the part they came from (parts sort in write order)."""
    ds = read_parts(store, "chunks", ["doc_id", "chunk_id", "chunk_key", "source", "collection"], plan,
                    include_paths=True)
    return None if ds is None else ds.map_batches(_stored_rows, batch_format="pyarrow", num_cpus=plan.task_cpus)


class DocumentWriter:
    """One partition keyed by document id → chunk and quarantine parts written, one TALLY_SCHEMA row."""

    def __init__(self, store: StoreSpec, job_id: str, stamp_ns: int):
        self.spec, self.job_id, self.stamp_ns = store, job_id, stamp_ns

    def token(self, what: str, names: list[str]) -> str:
        return hashlib.sha256("\n".join([self.job_id, what, *sorted(names)]).encode()).hexdigest()[:16]

    def __call__(self, batch: pa.Table) -> pa.Table:
        require_columns(batch, NEEDS, "write")
        inputs = pc.sum(of_kind(batch, Kind.FILE)["count"]).as_py() or 0
        quarantine = [{k: r[k] for k in ("source", "doc_id", "reason", "detail")}
                      for r in of_kind(batch, Kind.REJECTED).select(["source", "doc_id", "reason",
                                                                     "detail"]).to_pylist()]
        duplicate = {r["doc_id"]: r["duplicate"]
                     for r in of_kind(batch, Kind.MARKER).select(["doc_id", "duplicate"]).to_pylist()}
        stored: dict[str, tuple[str, str, str]] = {}
        for r in sorted(of_kind(batch, Kind.STORED_CHUNK).select(["chunk_id", "chunk_key", "source", "collection",
                                                                  "stored_at"])
                        .to_pylist(), key=lambda r: r["stored_at"]):
            # the newest part wins, as readers see it; a document moved to another collection is republished
            stored[r["chunk_id"]] = (r["chunk_key"], r["source"], r["collection"])
        occurrences = of_kind(batch, Kind.OCCURRENCE)
        rows = occurrences.select(["doc_id", "chunk_id", "order", "chunk_key", "source", "collection", "error",
                                   "representative", "entries_json", "needs_embedding"]).to_pylist()
        failed: dict[str, dict[str, Any]] = {}
        for row in sorted(rows, key=lambda r: (r["doc_id"], r["order"])):
            if row["error"] and row["doc_id"] not in failed:
                failed[row["doc_id"]] = row
        for doc_id, row in failed.items():
            reason, _, detail = row["error"].partition(": ")
            quarantine.append({"source": row["source"], "doc_id": doc_id, "reason": reason, "detail": detail})
        ok_docs = set(duplicate) - set(failed)
        publish = [i for i, r in enumerate(rows) if r["doc_id"] in ok_docs
                   and stored.get(r["chunk_id"]) != (r["chunk_key"], r["source"], r["collection"])]
        store = Store.open(self.spec)
        if publish:
            table = occurrences.take(pa.array(publish, pa.int64())).select(CHUNKS_SCHEMA.names)
            store.publish_chunks(table, self.stamp_ns, self.token("chunks", table["chunk_id"].to_pylist()))
        if quarantine:
            store.quarantine(quarantine, self.job_id, self.stamp_ns,
                             self.token("quarantine", [f"{q['source']}\t{q['doc_id']}" for q in quarantine]))
        built = [r for r in rows if r["representative"] and not r["error"]]
        entries = [e for r in built for e in json.loads(r["entries_json"] or "[]")]
        return pa.Table.from_pylist([{
            "inputs": inputs, "indexed": sum(not duplicate[d] for d in ok_docs),
            "deduplicated": sum(duplicate[d] for d in ok_docs),
            "quarantined_json": json.dumps(Counter(q["reason"] for q in quarantine)),
            "num_chunks": sum(r["doc_id"] in ok_docs for r in rows), "num_chunk_texts": len(built),
            "num_compiled": sum(r["entries_json"] not in (None, "[]") for r in built),
            "num_embedded": sum(bool(r["needs_embedding"]) for r in built), "num_published": len(publish),
            "groups_json": json.dumps(entry_groups(entries)), "nodes_json": json.dumps(node_work(entries)),
        }], schema=TALLY_SCHEMA)


def write_documents(rows: ray.data.Dataset, store: Store, job_id: str, stamp_ns: int,
                    plan: StagePlan) -> ray.data.Dataset:
    rows = rows.map_batches(explode_units, batch_format="pyarrow", num_cpus=plan.task_cpus)
    stored = stored_chunk_rows(store, plan)
    if stored is not None:
        rows = rows.union(stored)
    writer = DocumentWriter(store.spec, job_id, stamp_ns)
    return shuffle(rows, plan).map_batches(_write, fn_kwargs={"writer": writer}, batch_size=None,
                                           batch_format="pyarrow", num_cpus=plan.task_cpus)


def _write(batch: pa.Table, writer: DocumentWriter) -> pa.Table:
    return writer(batch)
