"""Atomic blob I/O under one root on any pyarrow filesystem (local disk, S3, anything fsspec-backed).

A blob is either absent or complete: locally a write goes to a temp file, is fsynced and renamed over
the target; on object stores it is one PUT (or one completed multipart upload), which never becomes
visible half-written. Temp files left by a killed writer start with `TMP_PREFIX` and are never listed
as data; `Store.remove_orphans` sweeps them.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Sequence

import pyarrow.fs as pafs

from pipeline.store.filesystem import resolve_filesystem  # noqa: F401  (re-exported: one definition)
from schemas.store import StoreSpec

TMP_PREFIX = ".tmp-"


class StoreError(ValueError):
    """The store is missing, unreadable or of an unsupported version, or a request names unknown ids."""


class Blobs:
    """Whole-blob reads and atomic writes under `root`; every path argument is relative to it."""

    def __init__(self, fs: pafs.FileSystem, root: str, spec: StoreSpec) -> None:
        self.fs, self.root, self.spec = fs, root, spec
        self.is_local = isinstance(fs, pafs.LocalFileSystem)

    @classmethod
    def open(cls, spec: StoreSpec, filesystem: pafs.FileSystem | None = None, create: bool = False) -> "Blobs":
        blobs = cls(*resolve_filesystem(spec, filesystem), spec)
        if blobs.is_local and create:
            os.makedirs(blobs.root, exist_ok=True)
        elif not blobs.is_local:
            container = blobs.root.split("/", 1)[0]
            if blobs.fs.get_file_info(container).type == pafs.FileType.NotFound:
                raise StoreError(f"bucket {container!r} of store {spec.uri} does not exist")
        return blobs

    @property
    def uri(self) -> str:
        return self.spec.uri

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def rel(self, path: str) -> str:
        return path.removeprefix(self.root + "/")

    def put(self, rel: str, data: bytes) -> None:
        path = self.path(rel)
        if not self.is_local:
            with self.fs.open_output_stream(path) as out:  # the object appears only when the upload completes
                out.write(data)
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = os.path.join(os.path.dirname(path), f"{TMP_PREFIX}{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def get(self, rel: str) -> bytes:
        with self.fs.open_input_file(self.path(rel)) as f:  # one whole-object GET on S3, not many ranged reads
            return f.read()

    def get_ranges(self, rel: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Bytes of each `(offset, nbytes)` range of one blob: one ranged GET per range on S3."""
        with self.fs.open_input_file(self.path(rel)) as f:
            return [f.read_at(nbytes, offset) for offset, nbytes in ranges]

    def exists(self, rels: Sequence[str]) -> list[bool]:
        infos = self.fs.get_file_info([self.path(r) for r in rels])
        return [i.type == pafs.FileType.File for i in infos]

    def list(self, rel: str, recursive: bool = False) -> list[pafs.FileInfo]:
        selector = pafs.FileSelector(self.path(rel), allow_not_found=True, recursive=recursive)
        return [i for i in self.fs.get_file_info(selector) if i.type == pafs.FileType.File]

    def delete(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_file(self.path(rel))
