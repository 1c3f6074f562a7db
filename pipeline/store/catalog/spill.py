"""External bucket sort and the sequential file writers a serving snapshot is streamed into.

A table of any size is sorted in the memory of one bucket: rows are spilled into bucket files by a
key whose order is the output's (`bucket_of` is monotonic in a 64-bit hash), then read back one
bucket at a time, in order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


class Spill:
    """Rows spread over `count` bucket files, read back one bucket at a time in bucket order."""

    def __init__(self, directory: Path, count: int):
        self.directory, self.count = directory, count
        self.writers: dict[int, pa.ipc.RecordBatchFileWriter] = {}

    def add(self, batch: pa.RecordBatch, buckets: np.ndarray) -> None:
        order = np.argsort(buckets, kind="stable")
        bounds = np.searchsorted(buckets[order], np.arange(self.count + 1))
        for bucket in np.unique(buckets).tolist():
            rows = batch.take(pa.array(order[bounds[bucket]:bounds[bucket + 1]]))
            if bucket not in self.writers:
                self.writers[bucket] = pa.ipc.new_file(str(self._path(bucket)), rows.schema)
            self.writers[bucket].write_batch(rows)

    def tables(self) -> Iterator[pa.Table]:
        for writer in self.writers.values():
            writer.close()
        for bucket in sorted(self.writers):
            with pa.memory_map(str(self._path(bucket))) as source:
                yield pa.ipc.open_file(source).read_all()
            self._path(bucket).unlink()

    def _path(self, bucket: int) -> Path:
        return self.directory / f"bucket-{bucket:05d}.arrow"


def bucket_of(hashes: np.ndarray, count: int) -> np.ndarray:
    """Bucket of each 64-bit hash, monotonic in the hash: bucket order is hash order."""
    return ((hashes >> np.uint64(32)) * np.uint64(count) >> np.uint64(32)).astype(np.int64)


def newest(table: pa.Table, keys: list[str], order_by: list[str]) -> pa.Table:
    """One row per `keys`: the last by `order_by` (ascending)."""
    table = table.sort_by([(c, "ascending") for c in order_by])
    rank = pa.array(np.arange(table.num_rows))
    last = table.append_column("__rank", rank).group_by(keys, use_threads=False).aggregate([("__rank", "max")])
    return table.filter(pc.is_in(rank, value_set=last["__rank_max"]))


class NpyRows:
    """A [rows, width] .npy written row block by row block; the row count is set when it closes."""

    _HEADER_BYTES = 128

    def __init__(self, path: Path, dtype: np.dtype, width: int | None):
        self.path, self.dtype, self.width, self.rows = path, np.dtype(dtype), width, 0
        self.file = open(path, "wb")
        self.file.write(b"\0" * self._HEADER_BYTES)

    def append(self, block: np.ndarray) -> None:
        self.file.write(np.ascontiguousarray(block, self.dtype).tobytes())
        self.rows += len(block)

    def close(self) -> None:
        shape = (self.rows,) if self.width is None else (self.rows, self.width)
        header = repr({"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": shape})
        body = header.encode("latin1")
        body += b" " * (self._HEADER_BYTES - 10 - len(body) - 1) + b"\n"
        self.file.seek(0)
        self.file.write(b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body)
        self.file.close()


class ExactBatches:
    """An IPC file whose record batches hold exactly `rows` rows (the last fewer): readers find row r in
    batch r // rows."""

    def __init__(self, path: Path, schema: pa.Schema, rows: int):
        self.writer, self.rows, self.pending = pa.ipc.new_file(str(path), schema), rows, []

    def append(self, table: pa.Table) -> None:
        self.pending.append(table)
        held = pa.concat_tables(self.pending)
        full = held.num_rows // self.rows * self.rows
        for start in range(0, full, self.rows):
            self.writer.write_batch(held.slice(start, self.rows).combine_chunks().to_batches()[0])
        self.pending = [held.slice(full)] if full < held.num_rows else []

    def close(self) -> None:
        if self.pending:
            self.writer.write_table(pa.concat_tables(self.pending).combine_chunks())
        self.writer.close()
