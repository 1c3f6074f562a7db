"""The store's tables: Arrow schemas of its three part logs (chunks, index, quarantine) and the rules
every row obeys before it is written (`conform`, `check_index_rows`, `check_chunk_rows`). The layout
they live in, the manifest and the keys: schemas/store.py.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Any, Iterable, Mapping

import pyarrow as pa
import pyarrow.compute as pc

from schemas.config import DType, KVQuant
from schemas.modes import ChunkKind, Variant
from schemas.store import HEX64, TIER_NAME

SHARD_PATH = re.compile(r"shards/[0-9a-f]{2}/[0-9a-f]{64}\.safetensors")  # named by sha256 of its bytes
_TIMESTAMP = pa.timestamp("us", tz="UTC")
_PAGES = pa.list_(pa.list_(pa.int32()))  # one [t, h, w] or [w, h] per page
OPTIONAL = b"qvpic.optional"  # field metadata: a nullable column added later, absent from older parts and rows

CHUNKS_SCHEMA = pa.schema([
    pa.field("chunk_id", pa.string(), nullable=False),
    pa.field("doc_id", pa.string(), nullable=False),
    pa.field("order", pa.int32(), nullable=False),  # position of the chunk within its document
    pa.field("chunk_key", pa.string(), nullable=False),  # sha256 hex of the normalised text
    pa.field("text", pa.string(), nullable=False),
    pa.field("num_text_tokens", pa.int32(), nullable=False),
    pa.field("embedding", pa.list_(pa.float32()), nullable=False),
    pa.field("source", pa.string(), nullable=False),
    pa.field("image_path", pa.string(), nullable=True),  # the original page image of an OCR'd document
    # who may read the chunk (schemas/corpus.py COLLECTION_KEY): its document's collection. Optional: parts
    # written before collections existed read it as null, which is the default collection.
    pa.field("collection", pa.string(), nullable=True, metadata={OPTIONAL: b"1"}),
])

INDEX_SCHEMA = pa.schema([
    pa.field("chunk_key", pa.string(), nullable=False),
    pa.field("tier", pa.string(), nullable=True),  # null for the text variants
    pa.field("variant", pa.string(), nullable=False),  # Variant value
    pa.field("fingerprint", pa.string(), nullable=False),  # entry fingerprint
    pa.field("kind", pa.string(), nullable=False),  # ChunkKind value
    pa.field("num_tokens", pa.int32(), nullable=False),
    pa.field("position_span", pa.int32(), nullable=False),  # how far positions advance past the chunk
    pa.field("compile_start", pa.int32(), nullable=False),  # first position the KV was compiled at
    pa.field("grid_thw", _PAGES, nullable=False),  # empty for text
    pa.field("image_sizes_px", _PAGES, nullable=False),  # empty for text
    pa.field("vision_tokens", pa.int32(), nullable=False),
    pa.field("dtype", pa.string(), nullable=False),  # DType value, or the KVQuant format of a quantised record
    pa.field("shard_path", pa.string(), nullable=False),  # relative to the store root
    pa.field("tensor_key", pa.string(), nullable=False),
    pa.field("nbytes", pa.int64(), nullable=False),
    pa.field("byte_offset", pa.int64(), nullable=False),  # where the tensor's bytes start in its shard file
    pa.field("shape", pa.list_(pa.int64()), nullable=False),  # [layers, 2, kv_heads, tokens, head_dim]
    pa.field("checksum", pa.string(), nullable=False),  # sha256 hex of the tensor's raw bytes
    pa.field("created_at", _TIMESTAMP, nullable=False),
    # OCR character accuracy of the entry's pages against the chunk's text, in [0, 1] (`qvpic ingest
    # --legibility`); null when not measured, and for text entries. Optional: parts written before the
    # column existed read it as null.
    pa.field("legibility", pa.float32(), nullable=True, metadata={OPTIONAL: b"1"}),
])

QUARANTINE_SCHEMA = pa.schema([
    pa.field("source", pa.string(), nullable=False),
    pa.field("doc_id", pa.string(), nullable=True),  # null when the input failed before it had one
    pa.field("reason", pa.string(), nullable=False),
    pa.field("detail", pa.string(), nullable=False),
    pa.field("job_id", pa.string(), nullable=False),
    pa.field("rejected_at", _TIMESTAMP, nullable=False),
])


class RowsError(ValueError):
    """Rows do not match a store table's schema."""


def optional_names(schema: pa.Schema) -> set[str]:
    return {f.name for f in schema if f.metadata and f.metadata.get(OPTIONAL)}


def with_optional(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """`table` with every optional column of `schema` it lacks added as nulls (a part written before it existed)."""
    for name in optional_names(schema) - set(table.column_names):
        table = table.append_column(schema.field(name), pa.nulls(table.num_rows, schema.field(name).type))
    return table


def conform(rows: Iterable[Mapping[str, Any]] | pa.Table, schema: pa.Schema, what: str) -> pa.Table:
    """Rows (dicts or a Table) as a Table of exactly `schema`; missing, extra or null-in-required
    columns raise `RowsError` instead of becoming silent nulls. Optional columns (see `OPTIONAL`) may be
    left out: they are null."""
    optional = optional_names(schema)
    if isinstance(rows, pa.Table):
        rows = with_optional(rows, schema)
    elif optional:
        rows = [{**{name: None for name in optional}, **row} for row in rows]
    if isinstance(rows, pa.Table):
        missing = set(schema.names) - set(rows.column_names)
        extra = set(rows.column_names) - set(schema.names)
        if missing or extra:
            raise RowsError(f"{what} columns: missing {sorted(missing)}, unexpected {sorted(extra)}")
    try:
        if isinstance(rows, pa.Table):
            table = rows.select(schema.names).cast(schema)
        else:
            table = pa.Table.from_pylist(_checked_dicts(rows, schema, what), schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError) as e:
        raise RowsError(f"{what} rows do not fit {schema.names}: {e}") from e
    for field in schema:
        if not field.nullable and table.column(field.name).null_count:
            raise RowsError(f"{what} column {field.name!r} must not contain nulls")
    return table


def _checked_dicts(rows: Iterable[Mapping[str, Any]], schema: pa.Schema, what: str) -> list[Mapping[str, Any]]:
    rows = list(rows)
    names = set(schema.names)
    for i, row in enumerate(rows):
        if set(row) != names:
            raise RowsError(
                f"{what} row {i}: missing {sorted(names - set(row))}, unexpected {sorted(set(row) - names)}"
            )
    return rows


def _require(ok: pa.Scalar, message: str) -> None:
    if not ok.as_py():
        raise RowsError(message)


def _all_match(column: pa.ChunkedArray, pattern: re.Pattern[str]) -> pa.Scalar:
    return pc.all(pc.match_substring_regex(column, f"^{pattern.pattern}$"))


def _all_in(column: pa.ChunkedArray, enum: type[Enum]) -> pa.Scalar:
    return pc.all(pc.is_in(column, value_set=pa.array([e.value for e in enum], pa.string())))


def check_index_rows(table: pa.Table) -> None:
    """Row rules of INDEX_SCHEMA beyond types; raises `RowsError` naming the first broken rule."""
    for column in ("chunk_key", "fingerprint", "checksum"):
        _require(_all_match(table[column], HEX64), f"index {column} must be sha256 hex")
    _require(_all_in(table["variant"], Variant), "index variant must be a Variant value")
    _require(_all_in(table["kind"], ChunkKind), "index kind must be a ChunkKind value")
    stored = pa.array([d.value for d in DType] + [q.value for q in KVQuant if q is not KVQuant.NONE], pa.string())
    _require(pc.all(pc.is_in(table["dtype"], value_set=stored)),
             "index dtype must be a DType value or a KVQuant format")
    text_variants = pa.array([v.value for v in Variant if v.kind is ChunkKind.TEXT], pa.string())
    is_text = pc.is_in(table["variant"], value_set=text_variants)
    _require(pc.all(pc.equal(is_text, pc.is_null(table["tier"]))), "tier must be null exactly for the text variants")
    _require(_all_match(pc.drop_null(table["tier"]), TIER_NAME), "index tier is not a tier name")
    _require(_all_match(table["shard_path"], SHARD_PATH), "index shard_path must come from write_shard")
    legibility = pc.drop_null(table["legibility"])
    outside = pc.or_(pc.less(legibility, 0.0), pc.greater(legibility, 1.0))
    _require(pa.scalar(not pc.any(outside).as_py()), "index legibility must lie in [0, 1]")


def check_chunk_rows(table: pa.Table, embedding_dim: int | None) -> None:
    """Row rules of CHUNKS_SCHEMA beyond types (embedding width checked when the store declares one)."""
    _require(_all_match(table["chunk_key"], HEX64), "chunk_key must be sha256 hex")
    if embedding_dim is not None:
        dims = pc.list_value_length(table["embedding"])
        _require(pc.all(pc.equal(dims, embedding_dim)), f"embeddings must have {embedding_dim} dims")
