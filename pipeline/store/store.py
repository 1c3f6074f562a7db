"""The KV store facade: the manifest, three part-logged tables and the shards, on any pyarrow filesystem.

The layout is documented once, in schemas/store.py. The pieces live in their own modules: atomic blob
I/O (pipeline/store/blobs.py), the append-only Parquet part log the tables use (pipeline/store/part_log.py) and
the shard format with its checksums (pipeline/store/shards.py). A shard is always written before the index
row that points at it, so a crash leaves at worst an orphan shard (`pipeline/store/gc.py` sweeps them), never
a row that points at nothing. Parts are append-only and readers dedupe, so reruns never duplicate entries.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from pipeline.store.blobs import Blobs, StoreError
from pipeline.store.part_log import PartLog
from schemas.modes import Variant
from schemas.store import CacheKey, GroupStats, Manifest, ManifestError, ShardEntry, StoreSpec, StoreStats
from schemas.tables import (
    CHUNKS_SCHEMA,
    INDEX_SCHEMA,
    QUARANTINE_SCHEMA,
    RowsError,
    check_chunk_rows,
    check_index_rows,
    conform,
)

if TYPE_CHECKING:
    import torch

    from pipeline.store.kv_quant import QuantizedKV


MANIFEST = "manifest.json"
KEY_COLUMNS = ("chunk_key", "tier", "variant", "fingerprint")
Rows = Iterable[Mapping[str, Any]] | pa.Table


class Store:
    """One store root. Construct with `Store.open`."""

    def __init__(self, blobs: Blobs) -> None:
        self.blobs = blobs
        self.spec = blobs.spec
        self.tables = {
            "index": PartLog(blobs, "index", INDEX_SCHEMA, KEY_COLUMNS, "created_at"),
            "chunks": PartLog(blobs, "chunks", CHUNKS_SCHEMA, ["chunk_id"]),
            "quarantine": PartLog(blobs, "quarantine", QUARANTINE_SCHEMA),
        }
        self._shards = None  # the shard reader, made on first use: tasks that only read tables never import torch
        self._index_keys: tuple[pa.Table, frozenset[tuple]] | None = None
        self._chunk_rows: tuple[pa.Table, dict[str, int]] | None = None

    @property
    def shards(self):
        if self._shards is None:
            from pipeline.store.shards import ShardReader

            self._shards = ShardReader(self.blobs)
        return self._shards

    @classmethod
    def open(cls, uri: str | StoreSpec, filesystem: pafs.FileSystem | None = None, create: bool = False) -> "Store":
        spec = uri if isinstance(uri, StoreSpec) else StoreSpec(uri=str(uri))
        store = cls(Blobs.open(spec, filesystem, create))
        if store.read_manifest() is None and not create:  # read_manifest also rejects unsupported versions
            raise StoreError(f"no store at {spec.uri}: {MANIFEST} is missing (open with create=True to start one)")
        return store

    @property
    def uri(self) -> str:
        return self.spec.uri

    # ---- manifest ------------------------------------------------------------------------------
    def read_manifest(self) -> Manifest | None:
        try:
            data = self.blobs.get(MANIFEST)
        except FileNotFoundError:
            return None
        try:
            return Manifest.from_json(data)
        except ManifestError as e:
            raise StoreError(f"{self.uri}/{MANIFEST}: {e}") from e

    def load_manifest_or_raise(self) -> Manifest:
        manifest = self.read_manifest()
        if manifest is None:
            raise StoreError(f"store {self.uri} has no {MANIFEST}")
        return manifest

    def write_manifest(self, manifest: Manifest) -> None:
        self.blobs.put(MANIFEST, manifest.to_json().encode())

    # ---- writes --------------------------------------------------------------------------------
    def write_shard(self, tensors: Mapping[str, torch.Tensor | QuantizedKV]) -> list[ShardEntry]:
        """Write KV tensors ([layers, 2, kv_heads, tokens, head_dim]) packed in one content-named shard."""
        from pipeline.store.shards import write_shard

        return write_shard(self.blobs, tensors)

    def publish_index(self, rows: Rows, stamp_ns: int | None = None, token: str | None = None) -> int:
        """Publish index rows (INDEX_SCHEMA; `created_at` defaults to now) as one part. Their shards
        must exist. `stamp_ns`/`token` name the part deterministically (see PartLog)."""
        now = datetime.now(timezone.utc)
        if isinstance(rows, pa.Table):
            if "created_at" not in rows.column_names:
                rows = rows.append_column("created_at",
                                          pa.array([now] * rows.num_rows, INDEX_SCHEMA.field("created_at").type))
        else:
            rows = [{"created_at": now, **row} for row in rows]
        table = conform(rows, INDEX_SCHEMA, "index")
        if table.num_rows == 0:
            return 0
        check_index_rows(table)
        shard_paths = sorted(set(table["shard_path"].to_pylist()))
        missing = [p for p, ok in zip(shard_paths, self.blobs.exists(shard_paths)) if not ok]
        if missing:
            raise RowsError(f"index rows point at missing shards {missing[:3]}: write shards before publishing")
        self.tables["index"].append(table, stamp_ns, token)
        return table.num_rows

    def publish_chunks(self, rows: Rows, stamp_ns: int | None = None, token: str | None = None) -> int:
        table = conform(rows, CHUNKS_SCHEMA, "chunks")
        if table.num_rows == 0:
            return 0
        manifest = self.read_manifest()
        check_chunk_rows(table, None if manifest is None else manifest.embedding_dim)
        self.tables["chunks"].append(table, stamp_ns, token)
        return table.num_rows

    def quarantine(self, rows: Rows, job_id: str, stamp_ns: int | None = None, token: str | None = None) -> int:
        """Record rejected inputs (source, doc_id, reason, detail) for job `job_id`."""
        now = datetime.now(timezone.utc)
        rows = rows.to_pylist() if isinstance(rows, pa.Table) else rows
        table = conform([{**row, "job_id": job_id, "rejected_at": now} for row in rows], QUARANTINE_SCHEMA,
                        "quarantine")
        if table.num_rows:
            self.tables["quarantine"].append(table, stamp_ns, token)
        return table.num_rows

    # ---- reads ---------------------------------------------------------------------------------
    def index(self) -> pa.Table:
        """Every KV entry, one row per (chunk_key, tier, variant, fingerprint): the newest."""
        return self.tables["index"].current()

    def chunks(self) -> pa.Table:
        """Every chunk occurrence, one row per chunk_id: the last published."""
        return self.tables["chunks"].current()

    def quarantined(self, job_id: str | None = None) -> pa.Table:
        table = self.tables["quarantine"].current()
        return table if job_id is None else table.filter(pc.equal(table["job_id"], job_id))

    def part_paths(self, table: str) -> list[str]:
        """Filesystem paths (on `self.blobs.fs`) of a table's live parts, for readers that scan them in parallel
        (Ray Data)."""
        return [self.blobs.path(rel) for rel in self.tables[table].part_paths()]

    def lookup(self, chunk_keys: Sequence[str] | None = None, tiers: Iterable[str | None] | None = None,
               variants: Iterable[Variant] | None = None, fingerprints: Iterable[str] | None = None) -> pa.Table:
        """Index rows matching every given filter (a tier of None selects text entries); with
        `chunk_keys`, rows come grouped in the order the keys were requested."""
        table = self.index()
        filters = {"chunk_key": chunk_keys, "tier": tiers, "fingerprint": fingerprints,
                   "variant": None if variants is None else [Variant(v).value for v in variants]}
        for column, values in filters.items():
            if values is not None:
                value_set = pa.array(list(values), pa.string())
                table = table.filter(pc.is_in(table[column], value_set=value_set, skip_nulls=False))
        if chunk_keys is not None:
            position = {key: i for i, key in reversed(list(enumerate(chunk_keys)))}
            table = table.take(np.argsort([position[k] for k in table["chunk_key"].to_pylist()], kind="stable"))
        return table

    def _chunks_by_id(self) -> tuple[pa.Table, dict[str, int]]:
        table = self.chunks()
        if self._chunk_rows is None or self._chunk_rows[0] is not table:
            self._chunk_rows = (table, {chunk_id: i for i, chunk_id in enumerate(table["chunk_id"].to_pylist())})
        return self._chunk_rows

    def chunks_for(self, chunk_ids: Sequence[str] | None = None, doc_ids: Sequence[str] | None = None) -> pa.Table:
        """Chunk rows in the requested order: one per requested chunk id, or each requested
        document's chunks by `order`. Unknown ids raise `StoreError`."""
        if (chunk_ids is None) == (doc_ids is None):
            raise ValueError("chunks_for needs exactly one of chunk_ids or doc_ids")
        table, row_of = self._chunks_by_id()
        column, requested = ("chunk_id", chunk_ids) if chunk_ids is not None else ("doc_id", doc_ids)
        present = row_of if chunk_ids is not None else set(table["doc_id"].to_pylist())
        missing = [i for i in requested if i not in present]
        if missing:
            raise StoreError(f"unknown {column}s in store {self.uri}: {missing[:5]}")
        if chunk_ids is not None:
            return table.take([row_of[chunk_id] for chunk_id in chunk_ids])
        rank = {doc: i for i, doc in reversed(list(enumerate(doc_ids)))}
        table = table.filter(pc.is_in(table["doc_id"], value_set=pa.array(list(doc_ids), pa.string())))
        order = np.lexsort((table["order"].to_numpy(), [rank[d] for d in table["doc_id"].to_pylist()]))
        return table.take(order)

    def has_entries(self, keys: Iterable[CacheKey]) -> set[CacheKey]:
        """The subset of `keys` already in the index (what an incremental run may skip)."""
        index = self.index()
        if self._index_keys is None or self._index_keys[0] is not index:
            self._index_keys = (index, frozenset(zip(*(index[c].to_pylist() for c in KEY_COLUMNS))))
        present = self._index_keys[1]
        return {k for k in keys if (k.chunk_key, k.tier, k.variant.value, k.fingerprint) in present}

    def load_kv(self, row: Mapping[str, Any]) -> torch.Tensor | QuantizedKV:
        return self.load_many([row])[0]

    def load_many(self, rows: Rows) -> list[torch.Tensor | QuantizedKV]:
        """KV tensors (or quantised records) of index rows, in row order, each verified against its checksum."""
        return self.shards.load_many(rows)

    # ---- maintenance ---------------------------------------------------------------------------
    def compact(self, keep_fingerprints: set[str] | None = None, full: bool | None = None) -> int:
        """Compact every table (see `PartLog.compact`): by default the parts jobs appended; `full`
        (implied by `keep_fingerprints`) rewrites everything, dropping index rows of other
        fingerprints (stale after a recompile). Returns the number of parts replaced."""
        full = keep_fingerprints is not None if full is None else full

        def keep(table: pa.Table) -> pa.Table:
            value_set = pa.array(sorted(keep_fingerprints or ()), pa.string())
            return table.filter(pc.is_in(table["fingerprint"], value_set=value_set))

        replaced = self.tables["index"].compact(full, keep if keep_fingerprints is not None else None)
        return replaced + sum(self.tables[t].compact(full) for t in ("chunks", "quarantine"))

    def stats(self) -> StoreStats:
        index, chunks = self.index(), self.chunks()
        grouped = index.group_by(["tier", "variant"]).aggregate([("nbytes", "sum"), ("nbytes", "count")]).to_pylist()
        groups = tuple(sorted(
            (GroupStats(g["tier"], Variant(g["variant"]), g["nbytes_count"], g["nbytes_sum"]) for g in grouped),
            key=lambda g: (g.tier or "", g.variant.value)))
        return StoreStats(num_chunks=chunks.num_rows, num_chunk_keys=pc.count_distinct(chunks["chunk_key"]).as_py(),
                          num_documents=pc.count_distinct(chunks["doc_id"]).as_py(), num_entries=index.num_rows,
                          num_quarantined=self.quarantined().num_rows, groups=groups)
