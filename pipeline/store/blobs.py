"""Atomic blob I/O under one root on any pyarrow filesystem (local disk, S3, anything fsspec-backed): the
one path from the store's modules to its bytes.

A blob is either absent or complete: locally a write goes to a temp file, is fsynced and renamed over
the target; on object stores it is one PUT (or one completed multipart upload), which never becomes
visible half-written. A directory (a serving snapshot) is built on local disk and put whole: locally by
one rename, on object stores file by file with the file that marks it complete last. Temp files and
staging dirs start with `TMP_PREFIX` and are never read as data; `pipeline/store/gc.py` sweeps the ones a
killed writer left.

Calls that touch many blobs take them all at once (`stat`, `exists`, `get_ranges`): one request per
batch where the filesystem allows it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.fs as pafs

from pipeline.store.filesystem import resolve_filesystem
from schemas.store import StoreSpec

TMP_PREFIX = ".tmp-"  # temp files of atomic writes and staging dirs of snapshots alike


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
        """The filesystem path of `rel` (on `fs`), for messages and for readers handed `fs` (Ray Data)."""
        return f"{self.root}/{rel}" if rel else self.root

    def rel(self, path: str) -> str:
        return path.removeprefix(self.root + "/")

    def local_path(self, rel: str) -> Path | None:
        """`rel` on local disk, for memory-mapping in place; None on an object store."""
        return Path(self.path(rel)) if self.is_local else None

    # ---- blobs ---------------------------------------------------------------------------------
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

    def put_json(self, rel: str, value: Any) -> None:
        self.put(rel, json.dumps(value).encode())

    def get(self, rel: str) -> bytes:
        with self.fs.open_input_file(self.path(rel)) as f:  # one whole-object GET on S3, not many ranged reads
            return f.read()

    def get_json(self, rel: str) -> Any | None:
        """The JSON value of blob `rel`; None when it is absent."""
        try:
            return json.loads(self.get(rel))
        except FileNotFoundError:
            return None

    def get_ranges(self, rel: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Bytes of each `(offset, nbytes)` range of one blob: one ranged GET per range on S3."""
        with self.fs.open_input_file(self.path(rel)) as f:
            return [f.read_at(nbytes, offset) for offset, nbytes in ranges]

    def open_input(self, rel: str) -> pa.NativeFile:
        """Blob `rel` opened for random access (`pread` locally, ranged GETs on S3): for readers that take
        only part of a file — Parquet footers and record batches, Arrow IPC batches. Close it (`with`)."""
        return self.fs.open_input_file(self.path(rel))

    # ---- listings ------------------------------------------------------------------------------
    def stat(self, rels: Sequence[str]) -> list[pafs.FileInfo]:
        """File infos of `rels`, in order, in one call (type NotFound for an absent one)."""
        return self.fs.get_file_info([self.path(r) for r in rels])

    def exists(self, rels: Sequence[str]) -> list[bool]:
        return [i.type == pafs.FileType.File for i in self.stat(rels)]

    def list(self, rel: str, recursive: bool = False) -> list[pafs.FileInfo]:
        """The files under directory `rel` (none when it is absent); their `path`s are filesystem paths."""
        return self._listing(rel, recursive, pafs.FileType.File)

    def dirs(self, rel: str) -> list[pafs.FileInfo]:
        """The directories directly under `rel` (on object stores: the common prefixes)."""
        return self._listing(rel, False, pafs.FileType.Directory)

    def _listing(self, rel: str, recursive: bool, kind: pafs.FileType) -> list[pafs.FileInfo]:
        selector = pafs.FileSelector(self.path(rel), allow_not_found=True, recursive=recursive)
        return [i for i in self.fs.get_file_info(selector) if i.type == kind]

    # ---- deletes -------------------------------------------------------------------------------
    def delete(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_file(self.path(rel))

    def delete_dir(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_dir(self.path(rel))

    # ---- whole directories ---------------------------------------------------------------------
    def staging_dir(self, parent: str) -> Path:
        """A fresh local dir to build a directory for `put_dir` in: under `parent` in a local store (so
        the put is one rename), else in the system's temp dir. The caller removes it when done."""
        if self.is_local:
            base = Path(self.path(parent))
            base.mkdir(parents=True, exist_ok=True)
            return Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=base))
        return Path(tempfile.mkdtemp(prefix=TMP_PREFIX))

    def put_dir(self, local: Path, rel: str, last: str) -> None:
        """Put local dir `local` (holding `last`, the file that says the dir is whole) at `rel`, which is
        content-addressed: an existing `rel` holds the same files. Locally one rename (a complete `rel`
        already there stays); on an object store file by file, `last` last."""
        if self.is_local:
            install_dir(local, Path(self.path(rel)), last)
            return
        names = sorted(p.name for p in local.iterdir() if p.name != last) + [last]
        for name in names:
            pafs.copy_files(str(local / name), self.path(f"{rel}/{name}"),
                            source_filesystem=pafs.LocalFileSystem(), destination_filesystem=self.fs)

    def get_dir(self, rel: str, local: Path, skip: frozenset[str] = frozenset()) -> None:
        """Download the files of directory `rel` (but those named in `skip`) into local dir `local`."""
        for info in self.list(rel):
            if info.base_name not in skip:
                pafs.copy_files(info.path, str(local / info.base_name), source_filesystem=self.fs,
                                destination_filesystem=pafs.LocalFileSystem())


def install_dir(staging: Path, target: Path, marker: str) -> None:
    """Rename local dir `staging` to `target` (atomic). A `target` that already holds `marker` was
    installed by a concurrent writer of the same content: `staging` is dropped then."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(staging, target)
    except OSError:
        if not (target / marker).exists():
            raise
        shutil.rmtree(staging, ignore_errors=True)
