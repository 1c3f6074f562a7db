"""From a parsed input record to exactly one `Document` or one `Rejection`, under the corpus text policy.

Text policy, applied to every format: CRLF/CR and form feeds become "\\n"; a NUL anywhere rejects
the record (binary data, not prose); other C0/C1 control characters are removed and counted in
`MetaKey.REMOVED_CONTROL_CHARS`; tabs, zero-width and bidi characters are kept as they are.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from typing import Any

from schemas.corpus import (
    COLLECTION_KEY,
    RESERVED_META_PREFIX,
    Document,
    MetaKey,
    ReaderSpec,
    Rejection,
    RejectReason,
    collection_problem,
)

NEWLINES = re.compile(r"\r\n?|\f")
CONTROLS = re.compile(r"[\x01-\x08\x0b\x0e-\x1f\x7f-\x9f]")  # keeps \t \n; \r \f are rewritten first
SURROGATES = re.compile(r"[\ud800-\udfff]")


def reject(source: str, doc_id: str | None, reason: RejectReason, detail: str) -> Rejection:
    return Rejection(source=source, doc_id=doc_id, reason=reason, detail=detail)


def clean_text(text: Any, doc_id: str, source: str, spec: ReaderSpec,
               empty: RejectReason = RejectReason.EMPTY_TEXT) -> tuple[str, int] | Rejection:
    """(text, control characters removed) under the module's text policy, or why it is rejected."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            return reject(source, doc_id, RejectReason.INVALID_UTF8, f"text: {exc}")
    if not isinstance(text, str):
        return reject(source, doc_id, RejectReason.NON_STRING_TEXT, f"text is {type(text).__name__}")
    if len(text) > spec.max_doc_chars:
        return reject(source, doc_id, RejectReason.TOO_LARGE,
                      f"{len(text)} characters > max_doc_chars {spec.max_doc_chars}")
    if (nul := text.find("\x00")) >= 0:
        return reject(source, doc_id, RejectReason.CONTROL_CHARACTERS, f"NUL at character {nul}")
    if (bad := SURROGATES.search(text)) is not None:
        return reject(source, doc_id, RejectReason.INVALID_UTF8, f"lone surrogate at character {bad.start()}")
    text, num_removed = CONTROLS.subn("", NEWLINES.sub("\n", text))
    if not text.strip():
        return reject(source, doc_id, empty, "no text" if empty is RejectReason.OCR_EMPTY else "text is blank")
    return text, num_removed


def document(doc_id: str, text: Any, source: str, metadata: dict[str, str], spec: ReaderSpec,
             empty: RejectReason = RejectReason.EMPTY_TEXT) -> Document | Rejection:
    cleaned = clean_text(text, doc_id, source, spec, empty)
    if isinstance(cleaned, Rejection):
        return cleaned
    clean, num_removed = cleaned
    if num_removed:
        metadata = {**metadata, MetaKey.REMOVED_CONTROL_CHARS.value: str(num_removed)}
    return Document(doc_id=doc_id, text=clean, source=source, metadata=metadata)


def parse_doc_id(value: Any, spec: ReaderSpec) -> str | tuple[RejectReason, str]:
    if value is None or (isinstance(value, str) and not value.strip()):
        return RejectReason.MISSING_ID, "no doc_id"
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        return RejectReason.MALFORMED_RECORD, f"doc_id must be a string, got {type(value).__name__}"
    if len(value) > spec.max_doc_id_chars or CONTROLS.search(value) or SURROGATES.search(value) \
            or any(c in value for c in "\x00\t\n\r\f"):
        return RejectReason.MALFORMED_RECORD, "doc_id is too long or holds control characters"
    return value


def parse_metadata(explicit: Any, extras: dict[str, Any]) -> dict[str, str] | str:
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
        if SURROGATES.search(key + text):
            return f"metadata {key!r} holds a lone surrogate"
        out[key] = text
    # a document in a misspelt collection would be readable by nobody (or by the wrong tenant): refused here
    problem = collection_problem(out[COLLECTION_KEY]) if COLLECTION_KEY in out else None
    return problem or out


def parse_record(record: Any, source: str, spec: ReaderSpec) -> Document | Rejection:
    """A parsed JSONL/Parquet record: `{doc_id, text, metadata?}` or LongBench `{_id, context, ...}`."""
    if not isinstance(record, dict):
        return reject(source, None, RejectReason.MALFORMED_RECORD, f"record is {type(record).__name__}, not an object")
    longbench = "text" not in record and "doc_id" not in record and "context" in record and "_id" in record
    id_key, text_key = ("_id", "context") if longbench else ("doc_id", "text")
    doc_id = parse_doc_id(record.get(id_key), spec)
    if isinstance(doc_id, tuple):
        return reject(source, None, *doc_id)
    if text_key not in record:
        return reject(source, doc_id, RejectReason.MALFORMED_RECORD, f"record has no {text_key!r} field")
    extras = {k: v for k, v in record.items() if k not in (id_key, text_key, "metadata") and v is not None}
    metadata = parse_metadata(record.get("metadata"), extras)
    if isinstance(metadata, str):
        return reject(source, doc_id, RejectReason.MALFORMED_RECORD, metadata)
    return document(doc_id, record[text_key], source, metadata, spec)


def unique_ids(items: Iterable[Document | Rejection]) -> Iterator[Document | Rejection]:
    first_source: dict[str, str] = {}
    for item in items:
        if isinstance(item, Document):
            if item.doc_id in first_source:
                item = reject(item.source, item.doc_id, RejectReason.DUPLICATE_ID,
                              f"doc_id already used at {first_source[item.doc_id]}")
            else:
                first_source[item.doc_id] = item.source
        yield item


def file_doc_id(relpath: str, spec: ReaderSpec) -> str | Rejection:
    doc_id = parse_doc_id(relpath, spec)
    return reject(relpath, None, *doc_id) if isinstance(doc_id, tuple) else doc_id
