"""Streaming passes over a table's parts one range of content keys at a time: what lets `qvpic verify` join
the index with the chunk table (or with a generation's entries) holding one range in memory, whatever
the store's size.

Content keys (`chunk_key`) are sha256 hex, so ranges of their first four hex digits split any store evenly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.store.store import Store

RANGE_ROWS = 250_000  # rows of the larger table a range holds, about: a join holds ~0.7 KB a row at its peak
READ_ROWS = 65_536


def key_ranges(num_rows: int, range_rows: int | None = None) -> list[tuple[str | None, str | None]]:
    """[lo, hi) ranges of hex keys (None: unbounded), each holding about `range_rows` (default
    RANGE_ROWS) of `num_rows` rows."""
    range_rows = range_rows or RANGE_ROWS
    count = max(1, min(4096, -(-num_rows // range_rows)))
    cuts = [f"{(0x10000 * i) // count:04x}" for i in range(1, count)]
    return list(zip([None, *cuts], [*cuts, None]))


def in_range(keys: pa.Array | pa.ChunkedArray, lo: str | None, hi: str | None) -> pa.Array:
    """Mask of `keys` in [lo, hi)."""
    masks = ([pc.greater_equal(keys, lo)] if lo is not None else []) + ([pc.less(keys, hi)] if hi is not None else [])
    if not masks:
        return pc.is_valid(keys)
    return masks[0] if len(masks) == 1 else pc.and_(*masks)


def read_range(store: Store, table: str, columns: Sequence[str], lo: str | None, hi: str | None,
               key: str = "chunk_key", where: Callable[[pa.RecordBatch], pa.Array] | None = None) -> pa.Table:
    """`columns` of every row of `table`'s parts whose `key` lies in [lo, hi) (and that `where` keeps),
    read a record batch at a time."""
    schema = store.tables[table].schema
    empty = pa.schema([schema.field(c) for c in columns]).empty_table()
    return pa.concat_tables([empty, *_filtered(store, table, columns, lo, hi, key, where)],
                            promote_options="permissive")


def _filtered(store: Store, table: str, columns: Sequence[str], lo: str | None, hi: str | None,
              key: str, where: Callable[[pa.RecordBatch], pa.Array] | None) -> Iterator[pa.Table]:
    for rel in store.tables[table].part_paths():
        with store.blobs.open_input(rel) as f:
            for batch in pq.ParquetFile(f).iter_batches(batch_size=READ_ROWS, columns=list(columns)):
                mask = in_range(batch[key], lo, hi)
                kept = pa.Table.from_batches([batch]).filter(mask if where is None else pc.and_(mask, where(batch)))
                if kept.num_rows:
                    yield kept

