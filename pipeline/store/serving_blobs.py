"""Blobs of serving generations under a store root, on any pyarrow filesystem: small JSON records
written atomically, snapshot directories built locally and published whole (a COMPLETE marker lands
last), and local copies of remote snapshot directories for memory-mapping.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pyarrow.fs as pafs

from pipeline.store.store import Store
from schemas.generation import SERVING_DIR

COMPLETE = "complete.json"  # written last into a snapshot dir: a dir without it is being written (or was torn)
STAGING_PREFIX = ".tmp-"


def abs_path(store: Store, rel: str) -> str:
    return f"{store.root}/{rel}"


def is_local(store: Store) -> bool:
    return isinstance(store.fs, pafs.LocalFileSystem)


def read_json(store: Store, rel: str) -> dict | None:
    try:
        with store.fs.open_input_file(abs_path(store, rel)) as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None


def write_json(store: Store, rel: str, payload: str) -> None:
    path = abs_path(store, rel)
    if not is_local(store):
        with store.fs.open_output_stream(path) as out:  # visible only once the upload completes
            out.write(payload.encode())
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = os.path.join(os.path.dirname(path), f"{STAGING_PREFIX}{uuid.uuid4().hex}")
    with open(tmp, "w") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def publish_dir(store: Store, staging: Path, rel: str) -> None:
    """Move a finished local staging dir to `rel` under the store; its COMPLETE marker lands last."""
    (staging / COMPLETE).write_text(json.dumps({"completed_at": datetime.now(timezone.utc).isoformat()}))
    if is_local(store):
        target = Path(abs_path(store, rel))
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(staging, target)  # atomic; content-addressed, so an existing target is the same snapshot
        except OSError:
            if not (target / COMPLETE).exists():
                raise
            shutil.rmtree(staging, ignore_errors=True)
        return
    names = sorted(p.name for p in staging.iterdir() if p.name != COMPLETE) + [COMPLETE]
    for name in names:
        pafs.copy_files(str(staging / name), abs_path(store, f"{rel}/{name}"),
                        source_filesystem=pafs.LocalFileSystem(), destination_filesystem=store.fs)
    shutil.rmtree(staging, ignore_errors=True)


def is_complete(store: Store, rel: str) -> bool:
    return store.fs.get_file_info(abs_path(store, f"{rel}/{COMPLETE}")).type == pafs.FileType.File


def staging_dir(store: Store) -> Path:
    """A local dir to build a snapshot in: inside the store for a local one (so the publish is a rename)."""
    if is_local(store):
        base = Path(abs_path(store, SERVING_DIR))
        base.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=base))
    return Path(tempfile.mkdtemp(prefix="qvpic-serving-"))


def local_copy(store: Store, rel: str, cache_root: Path) -> Path:
    """A local directory holding snapshot dir `rel` (itself for a local store; else downloaded once into
    `cache_root`, keyed by the content-addressed name, so it never goes stale). texts.arrow is not
    downloaded: it is read by range."""
    if is_local(store):
        return Path(abs_path(store, rel))
    target = cache_root / rel
    if (target / COMPLETE).exists():
        return target
    cache_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=cache_root))
    selector = pafs.FileSelector(abs_path(store, rel))
    for info in store.fs.get_file_info(selector):
        if info.base_name not in ("texts.arrow", COMPLETE):
            pafs.copy_files(info.path, str(staging / info.base_name), source_filesystem=store.fs,
                            destination_filesystem=pafs.LocalFileSystem())
    (staging / COMPLETE).write_text("{}")
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return target

