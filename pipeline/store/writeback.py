"""Write-back of an entry compiled while serving (a lazily compiled tier): into the store once, idempotently.

The commit is the store's own: the shard first (content-named, atomic), then one index row published as
a part whose name is a function of the entry's cache key alone. A second writer of the same entry — a
replica that compiled it at the same time — rewrites that same part atomically with an equivalent row
(the same bytes on the same hardware; a row as valid as the first otherwise), so it is harmless and the
table never holds two parts for one entry. The part is also where any replica looks for the entry
before compiling it (`written_back`: one read of one small object, no scan of the index).

Serving does not take the store's write lease (pipeline/store/leases.py) for this: the lease serialises jobs
that rewrite the tables, and a replica that held it would make an ingest refuse to start. Nothing here
needs it — a job's compaction deletes only the parts it listed (a part written meanwhile survives it,
and a compacted part keeps the row), and orphan collection spares shards younger than its grace period.
The next published generation carries the written-back rows to every router.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.runtime import ChunkKV
from pipeline.store.entries import index_row
from pipeline.store.kv_quant import stored
from pipeline.store.store import Store
from schemas.store import CacheKey, Manifest
from schemas.tables import INDEX_SCHEMA, with_optional

WRITE_BACK_STAMP_NS = 0  # fixed, so the part name is the key's alone; rows still order by created_at


def part_token(key: CacheKey) -> str:
    return "wb" + hashlib.sha256(key.to_str().encode()).hexdigest()[:30]


def part_rel(store: Store, key: CacheKey) -> str:
    log = store.tables["index"]
    return f"{log.directory}/{log.part_name(WRITE_BACK_STAMP_NS, part_token(key))}"


def written_back(store: Store, key: CacheKey) -> dict[str, Any] | None:
    """The index row a replica wrote back for `key`, or None (never written, or merged by a compaction
    since — the next generation serves it then; until then a replica compiles it again, harmlessly)."""
    try:
        data = store.blobs.get(part_rel(store, key))
    except FileNotFoundError:
        return None
    table = with_optional(pq.read_table(pa.BufferReader(data)), INDEX_SCHEMA).select(INDEX_SCHEMA.names)
    rows = [r for r in table.to_pylist() if r["fingerprint"] == key.fingerprint]
    return rows[0] if rows else None


def write_back(store: Store, manifest: Manifest, key: CacheKey, kv: ChunkKV,
               sizes_px: list[list[int]]) -> dict[str, Any]:
    """Write `kv` (the entry `key`, compiled from pages of `sizes_px`) and publish its index row; returns the row."""
    tensor_key = f"{key.chunk_key}.{key.tier or 'text'}.{key.variant.value}"
    (shard,) = store.write_shard({tensor_key: stored(kv.kv, manifest.kv_quant)})  # the store's KV format
    row = index_row(manifest, key.chunk_key, key.tier, key.variant, kv, sizes_px, shard)
    store.publish_index([row], stamp_ns=WRITE_BACK_STAMP_NS, token=part_token(key))
    return written_back(store, key) or row
