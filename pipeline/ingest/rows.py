"""The rows that flow through the ingest pipeline: one Arrow schema, a `kind` per row, nulls elsewhere.

One streaming Ray Data job carries everything an input can become, so nothing has to come back to
the driver between stages: documents, the rejections they turn into, per-file read counts, chunk
occurrences, one `UNIT` per distinct chunk text (the work: render → embed → compile) and, joined in
from the store, what it already holds. Each stage reads the kinds it owns and passes the others on;
each stage module declares the columns it needs (`NEEDS`, checked on every batch) and the ones it
fills in (`ADDS`).
`key` is the column the next shuffle partitions on.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Iterable, Mapping

import pyarrow as pa
import pyarrow.compute as pc


class Kind(str, Enum):
    FILE = "file"  # one per corpus file: `count` input records read from it
    DOC = "doc"  # a document that passed its reader
    REJECTED = "rejected"  # an input that ends quarantined: `reason`, `detail`
    CHUNK = "chunk"  # one chunk occurrence of a document
    MARKER = "marker"  # one per chunked document: its whole-text key, whether it repeats another document
    UNIT = "unit"  # one distinct chunk text: what to build for it, then what was built
    OCCURRENCE = "occurrence"  # a chunk occurrence with its unit's outcome, on the way to publishing
    STORED_ENTRY = "stored_entry"  # from the store: an index entry (`slot`) of `chunk_key`
    STORED_CHUNK = "stored_chunk"  # from the store: a chunk row (its embedding, its `stored_at` part)


OCCURRENCE_TYPE = pa.struct([
    ("chunk_id", pa.string()), ("doc_id", pa.string()), ("order", pa.int32()), ("text", pa.string()),
    ("num_text_tokens", pa.int32()), ("source", pa.string()), ("image_path", pa.string()),
    ("collection", pa.string()),
])
PAGES_TYPE = pa.list_(pa.struct([("tier", pa.string()), ("png", pa.list_(pa.binary()))]))

ROW_SCHEMA = pa.schema([
    ("kind", pa.string()), ("key", pa.string()),
    # documents (and the rejections they become)
    ("doc_id", pa.string()), ("source", pa.string()), ("order_key", pa.string()), ("text", pa.string()),
    ("metadata_json", pa.string()), ("text_key", pa.string()), ("image_phash", pa.string()),
    ("image_path", pa.string()), ("reason", pa.string()), ("detail", pa.string()), ("count", pa.int64()),
    ("duplicate", pa.bool_()),
    # chunks and units
    ("chunk_id", pa.string()), ("order", pa.int32()), ("chunk_key", pa.string()), ("num_text_tokens", pa.int32()),
    ("collection", pa.string()),  # who may read the chunk: its document's collection (schemas/corpus.py)
    ("occurrences", pa.list_(OCCURRENCE_TYPE)), ("slots_json", pa.string()), ("needs_embedding", pa.bool_()),
    ("pages", PAGES_TYPE), ("missing_glyphs", pa.int32()), ("embedding", pa.list_(pa.float32())),
    ("error", pa.string()), ("entries_json", pa.string()), ("representative", pa.bool_()),
    # joined from the store
    ("slot", pa.string()), ("stored_at", pa.string()),
])


def rows_table(rows: Iterable[Mapping[str, Any]]) -> pa.Table:
    """Python rows (any subset of ROW_SCHEMA's columns) as a table of exactly ROW_SCHEMA."""
    rows = list(rows)
    return pa.table({name: pa.array([row.get(name) for row in rows], ROW_SCHEMA.field(name).type)
                     for name in ROW_SCHEMA.names})


def conform_rows(table: pa.Table) -> pa.Table:
    """`table`'s columns (a subset of ROW_SCHEMA's) padded with nulls to exactly ROW_SCHEMA."""
    columns = []
    for field in ROW_SCHEMA:
        if field.name in table.column_names:
            columns.append(table[field.name].cast(field.type))
        else:
            columns.append(pa.nulls(table.num_rows, field.type))
    return pa.Table.from_arrays(columns, schema=ROW_SCHEMA)


def require_columns(table: pa.Table, needed: Iterable[str], stage: str) -> None:
    """Raise a ValueError naming the columns of `needed` that `table` lacks (`stage`: who needs them)."""
    missing = [name for name in needed if name not in table.column_names]
    if missing:
        raise ValueError(f"the {stage} stage needs columns {missing}, which its input rows lack "
                         f"(they have {table.column_names})")


def of_kind(table: pa.Table, *kinds: Kind) -> pa.Table:
    return table.filter(pc.is_in(table["kind"], value_set=pa.array([k.value for k in kinds], pa.string())))


def not_of_kind(table: pa.Table, *kinds: Kind) -> pa.Table:
    return table.filter(pc.invert(pc.is_in(table["kind"], value_set=pa.array([k.value for k in kinds], pa.string()))))


def _wants(batch: pa.Table, columns: Iterable[str]):
    """UNIT rows without an error that any of `columns` asks work of (`slots_json`: a missing slot; a flag)."""
    asks = None
    for column in columns:
        this = (pc.not_equal(pc.fill_null(batch[column], "[]"), "[]") if column == "slots_json"
                else pc.fill_null(batch[column], False))
        asks = this if asks is None else pc.or_(asks, this)
    unit = pc.and_(pc.equal(batch["kind"], Kind.UNIT.value), pc.equal(pc.fill_null(batch["error"], ""), ""))
    return pc.and_(unit, asks)


def units_to_build(batch: pa.Table, column: str) -> tuple[pa.Table, pa.Table]:
    """(UNIT rows without an error whose `column` asks for work, every other row)."""
    wants = _wants(batch, (column,))
    return batch.filter(wants), batch.filter(pc.invert(wants))


def needing_work(batch: pa.Table, columns: tuple[str, ...]) -> pa.Table:
    """The UNIT rows some stage of `columns` has work for (Ray Data's map_batches form of `units_to_build`)."""
    return batch.filter(_wants(batch, columns))


def not_needing_work(batch: pa.Table, columns: tuple[str, ...]) -> pa.Table:
    return batch.filter(pc.invert(_wants(batch, columns)))


def with_columns(table: pa.Table, **columns: Any) -> pa.Table:
    """`table` with the named ROW_SCHEMA columns replaced (Python lists or Arrow arrays)."""
    for name, values in columns.items():
        array = (values if isinstance(values, (pa.Array, pa.ChunkedArray))
                 else pa.array(values, ROW_SCHEMA.field(name).type))
        table = table.set_column(table.schema.get_field_index(name), name, array)
    return table
