"""Corpus readers: list the files under a root, turn each into `Document`s and `Rejection`s.

`read_file(path, root)` is pure and per file, so a Ray Data `flat_map` over `discover(root)` reads a
corpus in parallel. Checks that need every file (ids repeated across files, near-duplicate page
images) run afterwards in `pipeline.ingest.corpus.repeats` over small `DocRef` rows. Every input record
(JSONL line, Parquet row, text file, image) ends as exactly one Document or one Rejection.
`read_corpus` is the whole sequence in one process: the semantics the Ray ingest job distributes.

Text policy, applied to every format: CRLF/CR and form feeds become "\\n"; a NUL anywhere rejects
the record (binary data, not prose); other C0/C1 control characters are removed and counted in
`MetaKey.REMOVED_CONTROL_CHARS`; tabs, zero-width and bidi characters are kept as they are.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.ingest.corpus.repeats import DocRef, cross_file_rejections
from pipeline.ingest.corpus.page_images import read_page_image
from schemas.corpus import (RESERVED_META_PREFIX, CorpusFile, Document, FileFormat, MetaKey, ReaderSpec,
                            RejectReason, Rejection)

_FORMATS = {".jsonl": FileFormat.JSONL, ".ndjson": FileFormat.JSONL, ".parquet": FileFormat.PARQUET,
            ".txt": FileFormat.TEXT, ".md": FileFormat.TEXT, ".markdown": FileFormat.TEXT,
            ".png": FileFormat.IMAGE, ".jpg": FileFormat.IMAGE, ".jpeg": FileFormat.IMAGE}
_NEWLINES = re.compile(r"\r\n?|\f")
_CONTROLS = re.compile(r"[\x01-\x08\x0b\x0e-\x1f\x7f-\x9f]")  # keeps \t \n; \r \f are rewritten first
_SURROGATES = re.compile(r"[\ud800-\udfff]")
_SKIP_CHUNK_NBYTES = 1 << 20


class CorpusError(ValueError):
    """The corpus root itself is unusable (missing); bad records are quarantined instead."""


def discover(root: str) -> tuple[list[CorpusFile], list[Rejection]]:
    """Entries under `root` (a file or a folder) sorted by relative path, and names that are refused.

    Links are listed, not followed: `read_file` rejects those that resolve outside the root, and
    linked folders inside the root are skipped because the walk already reaches their target. A file
    name that is not valid UTF-8 is refused here, since it could not travel as an Arrow string.
    """
    if not os.path.lexists(root):
        raise CorpusError(f"corpus root {root!r} does not exist")
    if _SURROGATES.search(os.path.abspath(root)):
        raise CorpusError(f"corpus root {_printable(root)!r} is not a valid UTF-8 path")
    if not os.path.isdir(root):
        entries = [_entry(os.path.abspath(root), os.path.dirname(os.path.abspath(root)))]
    else:
        entries = []
        real_root = os.path.realpath(root)
        for folder, dirnames, filenames in os.walk(root, followlinks=False):
            for name in dirnames:
                link = os.path.join(folder, name)
                if os.path.islink(link) and not _inside(os.path.realpath(link), real_root):
                    entries.append(_entry(link, root))
            entries.extend(_entry(os.path.join(folder, name), root) for name in filenames)
    files = sorted((e for e in entries if not _SURROGATES.search(e.relpath)), key=lambda e: e.relpath)
    refused = [_reject(_printable(e.relpath), None, RejectReason.INVALID_UTF8, "file name is not valid UTF-8")
               for e in entries if _SURROGATES.search(e.relpath)]
    return files, sorted(refused, key=lambda r: r.source)


def _printable(name: str) -> str:
    """A file name's undecodable bytes as `\\xNN`, so the name can be stored and shown."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _entry(path: str, root: str) -> CorpusFile:
    ext = os.path.splitext(path)[1].lower()
    return CorpusFile(path=path, root=root, relpath=os.path.relpath(path, root),
                      format=_FORMATS.get(ext, FileFormat.UNSUPPORTED))


def _inside(real_path: str, real_root: str) -> bool:
    return os.path.commonpath([real_path, real_root]) == real_root


def read_file(path: str, root: str, spec: ReaderSpec = ReaderSpec()) -> Iterator[Document | Rejection]:
    """Documents and rejections of one file; ids are unique within the file."""
    if _SURROGATES.search(path):
        yield _reject(_printable(os.path.basename(path)), None, RejectReason.INVALID_UTF8,
                      "file name is not valid UTF-8")
        return
    base = root if os.path.isdir(root) else os.path.dirname(os.path.abspath(root))
    entry = _entry(path, base)
    real_root = os.path.realpath(base)
    if not _inside(os.path.realpath(path), real_root):
        yield _reject(entry.relpath, None, RejectReason.PATH_OUTSIDE_ROOT,
                      f"resolves to {os.path.realpath(path)!r}, outside {real_root!r}")
        return
    if not os.path.isfile(path):  # a dangling link, a folder link, a FIFO that would block a read
        yield _reject(entry.relpath, None, RejectReason.UNREADABLE_FILE, "not a readable regular file")
        return
    if entry.format is FileFormat.UNSUPPORTED:
        yield _reject(entry.relpath, None, RejectReason.UNSUPPORTED_FILE,
                      f"extension {os.path.splitext(path)[1]!r} is not one of {sorted(_FORMATS)}")
        return
    try:
        if entry.format is FileFormat.JSONL:
            yield from _read_jsonl(path, entry.relpath, spec)
        elif entry.format is FileFormat.PARQUET:
            yield from _read_parquet(path, entry.relpath, spec)
        elif entry.format is FileFormat.TEXT:
            yield _read_text(path, entry.relpath, spec)
        else:
            yield _page_image_document(path, entry.relpath, spec)
    except (OSError, pa.ArrowException) as exc:  # records yielded before the failure stand
        yield _reject(entry.relpath, None, RejectReason.UNREADABLE_FILE, f"{type(exc).__name__}: {exc}")


def _reject(source: str, doc_id: str | None, reason: RejectReason, detail: str) -> Rejection:
    return Rejection(source=source, doc_id=doc_id, reason=reason, detail=detail)


def _clean_text(text: Any, doc_id: str, source: str, spec: ReaderSpec,
                empty: RejectReason = RejectReason.EMPTY_TEXT) -> tuple[str, int] | Rejection:
    """(text, control characters removed) under the module's text policy, or why it is rejected."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            return _reject(source, doc_id, RejectReason.INVALID_UTF8, f"text: {exc}")
    if not isinstance(text, str):
        return _reject(source, doc_id, RejectReason.NON_STRING_TEXT, f"text is {type(text).__name__}")
    if len(text) > spec.max_doc_chars:
        return _reject(source, doc_id, RejectReason.TOO_LARGE,
                       f"{len(text)} characters > max_doc_chars {spec.max_doc_chars}")
    if (nul := text.find("\x00")) >= 0:
        return _reject(source, doc_id, RejectReason.CONTROL_CHARACTERS, f"NUL at character {nul}")
    if (bad := _SURROGATES.search(text)) is not None:
        return _reject(source, doc_id, RejectReason.INVALID_UTF8, f"lone surrogate at character {bad.start()}")
    text, num_removed = _CONTROLS.subn("", _NEWLINES.sub("\n", text))
    if not text.strip():
        return _reject(source, doc_id, empty, "no text" if empty is RejectReason.OCR_EMPTY else "text is blank")
    return text, num_removed


def _document(doc_id: str, text: Any, source: str, metadata: dict[str, str], spec: ReaderSpec,
              empty: RejectReason = RejectReason.EMPTY_TEXT) -> Document | Rejection:
    cleaned = _clean_text(text, doc_id, source, spec, empty)
    if isinstance(cleaned, Rejection):
        return cleaned
    clean, num_removed = cleaned
    if num_removed:
        metadata = {**metadata, MetaKey.REMOVED_CONTROL_CHARS.value: str(num_removed)}
    return Document(doc_id=doc_id, text=clean, source=source, metadata=metadata)


def _doc_id(value: Any, spec: ReaderSpec) -> str | tuple[RejectReason, str]:
    if value is None or (isinstance(value, str) and not value.strip()):
        return RejectReason.MISSING_ID, "no doc_id"
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        return RejectReason.MALFORMED_RECORD, f"doc_id must be a string, got {type(value).__name__}"
    if len(value) > spec.max_doc_id_chars or _CONTROLS.search(value) or _SURROGATES.search(value) \
            or any(c in value for c in "\x00\t\n\r\f"):
        return RejectReason.MALFORMED_RECORD, "doc_id is too long or holds control characters"
    return value


def _metadata(explicit: Any, extras: dict[str, Any]) -> dict[str, str] | str:
    """User metadata as strings (non-strings JSON-encoded), or the reason it is malformed."""
    if isinstance(explicit, list):  # an Arrow map column arrives as (key, value) pairs
        explicit = dict(explicit) if all(isinstance(p, tuple) and len(p) == 2 for p in explicit) else explicit
    if explicit is not None and not isinstance(explicit, dict):
        return f"metadata must be an object, got {type(explicit).__name__}"
    merged = {**extras, **(explicit or {})}
    out: dict[str, str] = {}
    for key, value in merged.items():
        if not isinstance(key, str) or key.startswith(RESERVED_META_PREFIX):
            return f"metadata key {key!r} is not a string or uses the reserved prefix {RESERVED_META_PREFIX!r}"
        try:
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
        except RecursionError:  # parsed just under the limit, then re-encoded from a deeper stack
            return f"metadata {key!r} is nested too deeply"
        if _SURROGATES.search(key + text):
            return f"metadata {key!r} holds a lone surrogate"
        out[key] = text
    return out


def _record(record: Any, source: str, spec: ReaderSpec) -> Document | Rejection:
    """A parsed JSONL/Parquet record: `{doc_id, text, metadata?}` or LongBench `{_id, context, ...}`."""
    if not isinstance(record, dict):
        return _reject(source, None, RejectReason.MALFORMED_RECORD, f"record is {type(record).__name__}, not an object")
    longbench = "text" not in record and "doc_id" not in record and "context" in record and "_id" in record
    id_key, text_key = ("_id", "context") if longbench else ("doc_id", "text")
    doc_id = _doc_id(record.get(id_key), spec)
    if isinstance(doc_id, tuple):
        return _reject(source, None, *doc_id)
    if text_key not in record:
        return _reject(source, doc_id, RejectReason.MALFORMED_RECORD, f"record has no {text_key!r} field")
    extras = {k: v for k, v in record.items() if k not in (id_key, text_key, "metadata") and v is not None}
    metadata = _metadata(record.get("metadata"), extras)
    if isinstance(metadata, str):
        return _reject(source, doc_id, RejectReason.MALFORMED_RECORD, metadata)
    return _document(doc_id, record[text_key], source, metadata, spec)


def _unique(items: Iterable[Document | Rejection]) -> Iterator[Document | Rejection]:
    first_source: dict[str, str] = {}
    for item in items:
        if isinstance(item, Document):
            if item.doc_id in first_source:
                item = _reject(item.source, item.doc_id, RejectReason.DUPLICATE_ID,
                               f"doc_id already used at {first_source[item.doc_id]}")
            else:
                first_source[item.doc_id] = item.source
        yield item


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


def _read_jsonl(path: str, relpath: str, spec: ReaderSpec) -> Iterator[Document | Rejection]:
    with open(path, "rb") as stream:
        yield from _unique(_jsonl_records(stream, relpath, spec))


def _jsonl_records(stream: BinaryIO, relpath: str, spec: ReaderSpec) -> Iterator[Document | Rejection]:
    for line_no, raw, nbytes in _lines(stream, spec.max_record_nbytes):
        source = f"{relpath}#L{line_no}"
        if raw is None:
            yield _reject(source, None, RejectReason.TOO_LARGE, f"line of {nbytes} bytes > {spec.max_record_nbytes}")
            continue
        if line_no == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield _reject(source, None, RejectReason.INVALID_UTF8, f"byte {exc.start}: {exc.reason}")
            continue
        if not line.strip():  # a blank line is no record
            continue
        try:
            record = json.loads(line)
        except RecursionError:
            yield _reject(source, None, RejectReason.MALFORMED_RECORD, "JSON nested too deeply")
            continue
        except ValueError as exc:
            yield _reject(source, None, RejectReason.MALFORMED_RECORD, f"bad JSON: {exc}")
            continue
        yield _record(record, source, spec)


def _read_parquet(path: str, relpath: str, spec: ReaderSpec) -> Iterator[Document | Rejection]:
    with pq.ParquetFile(path) as parquet:
        names = set(parquet.schema_arrow.names)
        if not ({"doc_id", "text"} <= names or {"_id", "context"} <= names):
            yield _reject(relpath, None, RejectReason.MALFORMED_RECORD,
                          f"needs columns doc_id+text or _id+context, has {sorted(names)}")
            return
        yield from _unique(_parquet_records(parquet, relpath, spec))


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
            yield (_reject(source, None, RejectReason.INVALID_UTF8, record)
                   if isinstance(record, str) else _record(record, source, spec))


def _row_or_error(batch: pa.RecordBatch, index: int) -> dict[str, Any] | str:
    try:
        return batch.slice(index, 1).to_pylist()[0]
    except (UnicodeDecodeError, pa.ArrowException) as exc:
        return f"{type(exc).__name__}: {exc}"


def _file_doc_id(relpath: str, spec: ReaderSpec) -> str | Rejection:
    doc_id = _doc_id(relpath, spec)
    return _reject(relpath, None, *doc_id) if isinstance(doc_id, tuple) else doc_id


def _read_text(path: str, relpath: str, spec: ReaderSpec) -> Document | Rejection:
    doc_id = _file_doc_id(relpath, spec)
    if isinstance(doc_id, Rejection):
        return doc_id
    nbytes = os.path.getsize(path)
    if nbytes > 4 * spec.max_doc_chars:  # UTF-8 spends at most 4 bytes per character
        return _reject(relpath, doc_id, RejectReason.TOO_LARGE, f"{nbytes} bytes > 4 * max_doc_chars")
    with open(path, "rb") as stream:
        raw = stream.read()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        return _reject(relpath, doc_id, RejectReason.INVALID_UTF8, f"byte {exc.start}: {exc.reason}")
    return _document(doc_id, text, relpath, {}, spec)


def _page_image_document(path: str, relpath: str, spec: ReaderSpec) -> Document | Rejection:
    doc_id = _file_doc_id(relpath, spec)
    if isinstance(doc_id, Rejection):
        return doc_id
    page = read_page_image(path, spec)
    if isinstance(page, str):
        return _reject(relpath, doc_id, RejectReason.IMAGE_UNREADABLE, page)
    metadata = {MetaKey.IMAGE_PATH.value: os.path.realpath(path), MetaKey.IMAGE_PHASH.value: page.phash}
    return _document(doc_id, page.ocr_text, relpath, metadata, spec, empty=RejectReason.OCR_EMPTY)


def read_corpus(root: str, spec: ReaderSpec = ReaderSpec()) -> tuple[list[Document], list[Rejection]]:
    """The whole corpus in one process: the reference semantics the Ray ingest job distributes."""
    files, refused = discover(root)
    items = [item for entry in files for item in read_file(entry.path, entry.root, spec)]
    docs = [item for item in items if isinstance(item, Document)]
    rejected = cross_file_rejections([DocRef.of(doc) for doc in docs], spec)
    dropped = {(r.source, r.doc_id) for r in rejected}
    kept = [doc for doc in docs if (doc.source, doc.doc_id) not in dropped]
    return kept, refused + [item for item in items if isinstance(item, Rejection)] + rejected
