"""Generation seals: an HMAC, with a key the store does not hold, over everything a serving generation serves.

The store's checksums prove integrity, not authenticity: whoever can write the store can rewrite a shard, its
index row's checksum and the generation record together. A seal closes that for the holder of a key kept off
the store. Written by publish when a key is configured (`serving/seals/{N:012d}.json`, before the pointer moves),
checked by `qvpic verify --hmac-key-file` and by every router replica before it serves a generation (at start and
at each hot reload), so a generation without a seal, or with one that does not match, is never served.

What it covers, and why that is everything: the sha256 of the generation record's bytes (the manifest — model
fingerprint, render spec, tiers — the snapshot dir names and the counts), and the sha256 of every file under the
record's chunks dir and entries dir (catalog, chunk texts and their `image_path`s, embeddings, vector index; the
entry table with each entry's shard path, byte range and sha256 checksum). KV shards are not hashed again here:
each entry's bytes are checked against the sealed checksum on every load (pipeline/store/shards.py), so the
shards chain to the seal through the entry table. Page images named by `image_path` are outside the store: they
are read only under the configured images root (pipeline/store/entries.py).

The key comes from a file (`--hmac-key-file`, config `hmac_key_file`) or the environment (`QVPIC_HMAC_KEY`);
it is never written to the store and never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path

from pipeline.store.store import Store
from schemas.generation import Generation, generation_path, seal_path
from schemas.store import ManifestError

KEY_ENV = "QVPIC_HMAC_KEY"  # the key itself, e.g. from a Kubernetes Secret; a key file takes precedence
MIN_KEY_NBYTES = 16
_DOMAIN = b"qvpic generation seal v1\n"  # a seal's MAC is never a valid MAC of anything else keyed the same


class SealError(ManifestError):
    """A generation whose seal is missing or does not match: it is not served (a ManifestError, so a router
    following the store keeps serving the generation it has, and says why)."""


def hmac_key(key_file: Path | str | None) -> bytes | None:
    """The seal key: the bytes of `key_file` (trailing newline stripped), else `QVPIC_HMAC_KEY`, else None."""
    if key_file is not None:
        try:
            key = Path(key_file).read_bytes().rstrip(b"\r\n")
        except OSError as error:
            raise SealError(f"HMAC key file {str(key_file)!r} is not readable: {error.strerror}") from None
        source = f"HMAC key file {str(key_file)!r}"
    elif os.environ.get(KEY_ENV):
        key, source = os.environ[KEY_ENV].encode(), KEY_ENV
    else:
        return None
    if len(key) < MIN_KEY_NBYTES:
        raise SealError(f"{source} holds {len(key)} bytes; an HMAC key needs at least {MIN_KEY_NBYTES}")
    return key


def _payload(generation: int, record_sha256: str, files: dict[str, str]) -> bytes:
    return json.dumps({"generation": generation, "record_sha256": record_sha256, "files": files},
                      sort_keys=True, separators=(",", ":")).encode()


def _mac(key: bytes, payload: bytes) -> str:
    return hmac.new(key, _DOMAIN + payload, hashlib.sha256).hexdigest()


def _digest(store: Store, rel: str) -> str:
    sha = hashlib.sha256()
    with store.blobs.open_input(rel) as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return sha.hexdigest()


def sealed_files(store: Store, record: Generation) -> dict[str, str]:
    """sha256 of every file under the record's snapshot dirs, by store-relative path."""
    files = {}
    for folder in (record.chunks_dir, record.entries_dir):
        for info in store.blobs.list(folder, recursive=True):
            if info.is_file:
                rel = store.blobs.rel(info.path)
                files[rel] = _digest(store, rel)
    return files


def write_seal(store: Store, record: Generation, key: bytes) -> None:
    """Seal generation `record` (its record already written): call before the pointer moves to it."""
    record_sha256 = hashlib.sha256(store.blobs.get(generation_path(record.generation))).hexdigest()
    files = sealed_files(store, record)
    payload = _payload(record.generation, record_sha256, files)
    store.blobs.put_json(seal_path(record.generation), {**json.loads(payload), "hmac_sha256": _mac(key, payload)})


def check_seal(store: Store, record: Generation, key: bytes) -> None:
    """Nothing when generation `record` is sealed with `key` and every sealed byte is unchanged; else SealError
    naming what differs. Reads every file of its snapshot dirs (the entry table and catalog, not the shards)."""
    n = record.generation
    seal = store.blobs.get_json(seal_path(n))
    if seal is None:
        raise SealError(f"generation {n} has no seal ({seal_path(n)}): it was published without the HMAC key, "
                        f"or by someone who does not hold it; not served")
    try:
        payload = _payload(int(seal["generation"]), str(seal["record_sha256"]), dict(seal["files"]))
        claimed = str(seal["hmac_sha256"])
    except (KeyError, TypeError, ValueError):
        raise SealError(f"generation {n}'s seal is malformed; not served") from None
    if not hmac.compare_digest(_mac(key, payload), claimed):
        raise SealError(f"generation {n}'s seal does not match the HMAC key (a wrong key, or a seal rewritten "
                        f"without it); not served")
    if seal["generation"] != n:
        raise SealError(f"generation {n} carries the seal of generation {seal['generation']}; not served")
    if hashlib.sha256(store.blobs.get(generation_path(n))).hexdigest() != seal["record_sha256"]:
        raise SealError(f"generation {n}'s record (its manifest, snapshot dirs, counts) changed after it was "
                        f"sealed; not served")
    files = sealed_files(store, record)
    changed = sorted(rel for rel in set(files) | set(seal["files"]) if files.get(rel) != seal["files"].get(rel))
    if changed:
        raise SealError(f"generation {n}: {len(changed)} file(s) added, removed or changed since it was sealed "
                        f"(e.g. {changed[:3]}); not served")
