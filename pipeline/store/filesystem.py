"""Where a store (or a request log) lives: a URI resolved to a pyarrow filesystem and a root path.

Imports only pyarrow, so light processes (the ingress) can write to the same places as the store.
"""

from __future__ import annotations

import os
from typing import Any

import pyarrow.fs as pafs

from schemas.store import StoreSpec


def resolve_filesystem(spec: StoreSpec, filesystem: pafs.FileSystem | None) -> tuple[pafs.FileSystem, str]:
    uri = spec.uri
    if uri.startswith("s3://"):
        return filesystem or _s3_filesystem(spec), uri.removeprefix("s3://").strip("/")
    if "://" in uri:
        if filesystem is not None:
            return filesystem, uri.split("://", 1)[1].rstrip("/")
        fs, root = pafs.FileSystem.from_uri(uri)
        return fs, root.rstrip("/")
    if filesystem is None or isinstance(filesystem, pafs.LocalFileSystem):
        return filesystem or pafs.LocalFileSystem(), os.path.abspath(uri)
    return filesystem, uri.strip("/")


def _s3_filesystem(spec: StoreSpec) -> pafs.S3FileSystem:
    endpoint = spec.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    region = spec.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    # Delayed open turns an object under one part (~10 MiB) into a single PUT instead of a multipart
    # upload (create, part, complete): fewer round trips. Larger objects go up multipart, atomically
    # (tests/pipeline/store/test_store_s3.py crosses the part boundary).
    options: dict[str, Any] = {"region": region, "allow_delayed_open": True}
    if endpoint:
        scheme, _, host = endpoint.partition("://")
        options.update(endpoint_override=host.rstrip("/"), scheme=scheme)
    return pafs.S3FileSystem(**options)
