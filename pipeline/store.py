"""Reader/writer of the KV store: safetensors shards plus Arrow index / chunk / quarantine parts.

Every write is atomic (local: temp file + fsync + rename; object stores: one PUT or one completed
multipart upload, never visible half-written), and a shard is always written before the index row
that points at it, so a crash leaves at worst an orphan shard (`remove_orphans`), never a row that
points at a missing one. Parts are append-only; readers dedupe, so reruns never duplicate entries.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import time
import uuid
from collections import defaultdict
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from pipeline.filesystem import resolve_filesystem  # noqa: F401  (re-exported)
from schemas.config import DType, Variant
from schemas.store import (
    CHUNKS_SCHEMA, INDEX_SCHEMA, QUARANTINE_SCHEMA, SHARD_PATH, CacheKey, GroupStats, Manifest, ManifestError,
    RowsError, ShardEntry, StoreSpec, StoreStats, check_chunk_rows, check_index_rows, conform,
)

MANIFEST = "manifest.json"
KEY_COLUMNS = ("chunk_key", "tier", "variant", "fingerprint")
_TMP_PREFIX = ".tmp-"
_TENSOR_KEY = re.compile(r"[A-Za-z0-9._:\-]{1,200}")
_TORCH_DTYPES = {torch.float32: DType.FLOAT32, torch.bfloat16: DType.BFLOAT16, torch.float16: DType.FLOAT16}
Rows = Iterable[Mapping[str, Any]] | pa.Table


class StoreError(ValueError):
    """The store is missing, unreadable or of an unsupported version, or a request names unknown ids."""


class ShardCorruptError(RuntimeError):
    """A KV shard is missing, unreadable, or its bytes do not match the index checksum."""


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of the bytes safetensors stores for `tensor` (contiguous, little-endian)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(flat.numpy()).hexdigest()


def _newest_per_key(table: pa.Table, keys: Sequence[str], time_column: str | None) -> pa.Table:
    """Keep one row per key: the latest `time_column`, ties (or no time column) broken by write order."""
    if table.num_rows == 0:
        return table
    if time_column is not None:
        table = table.take(pc.sort_indices(table[time_column]))  # stable: ties keep part order
    rank = pa.array(np.arange(table.num_rows))
    newest = table.append_column("__rank", rank).group_by(list(keys), use_threads=False).aggregate(
        [("__rank", "max")])["__rank_max"]
    return table.filter(pc.is_in(rank, value_set=newest))


class Store:
    """One store root on any pyarrow filesystem. Construct with `Store.open`."""

    def __init__(self, fs: pafs.FileSystem, root: str, uri: str) -> None:
        self.fs, self.root, self.uri = fs, root, uri
        self.spec = StoreSpec(uri=uri)
        self._is_local = isinstance(fs, pafs.LocalFileSystem)
        self._part_tables: dict[str, dict[str, pa.Table]] = defaultdict(dict)  # dir -> part name -> table
        self._merged: dict[str, tuple[tuple[str, ...], pa.Table]] = {}
        self._views: dict[str, tuple[pa.Table, Any]] = {}  # name -> (raw table it came from, derived view)

    @classmethod
    def open(cls, uri: str | StoreSpec, filesystem: pafs.FileSystem | None = None, create: bool = False) -> "Store":
        spec = uri if isinstance(uri, StoreSpec) else StoreSpec(uri=str(uri))
        store = cls(*resolve_filesystem(spec, filesystem), spec.uri)
        store.spec = spec  # how workers elsewhere in the cluster reopen the same store
        if store._is_local and create:
            os.makedirs(store.root, exist_ok=True)
        elif not store._is_local:
            container = store.root.split("/", 1)[0]
            if store.fs.get_file_info(container).type == pafs.FileType.NotFound:
                raise StoreError(f"bucket {container!r} of store {spec.uri} does not exist")
        if store.read_manifest() is None and not create:  # read_manifest also rejects unsupported versions
            raise StoreError(f"no store at {spec.uri}: {MANIFEST} is missing (open with create=True to start one)")
        return store

    # ---- bytes ---------------------------------------------------------------------------------
    def _path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def _put(self, rel: str, data: bytes) -> None:
        path = self._path(rel)
        if not self._is_local:
            with self.fs.open_output_stream(path) as out:  # object appears only when the upload completes
                out.write(data)
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = os.path.join(os.path.dirname(path), f"{_TMP_PREFIX}{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def _get(self, path: str) -> bytes:
        with self.fs.open_input_file(path) as f:  # one whole-object GET on S3, not many ranged reads
            return f.read()

    def _list(self, rel: str, recursive: bool) -> list[pafs.FileInfo]:
        selector = pafs.FileSelector(self._path(rel), allow_not_found=True, recursive=recursive)
        return [i for i in self.fs.get_file_info(selector) if i.type == pafs.FileType.File]

    # ---- manifest ------------------------------------------------------------------------------
    def read_manifest(self) -> Manifest | None:
        try:
            data = self._get(self._path(MANIFEST))
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
        self._put(MANIFEST, manifest.to_json().encode())

    # ---- writes --------------------------------------------------------------------------------
    def write_shard(self, tensors: Mapping[str, torch.Tensor]) -> list[ShardEntry]:
        """Write KV tensors ([layers, 2, kv_heads, tokens, head_dim]) as one content-named shard."""
        if not tensors:
            raise ValueError("write_shard needs at least one tensor")
        prepared: dict[str, torch.Tensor] = {}
        for key, tensor in tensors.items():
            if not isinstance(key, str) or not _TENSOR_KEY.fullmatch(key):
                raise ValueError(f"tensor key must match {_TENSOR_KEY.pattern}, got {key!r:.80}")
            if not isinstance(tensor, torch.Tensor) or tensor.dtype not in _TORCH_DTYPES:
                raise ValueError(f"tensor {key!r} must be a float32/bfloat16/float16 torch.Tensor")
            prepared[key] = tensor.detach().to("cpu").contiguous()
        data = safetensors_save(prepared)
        digest = hashlib.sha256(data).hexdigest()
        rel = f"shards/{digest[:2]}/{digest}.safetensors"
        if self.fs.get_file_info(self._path(rel)).type != pafs.FileType.File:  # same name = same bytes
            self._put(rel, data)
        return [ShardEntry(key, rel, t.nbytes, tensor_sha256(t), _TORCH_DTYPES[t.dtype]) for key, t in prepared.items()]

    def _write_part(self, directory: str, table: pa.Table) -> None:
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        name = f"part-{time.time_ns():020d}-{uuid.uuid4().hex[:12]}.parquet"  # sorts in write order
        self._put(f"{directory}/{name}", sink.getvalue().to_pybytes())

    def publish_index(self, rows: Rows) -> int:
        """Publish index rows (INDEX_SCHEMA; `created_at` defaults to now). Their shards must exist."""
        now = datetime.now(timezone.utc)
        if isinstance(rows, pa.Table):
            if "created_at" not in rows.column_names:
                stamps = pa.array([now] * rows.num_rows, INDEX_SCHEMA.field("created_at").type)
                rows = rows.append_column("created_at", stamps)
        else:
            rows = [{"created_at": now, **row} for row in rows]
        table = conform(rows, INDEX_SCHEMA, "index")
        if table.num_rows == 0:
            return 0
        check_index_rows(table)
        self._check_shards_exist(table)
        self._write_part("index", table)
        return table.num_rows

    def _check_shards_exist(self, table: pa.Table) -> None:
        shard_paths = sorted(set(table["shard_path"].to_pylist()))
        infos = self.fs.get_file_info([self._path(p) for p in shard_paths])
        missing = [p for p, i in zip(shard_paths, infos) if i.type != pafs.FileType.File]
        if missing:
            raise RowsError(f"index rows point at missing shards {missing[:3]}: write shards before publishing")

    def publish_chunks(self, rows: Rows) -> int:
        table = conform(rows, CHUNKS_SCHEMA, "chunks")
        if table.num_rows == 0:
            return 0
        manifest = self.read_manifest()
        check_chunk_rows(table, None if manifest is None else manifest.embedding_dim)
        self._write_part("chunks", table)
        return table.num_rows

    def quarantine(self, rows: Iterable[Mapping[str, Any]], job_id: str) -> int:
        """Record rejected inputs (source, doc_id, reason, detail) for job `job_id`."""
        now = datetime.now(timezone.utc)
        rows = [{**row, "job_id": job_id, "rejected_at": now} for row in rows]
        table = conform(rows, QUARANTINE_SCHEMA, "quarantine")
        if table.num_rows:
            self._write_part("quarantine", table)
        return table.num_rows

    # ---- reads ---------------------------------------------------------------------------------
    def _parts(self, directory: str, schema: pa.Schema) -> tuple[tuple[str, ...], pa.Table]:
        """All part files of `directory` concatenated in write order; unchanged parts are not re-read."""
        infos = [i for i in self._list(directory, recursive=False)
                 if i.base_name.startswith("part-") and i.base_name.endswith(".parquet")]
        names = tuple(sorted(i.path for i in infos))
        cached = self._merged.get(directory)
        if cached is not None and cached[0] == names:
            return cached
        tables = self._part_tables[directory]
        for name in set(tables) - set(names):
            del tables[name]
        for name in names:
            if name not in tables:
                try:
                    tables[name] = pq.read_table(pa.BufferReader(self._get(name))).select(schema.names).cast(schema)
                except (KeyError, pa.ArrowException) as e:
                    raise StoreError(f"part {name} does not match the {directory} schema: {e}") from e
        merged = pa.concat_tables([tables[n] for n in names]) if names else schema.empty_table()
        self._merged[directory] = (names, merged)
        return self._merged[directory]

    def _view(self, directory: str, schema: pa.Schema, derive: Callable[[pa.Table], Any]) -> Any:
        """`derive(all parts)`, recomputed only when the part files changed."""
        raw = self._parts(directory, schema)[1]
        cached = self._views.get(directory)
        if cached is None or cached[0] is not raw:
            cached = self._views[directory] = (raw, derive(raw))
        return cached[1]

    def _index_view(self) -> tuple[pa.Table, frozenset[tuple]]:
        def derive(raw: pa.Table) -> tuple[pa.Table, frozenset[tuple]]:
            deduped = _newest_per_key(raw, KEY_COLUMNS, "created_at")
            return deduped, frozenset(zip(*(deduped[c].to_pylist() for c in KEY_COLUMNS)))
        return self._view("index", INDEX_SCHEMA, derive)

    def _chunks_view(self) -> tuple[pa.Table, dict[str, int]]:
        def derive(raw: pa.Table) -> tuple[pa.Table, dict[str, int]]:
            deduped = _newest_per_key(raw, ["chunk_id"], None)
            return deduped, {chunk_id: i for i, chunk_id in enumerate(deduped["chunk_id"].to_pylist())}
        return self._view("chunks", CHUNKS_SCHEMA, derive)

    def index(self) -> pa.Table:
        """Every KV entry, one row per (chunk_key, tier, variant, fingerprint): the newest."""
        return self._index_view()[0]

    def chunks(self) -> pa.Table:
        """Every chunk occurrence, one row per chunk_id: the last published."""
        return self._chunks_view()[0]

    def quarantined(self, job_id: str | None = None) -> pa.Table:
        table = self._parts("quarantine", QUARANTINE_SCHEMA)[1]
        return table if job_id is None else table.filter(pc.equal(table["job_id"], job_id))

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

    def chunks_for(self, chunk_ids: Sequence[str] | None = None, doc_ids: Sequence[str] | None = None) -> pa.Table:
        """Chunk rows in the requested order: one per requested chunk id, or each requested
        document's chunks by `order`. Unknown ids raise `StoreError`."""
        if (chunk_ids is None) == (doc_ids is None):
            raise ValueError("chunks_for needs exactly one of chunk_ids or doc_ids")
        table, row_of = self._chunks_view()
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
        present = self._index_view()[1]
        return {k for k in keys if (k.chunk_key, k.tier, k.variant.value, k.fingerprint) in present}

    def load_kv(self, row: Mapping[str, Any]) -> torch.Tensor:
        return self.load_many([row])[0]

    def load_many(self, rows: Rows) -> list[torch.Tensor]:
        """KV tensors of index rows, in row order; each shard file is read once and every tensor's
        checksum is verified."""
        rows = rows.to_pylist() if isinstance(rows, pa.Table) else list(rows)
        by_shard: dict[str, list[int]] = defaultdict(list)
        for i, row in enumerate(rows):
            if not isinstance(row.get("shard_path"), str) or not SHARD_PATH.fullmatch(row["shard_path"]):
                raise StoreError(f"row {i} has no valid shard_path: {row.get('shard_path')!r:.80}")
            by_shard[row["shard_path"]].append(i)
        out: list[torch.Tensor] = [torch.empty(0)] * len(rows)
        for rel, positions in by_shard.items():
            tensors = self._read_shard(self._path(rel), {rows[i]["tensor_key"] for i in positions})
            for i in positions:
                tensor = tensors[rows[i]["tensor_key"]]
                if tensor.nbytes != rows[i]["nbytes"] or tensor_sha256(tensor) != rows[i]["checksum"]:
                    key = rows[i]["tensor_key"]
                    raise ShardCorruptError(f"tensor {key!r} of shard {self._path(rel)} fails its checksum")
                out[i] = tensor
        return out

    def _read_shard(self, path: str, keys: set[str]) -> dict[str, torch.Tensor]:
        try:
            if self._is_local:  # mmap: only the requested tensors are paged in
                with safe_open(path, framework="pt") as f:
                    return {key: f.get_tensor(key) for key in keys}
            tensors = safetensors_load(self._get(path))
            return {key: tensors[key] for key in keys}
        except FileNotFoundError as e:
            raise ShardCorruptError(f"shard {path} is missing") from e
        except KeyError as e:
            raise ShardCorruptError(f"shard {path} lacks tensor {e}") from e
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ShardCorruptError(f"shard {path} is unreadable: {e}") from e

    # ---- maintenance ---------------------------------------------------------------------------
    def remove_orphans(self, older_than_s: float = 3600.0) -> int:
        """Delete shards no index row references, and temp files left by crashed writes, that are
        older than `older_than_s` (a grace period for jobs between write_shard and publish_index).
        Rows hidden by a newer duplicate still protect their shard until `compact()` drops them, and
        shards of a serving generation still live (current or leased) are never removed."""
        referenced = {self._path(p) for p in self._parts("index", INDEX_SCHEMA)[1]["shard_path"].to_pylist()}
        from pipeline.generations import protected_shards  # (imports this module)

        referenced |= {self._path(p) for p in protected_shards(self)}  # what a live service may still read
        cutoff_ns = time.time_ns() - int(older_than_s * 1e9)
        shard_dir = self._path("shards/")
        removed = 0
        for info in self._list("", recursive=True):
            is_temp = info.base_name.startswith(_TMP_PREFIX)
            is_orphan = info.path.startswith(shard_dir) and info.path not in referenced
            if (is_temp or is_orphan) and (info.mtime_ns or 0) <= cutoff_ns:
                self.fs.delete_file(info.path)
                removed += 1
        return removed

    def compact(self, keep_fingerprints: set[str] | None = None) -> None:
        """Rewrite each table as one deduped part; with `keep_fingerprints`, index rows of any other
        fingerprint (stale after a recompile) are dropped. New parts land before old ones are
        deleted, so concurrent readers see duplicates (which they dedupe) but never missing rows."""
        def index() -> pa.Table:
            table = self.index()
            if keep_fingerprints is None:
                return table
            return table.filter(pc.is_in(table["fingerprint"], value_set=pa.array(sorted(keep_fingerprints))))

        for directory, schema, dedupe in (("index", INDEX_SCHEMA, index), ("chunks", CHUNKS_SCHEMA, self.chunks),
                                          ("quarantine", QUARANTINE_SCHEMA, self.quarantined)):
            names, _ = self._parts(directory, schema)
            if len(names) > 1 or (directory == "index" and keep_fingerprints is not None and names):
                self._write_part(directory, dedupe())
                for name in names:
                    self.fs.delete_file(name)

    def stats(self) -> StoreStats:
        index, chunks = self.index(), self.chunks()
        grouped = index.group_by(["tier", "variant"]).aggregate([("nbytes", "sum"), ("nbytes", "count")]).to_pylist()
        groups = tuple(sorted(
            (GroupStats(g["tier"], Variant(g["variant"]), g["nbytes_count"], g["nbytes_sum"]) for g in grouped),
            key=lambda g: (g.tier or "", g.variant.value)))
        return StoreStats(num_chunks=chunks.num_rows, num_chunk_keys=pc.count_distinct(chunks["chunk_key"]).as_py(),
                          num_documents=pc.count_distinct(chunks["doc_id"]).as_py(), num_entries=index.num_rows,
                          num_quarantined=self.quarantined().num_rows, groups=groups)
