"""Data contracts of the corpus stage: documents, chunks, reader limits and quarantine reasons.

Every input record becomes exactly one `Document` or one `Rejection`; chunks are content-addressed
by `chunk_key`, the sha256 of the chunk's normalised text (see `normalise_chunk_text`).
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Mapping
from enum import Enum
from typing import Any

from pydantic import Field

from schemas.frozen import Frozen

# Metadata keys the readers set. User metadata may not use the prefix, so a JSONL record can never
# pose as a page image by carrying its own `image_path`.
RESERVED_META_PREFIX = "qvpic."

# Collections: who may read a document. Each document names its collection in this user metadata field
# (`{"doc_id": …, "text": …, "metadata": {"collection": "acme"}}`); one that names none is in the default
# collection, as is every chunk of a store ingested before collections existed. Keys are granted
# collections in the serving config (serve/governance/config.py `AuthConfig.collections`).
COLLECTION_KEY = "collection"
DEFAULT_COLLECTION = "public"
ALL_COLLECTIONS = "*"  # in a grant: every collection, present and future (an operator's key)
COLLECTION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,63}$"  # a tenant label's alphabet (schemas.api.Label)


def collection_problem(value: str) -> str | None:
    """Why `value` is not a collection name, or None."""
    if re.fullmatch(COLLECTION_PATTERN, value):
        return None
    return f"metadata {COLLECTION_KEY!r} must be 1-64 characters of [A-Za-z0-9_.:@-], got {value[:80]!r}"


class MetaKey(str, Enum):
    IMAGE_PATH = "qvpic.image_path"  # absolute path of the page image an OCR document came from
    IMAGE_PHASH = "qvpic.image_phash"  # 64-bit DCT perceptual hash, 16 hex digits
    REMOVED_CONTROL_CHARS = "qvpic.removed_control_chars"  # count of control characters stripped


class RejectReason(str, Enum):
    EMPTY_TEXT = "empty_text"
    MISSING_ID = "missing_id"
    DUPLICATE_ID = "duplicate_id"
    NON_STRING_TEXT = "non_string_text"
    INVALID_UTF8 = "invalid_utf8"  # undecodable bytes, or lone surrogates smuggled in via JSON escapes
    CONTROL_CHARACTERS = "control_characters"  # NUL in the text: binary data, not prose
    MALFORMED_RECORD = "malformed_record"  # bad JSON line, wrong field types, too deeply nested
    TOO_LARGE = "too_large"
    UNSUPPORTED_FILE = "unsupported_file"
    UNREADABLE_FILE = "unreadable_file"  # I/O error, dangling link, corrupt container
    IMAGE_UNREADABLE = "image_unreadable"  # truncated, not an image, or a decompression bomb
    PATH_OUTSIDE_ROOT = "path_outside_root"  # a link that escapes the corpus root
    NEAR_DUPLICATE_IMAGE = "near_duplicate_image"
    OCR_EMPTY = "ocr_empty"
    RENDER_FAILED = "render_failed"
    COMPILE_FAILED = "compile_failed"


class FileFormat(str, Enum):
    JSONL = "jsonl"  # {doc_id, text, metadata?} or LongBench {_id, context, ...} per line
    PARQUET = "parquet"  # same columns as JSONL
    TEXT = "text"  # one .txt/.md file is one document, doc_id = path relative to the root
    IMAGE = "image"  # one PNG/JPEG page is one document, text = OCR
    UNSUPPORTED = "unsupported"


class ReaderSpec(Frozen):
    """Limits of the readers. Exceeding one quarantines the record; it never stops the job."""

    max_doc_chars: int = Field(5_000_000, ge=1)
    max_doc_id_chars: int = Field(1024, ge=1)
    max_image_pixels: int = Field(50_000_000, ge=1)  # a 600-DPI A4 page is ~35 Mpx
    ocr_lang: str = Field("eng", pattern=r"^[A-Za-z0-9_+]+$")
    ocr_timeout_s: float = Field(120.0, gt=0)
    # Images are near-duplicates when their OCR texts are equal AND their pHashes are this close.
    # pHash alone merges pages that differ by one digit, so it is never trusted on its own.
    max_phash_distance_bits: int = Field(6, ge=0, le=64)

    @property
    def max_record_nbytes(self) -> int:
        """Longest JSONL line read: a JSON `\\uXXXX` escape spends 6 bytes per character, plus slack."""
        return 6 * self.max_doc_chars + (1 << 20)


class CorpusFile(Frozen):
    """One entry found under a corpus root; `read_file(path, root)` turns it into records."""

    path: str
    root: str
    relpath: str
    format: FileFormat


class Document(Frozen):
    doc_id: str = Field(min_length=1)
    text: str
    source: str  # relative file path, plus `#L<line>` (JSONL, 1-based) or `#row<n>` (Parquet, 0-based)
    metadata: dict[str, str] = Field(default_factory=dict)

    @property
    def image_path(self) -> str | None:
        return self.metadata.get(MetaKey.IMAGE_PATH.value)

    @property
    def collection(self) -> str:
        return self.metadata.get(COLLECTION_KEY, DEFAULT_COLLECTION)

    def to_row(self) -> dict[str, str]:
        """A flat row for Ray Data / Arrow: metadata keys differ per document, so they travel as JSON."""
        return {"doc_id": self.doc_id, "text": self.text, "source": self.source,
                "metadata_json": json.dumps(self.metadata, ensure_ascii=False, sort_keys=True)}

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> "Document":
        return cls(doc_id=row["doc_id"], text=row["text"], source=row["source"],
                   metadata=json.loads(row["metadata_json"]))


class Rejection(Frozen):
    """One quarantined input; field names are the quarantine table's columns."""

    source: str
    doc_id: str | None
    reason: RejectReason
    detail: str


class Chunk(Frozen):
    chunk_id: str  # f"{doc_id}#{order:05d}"
    doc_id: str
    order: int = Field(ge=0)
    text: str
    chunk_key: str = Field(pattern=r"^[0-9a-f]{64}$")
    num_text_tokens: int = Field(ge=0)

    @classmethod
    def build(cls, doc_id: str, order: int, text: str, num_text_tokens: int) -> "Chunk":
        return cls(chunk_id=f"{doc_id}#{order:05d}", doc_id=doc_id, order=order, text=text,
                   chunk_key=chunk_key(text), num_text_tokens=num_text_tokens)


def normalise_chunk_text(text: str) -> str:
    """NFC, no trailing whitespace on any line, no blank lines at either end.

    Two chunks that differ only in trailing spaces, leading/trailing blank lines or Unicode
    composition render identically, so they share one key (and one compiled cache entry).
    """
    lines = [line.rstrip() for line in unicodedata.normalize("NFC", text).split("\n")]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def chunk_key(text: str) -> str:
    """sha256 hex of the normalised text; lone surrogates are encoded, never an exception."""
    return hashlib.sha256(normalise_chunk_text(text).encode("utf-8", "surrogatepass")).hexdigest()
