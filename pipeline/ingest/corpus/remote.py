"""A corpus on an object store (`s3://bucket/prefix`, or any URI pyarrow resolves): listed by the driver, each
file read by whichever Ray task or node gets it, through the store's filesystem code (pipeline/store/filesystem.py:
the store's endpoint and region, credentials from the environment). No node needs a filesystem the others share.

The records are the local readers' (`readers.read_entry`): the same file under the same relative path yields the
same documents and rejections from either place (tests/pipeline/ingest/test_corpus_s3.py). Objects have no links,
modes or
FIFOs, so the local path checks have nothing to refuse here. Page images are the exception: serving reads a
scanned page's pixels from `images_root` on its own disk (pipeline/store/entries.py), which an object key is
not, so an image file in a remote corpus is rejected (`unsupported_file`, quarantined and counted) — copy such a
corpus to a local or mounted directory instead.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator

import pyarrow.fs as pafs

from pipeline.ingest.corpus.records import reject
from pipeline.store.filesystem import resolve_filesystem
from schemas.corpus import CorpusFile, Document, FileFormat, ReaderSpec, Rejection, RejectReason
from schemas.store import StoreSpec

_READ_NBYTES = 1 << 20


def is_remote(corpus: str) -> bool:
    """Whether `corpus` names an object-store location rather than a local path."""
    return "://" in corpus and not corpus.startswith("file://")


def corpus_location(corpus: str, store: StoreSpec) -> StoreSpec | None:
    """Where an object-store corpus lives, reached through `store`'s endpoint and region; None: a local path."""
    if not is_remote(corpus):
        return None
    return StoreSpec(uri=corpus, endpoint_url=store.endpoint_url, region=store.region)


class _Raw(io.RawIOBase):
    """A pyarrow random-access file as a Python raw stream, so `io.BufferedReader` gives it `readline`
    (the JSONL reader's bounded line reads) and Parquet can seek in it."""

    def __init__(self, native):  # a pyarrow.NativeFile
        self.native = native

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.native.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self.native.seek(offset, whence)

    def tell(self) -> int:
        return self.native.tell()

    def close(self) -> None:
        self.native.close()
        super().close()


class RemoteFiles:
    """The object store under one corpus location: list it, size and open its objects."""

    def __init__(self, location: StoreSpec):
        self.location = location
        self.fs, self.root = resolve_filesystem(location, None)

    def discover(self) -> tuple[list[CorpusFile], list[Rejection]]:
        """Every object under the location, sorted by relative path, as `readers.discover` lists a folder
        (a single object: itself, relative to its parent). A location that holds nothing is an error."""
        from pipeline.ingest.corpus.readers import CorpusError, corpus_file

        try:
            info = self.fs.get_file_info(self.root)
            if info.type == pafs.FileType.File:
                parent = self.root.rsplit("/", 1)[0]
                return [corpus_file(self.root, parent)], []
            if info.type != pafs.FileType.Directory:
                raise CorpusError(f"corpus {self.location.uri!r} does not exist")
            infos = self.fs.get_file_info(pafs.FileSelector(self.root, recursive=True))
        except OSError as error:  # no such bucket, no credentials, endpoint unreachable: say so, no traceback
            raise CorpusError(f"corpus {self.location.uri!r} cannot be listed: {error}") from None
        files = [corpus_file(i.path, self.root) for i in infos if i.type == pafs.FileType.File]
        if not files:
            raise CorpusError(f"corpus {self.location.uri!r} holds no objects")
        return sorted(files, key=lambda f: f.relpath), []

    def size(self, path: str) -> int:
        return self.fs.get_file_info(path).size

    def open(self, path: str) -> io.BufferedReader:
        return io.BufferedReader(_Raw(self.fs.open_input_file(path)), buffer_size=_READ_NBYTES)

    def read(self, entry: CorpusFile, spec: ReaderSpec) -> Iterator[Document | Rejection]:
        """Documents and rejections of one object, as the local reader yields them for the same file."""
        from pipeline.ingest.corpus.readers import read_entry

        if entry.format is FileFormat.IMAGE:
            yield reject(entry.relpath, None, RejectReason.UNSUPPORTED_FILE,
                         "page images are read from a local corpus only (serving reads their pixels from "
                         "images_root): copy this corpus to a local or mounted directory")
            return
        yield from read_entry(entry, self, spec)

    def digest(self) -> str:
        """sha256 over every object's relative path, size and contents, in path order (`record.corpus_digest`'s
        definition for a local folder)."""
        files, _ = self.discover()
        digest = hashlib.sha256()
        for f in files:
            content, size = hashlib.sha256(), 0
            with self.fs.open_input_stream(f.path) as stream:
                while block := stream.read(_READ_NBYTES):
                    content.update(block)
                    size += len(block)
            digest.update(json.dumps([f.relpath, size, content.hexdigest()]).encode())
        return digest.hexdigest()
