"""Corpus readers: list the files under a root, turn each into `Document`s and `Rejection`s.

`read_file(path, root)` is pure and per file, so a Ray Data `flat_map` over `discover(root)` reads a
corpus in parallel. Checks that need every file (ids repeated across files, near-duplicate page
images) run afterwards in `pipeline.ingest.corpus.repeats` over small `DocRef` rows. Every input record
(JSONL line, Parquet row, text file, image) ends as exactly one Document or one Rejection.
`read_corpus` is the whole sequence in one process: the semantics the Ray ingest job distributes.
Record files (JSONL, Parquet) are read in `record_files.py`; every record, of every format, becomes a
Document under the text policy of `records.py`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import BinaryIO

import pyarrow as pa

from pipeline.ingest.corpus.page_images import read_page_image
from pipeline.ingest.corpus.record_files import read_jsonl, read_parquet
from pipeline.ingest.corpus.records import SURROGATES, document, file_doc_id, reject
from pipeline.ingest.corpus.repeats import DocRef, cross_file_rejections
from schemas.corpus import CorpusFile, Document, FileFormat, MetaKey, ReaderSpec, Rejection, RejectReason

_FORMATS = {".jsonl": FileFormat.JSONL, ".ndjson": FileFormat.JSONL, ".parquet": FileFormat.PARQUET,
            ".txt": FileFormat.TEXT, ".md": FileFormat.TEXT, ".markdown": FileFormat.TEXT,
            ".png": FileFormat.IMAGE, ".jpg": FileFormat.IMAGE, ".jpeg": FileFormat.IMAGE}


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
    if SURROGATES.search(os.path.abspath(root)):
        raise CorpusError(f"corpus root {_printable(root)!r} is not a valid UTF-8 path")
    if not os.path.isdir(root):
        entries = [corpus_file(os.path.abspath(root), os.path.dirname(os.path.abspath(root)))]
    else:
        entries = []
        real_root = os.path.realpath(root)
        for folder, dirnames, filenames in os.walk(root, followlinks=False):
            for name in dirnames:
                link = os.path.join(folder, name)
                if os.path.islink(link) and not _inside(os.path.realpath(link), real_root):
                    entries.append(corpus_file(link, root))
            entries.extend(corpus_file(os.path.join(folder, name), root) for name in filenames)
    files = sorted((e for e in entries if not SURROGATES.search(e.relpath)), key=lambda e: e.relpath)
    refused = [reject(_printable(e.relpath), None, RejectReason.INVALID_UTF8, "file name is not valid UTF-8")
               for e in entries if SURROGATES.search(e.relpath)]
    return files, sorted(refused, key=lambda r: r.source)


def _printable(name: str) -> str:
    """A file name's undecodable bytes as `\\xNN`, so the name can be stored and shown."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def file_format(path: str) -> FileFormat:
    return _FORMATS.get(os.path.splitext(path)[1].lower(), FileFormat.UNSUPPORTED)


def corpus_file(path: str, root: str) -> CorpusFile:
    """The entry of `path` found under `root` (its format from its extension)."""
    return CorpusFile(path=path, root=root, relpath=os.path.relpath(path, root), format=file_format(path))


class LocalFiles:
    """Files on this machine's disk, as `read_entry` reads them (remote.RemoteFiles: on an object store)."""

    @staticmethod
    def size(path: str) -> int:
        return os.path.getsize(path)

    @staticmethod
    def open(path: str) -> BinaryIO:
        return open(path, "rb")


def _inside(real_path: str, real_root: str) -> bool:
    return os.path.commonpath([real_path, real_root]) == real_root


def read_file(path: str, root: str, spec: ReaderSpec = ReaderSpec()) -> Iterator[Document | Rejection]:
    """Documents and rejections of one file; ids are unique within the file."""
    if SURROGATES.search(path):
        yield reject(_printable(os.path.basename(path)), None, RejectReason.INVALID_UTF8,
                     "file name is not valid UTF-8")
        return
    base = root if os.path.isdir(root) else os.path.dirname(os.path.abspath(root))
    entry = corpus_file(path, base)
    real_root = os.path.realpath(base)
    if not _inside(os.path.realpath(path), real_root):
        yield reject(entry.relpath, None, RejectReason.PATH_OUTSIDE_ROOT,
                     f"resolves to {os.path.realpath(path)!r}, outside {real_root!r}")
        return
    if not os.path.isfile(path):  # a dangling link, a folder link, a FIFO that would block a read
        yield reject(entry.relpath, None, RejectReason.UNREADABLE_FILE, "not a readable regular file")
        return
    yield from read_entry(entry, LocalFiles(), spec)


def read_entry(entry: CorpusFile, files, spec: ReaderSpec) -> Iterator[Document | Rejection]:
    """Documents and rejections of one listed file, read through `files` (`LocalFiles`, or an object store's
    `remote.RemoteFiles`): the one place a format maps to its reader."""
    if entry.format is FileFormat.UNSUPPORTED:
        yield reject(entry.relpath, None, RejectReason.UNSUPPORTED_FILE,
                     f"extension {os.path.splitext(entry.path)[1]!r} is not one of {sorted(_FORMATS)}")
        return
    try:
        if entry.format is FileFormat.JSONL:
            with files.open(entry.path) as stream:
                yield from read_jsonl(stream, entry.relpath, spec)
        elif entry.format is FileFormat.PARQUET:
            with files.open(entry.path) as stream:
                yield from read_parquet(stream, entry.relpath, spec)
        elif entry.format is FileFormat.TEXT:
            yield _read_text(files, entry.path, entry.relpath, spec)
        else:
            yield _page_image_document(entry.path, entry.relpath, spec)
    except (OSError, pa.ArrowException) as exc:  # records yielded before the failure stand
        yield reject(entry.relpath, None, RejectReason.UNREADABLE_FILE, f"{type(exc).__name__}: {exc}")


def _read_text(files, path: str, relpath: str, spec: ReaderSpec) -> Document | Rejection:
    doc_id = file_doc_id(relpath, spec)
    if isinstance(doc_id, Rejection):
        return doc_id
    nbytes = files.size(path)
    if nbytes > 4 * spec.max_doc_chars:  # UTF-8 spends at most 4 bytes per character
        return reject(relpath, doc_id, RejectReason.TOO_LARGE, f"{nbytes} bytes > 4 * max_doc_chars")
    with files.open(path) as stream:
        raw = stream.read()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        return reject(relpath, doc_id, RejectReason.INVALID_UTF8, f"byte {exc.start}: {exc.reason}")
    return document(doc_id, text, relpath, {}, spec)


def _page_image_document(path: str, relpath: str, spec: ReaderSpec) -> Document | Rejection:
    doc_id = file_doc_id(relpath, spec)
    if isinstance(doc_id, Rejection):
        return doc_id
    page = read_page_image(path, spec)
    if isinstance(page, str):
        return reject(relpath, doc_id, RejectReason.IMAGE_UNREADABLE, page)
    metadata = {MetaKey.IMAGE_PATH.value: os.path.realpath(path), MetaKey.IMAGE_PHASH.value: page.phash}
    return document(doc_id, page.ocr_text, relpath, metadata, spec, empty=RejectReason.OCR_EMPTY)


def read_corpus(root: str, spec: ReaderSpec = ReaderSpec()) -> tuple[list[Document], list[Rejection]]:
    """The whole corpus in one process: the reference semantics the Ray ingest job distributes."""
    files, refused = discover(root)
    items = [item for entry in files for item in read_file(entry.path, entry.root, spec)]
    docs = [item for item in items if isinstance(item, Document)]
    rejected = cross_file_rejections([DocRef.of(doc) for doc in docs], spec)
    dropped = {(r.source, r.doc_id) for r in rejected}
    kept = [doc for doc in docs if (doc.source, doc.doc_id) not in dropped]
    return kept, refused + [item for item in items if isinstance(item, Rejection)] + rejected
