"""Record files: JSONL (one record a line) and Parquet (one record a row), each record through `records.py`.

A line or row that cannot be decoded is rejected on its own; the records around it stand. Memory stays
bounded by one record (`ReaderSpec.max_record_nbytes`), however long a line claims to be.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.ingest.corpus.records import parse_record, reject, unique_ids
from schemas.corpus import Document, ReaderSpec, Rejection, RejectReason

_SKIP_CHUNK_NBYTES = 1 << 20


def _lines(stream: BinaryIO, max_nbytes: int) -> Iterator[tuple[int, bytes | None, int]]:
    """(line number, bytes or None when longer than max_nbytes, length); memory stays O(max_nbytes)."""
    line_no = 0
    while line := stream.readline(max_nbytes + 1):
        line_no += 1
        if len(line) <= max_nbytes or line.endswith(b"\n"):
            yield line_no, line, len(line)
            continue
        nbytes = len(line)
        while not line.endswith(b"\n") and (line := stream.readline(_SKIP_CHUNK_NBYTES)):
            nbytes += len(line)
        yield line_no, None, nbytes


def read_jsonl(stream: BinaryIO, relpath: str, spec: ReaderSpec) -> Iterator[Document | Rejection]:
    """The records of an open JSONL file (local or on an object store: readers.read_entry opens it)."""
    yield from unique_ids(_jsonl_records(stream, relpath, spec))


def _jsonl_records(stream: BinaryIO, relpath: str, spec: ReaderSpec) -> Iterator[Document | Rejection]:
    for line_no, raw, nbytes in _lines(stream, spec.max_record_nbytes):
        source = f"{relpath}#L{line_no}"
        if raw is None:
            yield reject(source, None, RejectReason.TOO_LARGE, f"line of {nbytes} bytes > {spec.max_record_nbytes}")
            continue
        if line_no == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield reject(source, None, RejectReason.INVALID_UTF8, f"byte {exc.start}: {exc.reason}")
            continue
        if not line.strip():  # a blank line is no record
            continue
        try:
            record = json.loads(line)
        except RecursionError:
            yield reject(source, None, RejectReason.MALFORMED_RECORD, "JSON nested too deeply")
            continue
        except ValueError as exc:
            yield reject(source, None, RejectReason.MALFORMED_RECORD, f"bad JSON: {exc}")
            continue
        yield parse_record(record, source, spec)


def read_parquet(stream: BinaryIO, relpath: str, spec: ReaderSpec) -> Iterator[Document | Rejection]:
    """The records of an open, seekable Parquet file."""
    with pq.ParquetFile(stream) as parquet:
        names = set(parquet.schema_arrow.names)
        if not ({"doc_id", "text"} <= names or {"_id", "context"} <= names):
            yield reject(relpath, None, RejectReason.MALFORMED_RECORD,
                         f"needs columns doc_id+text or _id+context, has {sorted(names)}")
            return
        yield from unique_ids(_parquet_records(parquet, relpath, spec))


def _parquet_records(parquet: pq.ParquetFile, relpath: str, spec: ReaderSpec) -> Iterator[Document | Rejection]:
    row = 0
    for batch in parquet.iter_batches(batch_size=64):
        try:
            records: list[Any] = batch.to_pylist()
        except (UnicodeDecodeError, pa.ArrowException):  # bad UTF-8 somewhere: find the row
            records = [_row_or_error(batch, i) for i in range(batch.num_rows)]
        for record in records:
            source = f"{relpath}#row{row}"
            row += 1
            yield (reject(source, None, RejectReason.INVALID_UTF8, record)
                   if isinstance(record, str) else parse_record(record, source, spec))


def _row_or_error(batch: pa.RecordBatch, index: int) -> dict[str, Any] | str:
    try:
        return batch.slice(index, 1).to_pylist()[0]
    except (UnicodeDecodeError, pa.ArrowException) as exc:
        return f"{type(exc).__name__}: {exc}"
