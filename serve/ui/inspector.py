"""The inspector's store side: page images and the store overview, read from the store the app serves.

A deployment of its own, because the ingress replica stays clear of the model stack and the store's
reader imports torch. A page image is rendered from the chunk's stored text with the store's own
`RenderSpec` at the requested tier (or, for an ingested page image, that page scaled as ingest scaled it),
through `page_images`, the function compile used: the same pixels the model saw. Ids are looked up, never
opened: a chunk id the store does not know or a tier it does not have is a 404, and no path is ever built
from a request; a stored `image_path` outside the configured images root is refused unread (422). PNGs are
kept in a small LRU (rendering a page costs tens of milliseconds), each with its
chunk's collection: a chunk outside the caller's collections is the same 404 as one the store lacks, cached
or not. The overview of a key that does not read every collection counts only its collections' chunks and
documents, and shows no store-wide figures (KV entries, shared by content across collections) nor the
quarantine (whose samples name other tenants' inputs).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

from pydantic import Field

from pipeline.runtime import Renderer
from pipeline.store import (
    PageImageRefused,
    Store,
    StoreError,
    current_generation_number,
    encode_png,
    page_images,
    read_generation,
)
from schemas.corpus import DEFAULT_COLLECTION
from schemas.errors import PageImageRefusedError, UnknownIdsError, UnknownTierError, public_reason
from schemas.generation import counts_within, reads_all
from schemas.store import ImagesRoot
from serve.config import StoreBound
from serve.kv.lru import ByteLRU
from serve.ui.overview import EntryGroup, QuarantineReason, StoreOverview

log = logging.getLogger(__name__)

QUARANTINE_SAMPLES = 3  # sample inputs shown per quarantine reason


def readable(grant: frozenset[str], collection: str) -> bool:
    return reads_all(grant) or collection in grant


class InspectorConfig(StoreBound):
    page_cache_nbytes: int = Field(64 * 2**20, ge=0)  # PNG bytes kept in memory
    images_root: ImagesRoot | None = None  # AppConfig.images_root: a scanned page outside it is refused unread


class Inspector:
    def __init__(self, config: InspectorConfig):
        self.store = Store.open(config.store)
        self.manifest = self.store.load_manifest_or_raise()
        self.renderer = Renderer(self.manifest.render)
        self.images_root = config.images_root
        # (the chunk's collection, PNG bytes): the collection is checked on every hit
        self.pngs: ByteLRU[tuple[str, bytes]] = ByteLRU(config.page_cache_nbytes, lambda item: len(item[1]))
        self._lock = threading.Lock()  # Serve runs sync methods on a thread pool

    def page_png(self, chunk_id: str, tier: str, page: int, collections: frozenset[str]) -> bytes:
        """Page `page` of the chunk at `tier`, as PNG bytes; a 404 error for what the store lacks, and for a
        chunk outside `collections` (the caller's grant), with the same message."""
        if tier not in {t.name for t in self.manifest.tiers}:
            raise UnknownTierError(f"the store has no tier {tier!r}")
        unknown = UnknownIdsError(f"unknown chunk {chunk_id!r}")
        key = f"{chunk_id}\x00{tier}\x00{page}"  # ids cannot hold NUL (schemas.api.StoreId): keys cannot collide
        with self._lock:
            cached = self.pngs.get(key)
        if cached is not None:
            collection, png = cached
            if not readable(collections, collection):
                raise unknown
            return png
        try:
            rows = self.store.chunks_for(chunk_ids=[chunk_id])
            row = rows.select(["text", "image_path", "collection"]).to_pylist()[0]
        except StoreError:
            raise unknown from None
        collection = row["collection"] or DEFAULT_COLLECTION  # null: written before collections existed
        if not readable(collections, collection):
            raise unknown
        spec = self.manifest.render.tier(tier)
        # the range first: a page past the chunk's end costs a layout (or nothing, for a scanned page's one page),
        # never a render of every page
        count = 1 if row["image_path"] else self.renderer.page_count(row["text"], spec)
        if not 0 <= page < count:
            raise UnknownIdsError(f"chunk {chunk_id!r} has {count} page(s) at tier {tier!r}")
        try:
            pages, _ = page_images(self.renderer, row["text"], row["image_path"] or None, spec,
                                   images_root=self.images_root)
        except PageImageRefused as error:  # the response names the chunk and a code; the log has the path
            log.warning("chunk %s: %s", chunk_id, error)
            raise PageImageRefusedError(f"chunk {chunk_id!r}: {public_reason(error)}") from None
        png = encode_png(pages[page])
        with self._lock:
            self.pngs.put(key, (collection, png))
        return png

    def overview(self, collections: frozenset[str]) -> StoreOverview:
        """What the store holds under its serving generation, by variant and tier, and what it refused — all
        of it for a key reading every collection the store holds; else its collections' counts only."""
        generation = read_generation(self.store, current_generation_number(self.store))
        manifest = generation.manifest
        counts = generation.collection_counts()
        if not (reads_all(collections) or set(counts) <= collections):
            within = counts_within(counts, collections)
            return StoreOverview(
                fingerprint=manifest.fingerprint, model_id=manifest.model.id,
                tiers={t.name: t.dpi for t in manifest.tiers}, kv_quant=manifest.kv_quant,
                generation=generation.generation, published_at=generation.published_at, job_id=generation.job_id,
                num_documents=within.num_documents, num_chunks=within.num_chunks, num_entries=None, entries=[],
                quarantine=[])
        stats = self.store.stats()
        quarantined = self.store.quarantined().select(["reason", "source", "detail"]).to_pylist()
        counts = Counter(q["reason"] for q in quarantined)
        reasons = [QuarantineReason(reason=reason, count=count,
                                    samples=[f"{q['source']}: {q['detail']}" for q in quarantined
                                             if q["reason"] == reason][:QUARANTINE_SAMPLES])
                   for reason, count in counts.most_common()]
        return StoreOverview(
            fingerprint=manifest.fingerprint, model_id=manifest.model.id,
            tiers={t.name: t.dpi for t in manifest.tiers}, kv_quant=manifest.kv_quant,
            generation=generation.generation, published_at=generation.published_at, job_id=generation.job_id,
            num_documents=stats.num_documents, num_chunks=stats.num_chunks, num_entries=stats.num_entries,
            entries=[EntryGroup(tier=g.tier, variant=g.variant, entries=g.num_entries, nbytes=g.nbytes)
                     for g in stats.groups],
            quarantine=reasons)
