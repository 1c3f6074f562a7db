"""Contracts of the serving snapshots ("generations") a store publishes, and of the leases that pin them.

A generation is an immutable, self-contained view of a store for serving: the manifest it was built
from, a chunk catalog (sorted by document and order, memory-mappable), the KV entries current under
that manifest, and a vector index over the chunk embeddings. Jobs publish a new generation at their
end; serving replicas switch to it without a redeploy and hold a lease on every generation a request
of theirs may still use, so garbage collection never removes what a live service serves.

Layout under the store root (every file written atomically, never rewritten):
    serving/current.json                     {"generation": N}: the one serving should use
    serving/generations/{N:012d}.json        `Generation` records
    serving/chunks/{digest}/...              catalog, texts, embeddings, vector index (shared by
                                             generations whose chunk tables are identical)
    serving/entries/{digest}/...             current-fingerprint entries and each catalog row's range
    serving/leases/{holder}.json             `Lease` records, renewed by a heartbeat
    serving/seals/{N:012d}.json              the generation's HMAC seal, when published with a key
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from enum import Enum
from typing import Annotated

from pydantic import AfterValidator, Field, StringConstraints, model_validator

from schemas.corpus import ALL_COLLECTIONS, DEFAULT_COLLECTION
from schemas.frozen import Frozen
from schemas.store import Manifest

SERVING_DIR = "serving"
CURRENT = f"{SERVING_DIR}/current.json"
GENERATIONS_DIR = f"{SERVING_DIR}/generations"
CHUNKS_DIR = f"{SERVING_DIR}/chunks"
ENTRIES_DIR = f"{SERVING_DIR}/entries"
LEASES_DIR = f"{SERVING_DIR}/leases"
SEALS_DIR = f"{SERVING_DIR}/seals"  # a generation's HMAC seal, when its publisher held the key (pipeline/store/seal.py)
HOLDER = re.compile(r"[A-Za-z0-9_.\-]{1,128}")


def generation_path(generation: int) -> str:
    return f"{GENERATIONS_DIR}/{generation:012d}.json"


def seal_path(generation: int) -> str:
    return f"{SEALS_DIR}/{generation:012d}.json"


class SearchKind(str, Enum):
    """How top-k retrieval scans the embeddings (both rerank their candidates on float16 rows)."""

    FLAT = "flat"  # every row's int8 code: exhaustive, recall ~1
    IVF = "ivf"  # the int8 codes of the `nprobe` lists nearest the query: approximate


class SearchSpec(Frozen):
    """How the job that publishes a generation builds its vector index.

    Below `ann_min_rows` the index is flat. From there an IVF index is built and its `nprobe` is
    calibrated on held-out queries to the smallest that reaches `target_recall` (recall@k against
    the flat scan); if that needs more than `max_scan_fraction` of the rows, the embeddings have no
    neighbourhood structure an IVF can use (random vectors, for one) and the flat index is kept.
    Stores past `calibration_sample_rows` calibrate an IVF on a sample of that many rows first: if it
    misses the target there even reading twice `max_scan_fraction`, the full IVF is never built.
    """

    ann_min_rows: int = Field(200_000, ge=1)
    target_recall: float = Field(0.95, gt=0.0, le=1.0)
    recall_k: int = Field(8, ge=1)
    max_scan_fraction: float = Field(0.25, gt=0.0, le=1.0)
    num_lists: int | None = Field(None, ge=1)  # IVF lists; default ~sqrt(rows)
    num_calibration_queries: int = Field(256, ge=16)
    # How close a calibration query is to the stored row it was moved from. 0.3: on MiniLM embeddings of
    # real text (300k rows), recall at every nprobe then tracks held-out real sentences' within 0.05, a
    # little below it; 0.5 overstated it (nprobe 5: 0.98 calibrated, 0.87 served). docs/BENCHMARKS.md.
    calibration_query_cosine: float = Field(0.3, gt=0.0, lt=1.0)
    rerank_candidates: int = Field(64, ge=1)  # int8 candidates rescored in float16 (at least 8 x k)
    calibration_sample_rows: int = Field(100_000, ge=1_000)  # calibrated first; rejected there: IVF never built


class ScanSpec(Frozen):
    """How a router searches a generation's vector index, per query (pipeline/store/catalog/vector_index.py)."""

    search_threads: int = Field(1, ge=1, le=256)  # threads one query's exhaustive scan may use, one per shard group
    rerank_candidates: int = Field(64, ge=1)  # int8 candidates rescored in float16 (at least 8 x k), as calibrated


class CalibrationPoint(Frozen):
    nprobe: int
    scan_fraction: float  # share of the rows whose codes the search reads
    recall: float  # recall@k against the flat scan on the calibration queries


class SearchInfo(Frozen):
    """What the job built, and what it measured."""

    kind: SearchKind
    files: tuple[str, ...] = ()  # the index files in the chunks dir, in row order (flat: shards of rows)
    num_rows: int = Field(ge=0)
    dim: int = Field(gt=0)
    code_scale: float = Field(gt=0.0)  # int8 code = round(value * code_scale)
    num_lists: int | None = None
    nprobe: int | None = None
    recall_k: int = 8
    recall: float | None = None  # the chosen configuration's measured recall@k (None: flat, exhaustive)
    calibration: tuple[CalibrationPoint, ...] = ()
    calibration_sample_rows: int | None = None  # the calibration ran on a sample of this many rows (None: all)
    build_s: float = 0.0
    reason: str = ""  # why this kind was chosen


# A directory inside the store, as a record names it: relative, `/`-separated, no `.` or `..` segment, no empty
# segment, none of `\\ : ~` — a record cannot point a reader (or the sweep's deletions) outside the store.
def _inside_store(path: str) -> str:
    if any(segment in (".", "..") for segment in path.split("/")):
        raise ValueError(f"must stay inside the store (no '.' or '..' segment), got {path[:100]!r}")
    return path


StoreRelPath = Annotated[str, StringConstraints(max_length=512,
                                                pattern=r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*(/[A-Za-z0-9_.-]+)*$"),
                         AfterValidator(_inside_store)]


class CollectionCounts(Frozen):
    num_chunks: int = Field(ge=0)
    num_documents: int = Field(ge=0)


def reads_all(grant: frozenset[str] | None) -> bool:
    """Whether `grant` reads every collection: None (offline callers) or one holding `ALL_COLLECTIONS`."""
    return grant is None or ALL_COLLECTIONS in grant


def counts_within(counts: dict[str, CollectionCounts], grant: frozenset[str] | None) -> CollectionCounts:
    """The chunks and documents of the collections `grant` reads (a document is in one collection)."""
    within = [c for name, c in counts.items() if reads_all(grant) or name in grant]
    return CollectionCounts(num_chunks=sum(c.num_chunks for c in within),
                            num_documents=sum(c.num_documents for c in within))


class Generation(Frozen):
    """One published serving snapshot."""

    generation: int = Field(ge=1)
    manifest: Manifest
    chunks_dir: StoreRelPath  # relative to the store root (checked: at publish and at open)
    entries_dir: StoreRelPath
    num_chunks: int = Field(ge=0)  # chunk occurrences in the catalog
    num_documents: int = Field(ge=0)
    num_entries: int = Field(ge=0)  # KV entries current under `manifest`
    search: SearchInfo
    job_id: str
    published_at: datetime
    # chunks and documents per collection; empty in a generation published before collections existed
    collections: dict[str, CollectionCounts] = Field(default_factory=dict)

    def collection_counts(self) -> dict[str, CollectionCounts]:
        """Counts per collection: an older generation's rows are all in the default collection."""
        if self.collections:
            return self.collections
        return {DEFAULT_COLLECTION: CollectionCounts(num_chunks=self.num_chunks, num_documents=self.num_documents)}


class Lease(Frozen):
    """A serving replica's claim on the generations its requests may still read, until `expires_at`."""

    holder: str = Field(pattern=HOLDER.pattern)
    generations: tuple[int, ...]
    expires_at: datetime

    @model_validator(mode="after")
    def _aware(self) -> "Lease":
        if self.expires_at.tzinfo is None:
            raise ValueError("expires_at must carry a timezone")
        return self

    def live(self, now: datetime | None = None) -> bool:
        return self.expires_at > (now or datetime.now(timezone.utc))


class ReloadSpec(Frozen):
    """How a serving replica follows the store's published generations."""

    enabled: bool = True  # False: serve the generation found at start-up until redeployed
    poll_s: float = Field(2.0, gt=0.0)  # how often `serving/current.json` is read
    lease_ttl_s: float = Field(120.0, gt=0.0)  # a lease not renewed for this long no longer protects
    heartbeat_s: float = Field(15.0, gt=0.0)
    retain_s: float = Field(600.0, ge=0.0)  # a generation stays leased this long after the replica left it

    @model_validator(mode="after")
    def _heartbeat_within_ttl(self) -> "ReloadSpec":
        if self.heartbeat_s * 2 > self.lease_ttl_s:
            raise ValueError("heartbeat_s must be at most half of lease_ttl_s, or a lease lapses between renewals")
        return self
