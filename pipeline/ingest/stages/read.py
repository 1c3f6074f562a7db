"""The read stage: corpus files → one row per input record (a document or a rejection) and one FILE row each.

A Ray Data batch UDF over file rows (`path`, `root`, `relpath`) whose output is pipeline rows
(pipeline/ingest/rows.py).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from pipeline.ingest.corpus import DocRef, RemoteFiles, file_format, read_file, source_order_key
from pipeline.ingest.rows import Kind, require_columns, rows_table
from schemas.corpus import CorpusFile, ReaderSpec, Rejection, RejectReason
from schemas.store import StoreSpec

NEEDS = ("path", "root", "relpath")
ADDS = ("kind", "key", "doc_id", "source", "order_key", "text", "metadata_json", "text_key", "image_phash",
        "image_path", "reason", "detail", "count")


def rejected_row(rejection: Rejection) -> dict[str, Any]:
    return {"kind": Kind.REJECTED.value, "key": rejection.doc_id or "", "doc_id": rejection.doc_id,
            "source": rejection.source, "reason": RejectReason(rejection.reason).value, "detail": rejection.detail}


def read_files(batch: pa.Table, reader: ReaderSpec, location: StoreSpec | None = None) -> pa.Table:
    """Each file → one row per input record (a document or a rejection) and one FILE row counting them.
    `location`: the files are objects there (read through the object store, by whichever node runs this)."""
    require_columns(batch, NEEDS, "read")
    remote = None if location is None else RemoteFiles(location)
    rows: list[dict[str, Any]] = []
    for path, root, relpath in zip(*(batch[c].to_pylist() for c in NEEDS)):
        count = 0
        records = (read_file(path, root, reader) if remote is None
                   else remote.read(CorpusFile(path=path, root=root, relpath=relpath,
                                               format=file_format(path)), reader))
        for record in records:
            count += 1
            if isinstance(record, Rejection):
                rows.append(rejected_row(record))
                continue
            ref = DocRef.of(record)
            rows.append({"kind": Kind.DOC.value, "key": record.doc_id, **record.to_row(),
                         "order_key": source_order_key(record.source, record.doc_id), "text_key": ref.text_key,
                         "image_phash": ref.image_phash, "image_path": record.image_path})
        rows.append({"kind": Kind.FILE.value, "key": "", "source": relpath, "count": count})
    return rows_table(rows)
