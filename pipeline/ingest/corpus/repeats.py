"""Documents that repeat across files: reused ids and near-duplicate page images.

These checks need every file, so they run after the per-file readers, on `DocRef`s: a few short
strings per document, never its text, so a Ray job can collect them on the driver.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from pipeline.ingest.corpus.page_images import phash_distance_bits
from schemas.corpus import Document, MetaKey, ReaderSpec, Rejection, RejectReason, chunk_key
from schemas.frozen import Frozen

_RECORD_SUFFIX = re.compile(r"#(?:L|row)(\d+)$")  # the readers' `#L<line>` / `#row<n>` source suffixes


class DocRef(Frozen):
    """What the cross-file checks need of a document: a few short strings, never its text."""

    source: str
    doc_id: str
    text_key: str
    image_phash: str | None = None

    @classmethod
    def of(cls, doc: Document) -> "DocRef":
        return cls(source=doc.source, doc_id=doc.doc_id, text_key=chunk_key(doc.text),
                   image_phash=doc.metadata.get(MetaKey.IMAGE_PHASH.value))


def source_order_key(source: str, doc_id: str) -> str:
    """A string that sorts documents in (file path, record number, doc id) order: record numbers compare
    as numbers, so `a.jsonl#L9` comes before `a.jsonl#L10`. Distributed stages sort on it."""
    located = _RECORD_SUFFIX.search(source)
    path, record = (source, -1) if located is None else (source[:located.start()], int(located.group(1)))
    return f"{path}\x00{record + 1:012d}\x00{doc_id}"


def _source_order(ref: DocRef) -> str:
    return source_order_key(ref.source, ref.doc_id)


def duplicate_id_rejections(refs: Iterable[DocRef]) -> list[Rejection]:
    """Documents whose id an earlier document (in source order) already uses."""
    rejections: list[Rejection] = []
    first_source: dict[str, str] = {}
    for ref in sorted(refs, key=_source_order):
        if ref.doc_id in first_source:
            rejections.append(Rejection(source=ref.source, doc_id=ref.doc_id, reason=RejectReason.DUPLICATE_ID,
                                        detail=f"doc_id already used at {first_source[ref.doc_id]}"))
        else:
            first_source[ref.doc_id] = ref.source
    return rejections


def near_duplicate_images(refs: Iterable[DocRef], spec: ReaderSpec = ReaderSpec()) -> list[Rejection]:
    """Page images whose OCR text equals an earlier kept image's and whose pHash is within
    `spec.max_phash_distance_bits` of it; the first in source order is kept."""
    rejections: list[Rejection] = []
    kept_images: dict[str, list[DocRef]] = {}  # text_key -> kept images with that OCR text
    for ref in sorted((r for r in refs if r.image_phash is not None), key=_source_order):
        same_text = kept_images.setdefault(ref.text_key, [])
        distances = [(phash_distance_bits(kept.image_phash or "", ref.image_phash or ""), kept) for kept in same_text]
        near = [(bits, kept) for bits, kept in distances if bits <= spec.max_phash_distance_bits]
        if not near:
            same_text.append(ref)
            continue
        bits, twin = min(near, key=lambda pair: pair[0])
        rejections.append(Rejection(source=ref.source, doc_id=ref.doc_id, reason=RejectReason.NEAR_DUPLICATE_IMAGE,
                                    detail=f"same OCR text as {twin.source}, pHash {bits} bits apart"))
    return rejections


def cross_file_rejections(refs: Iterable[DocRef], spec: ReaderSpec = ReaderSpec()) -> list[Rejection]:
    """Rejections for ids already used by another file and for near-duplicate page images.

    The first document in (file path, record number) order wins, whatever order the refs come in.
    Images are near-duplicates only when their OCR texts match and their pHashes are within
    `spec.max_phash_distance_bits`: a re-encoded scan is dropped, a page with one changed figure is not.
    """
    refs = list(refs)
    by_id = duplicate_id_rejections(refs)
    dropped = {(r.source, r.doc_id) for r in by_id}
    return by_id + near_duplicate_images([r for r in refs if (r.source, r.doc_id) not in dropped], spec)
