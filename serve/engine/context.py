"""What one request puts in context, built from its plan.

Linked modes place each chunk's loaded KV after the serving prefix: it comes from the device hot tier
(serve/kv/hot_tier.py), its misses from the loader, an unreadable or pending entry rebuilt first
(serve/engine/repair.py); with recompute on, the chunks' sources are tokenised (and pages rendered) too.
The online modes carry the chunks' source instead, the instruction first: full_text their text,
full_image their pages — rendered with the store's RenderSpec (or, for a scanned page, its own image
scaled) at the tier the router chose, the pages and tiers qvpic links.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass

from PIL import Image

from pipeline.priority import BULK_NICE
from pipeline.runtime import VLM, ChunkKV, PreparedSegment, Renderer, off_loop, prepare_segment
from pipeline.store import PageImageError, PageImageRefused, page_images
from schemas.config import RecomputeSpec
from schemas.errors import PageImageRefusedError, UnservableError, public_reason
from schemas.modes import ChunkKind
from schemas.render import RenderSpec
from schemas.report import CacheReport, FallbackReport, KVOrigin
from serve.engine.prepared import LinkedContext, LinkedPrompt, OnlineContext, PreparedContext
from serve.engine.repair import Repairer
from serve.kv import HotTier, KVSource, kv_tensor, recompute_inputs
from serve.kv.staging import Staging
from serve.plan import Entry, LoadedKV, LoadResult, Plan, PlannedChunk

log = logging.getLogger(__name__)


@dataclass
class Context:
    """What one request puts in context, and where it came from."""

    prefill: PreparedContext
    served: list[Entry | None]  # aligned with plan.chunks: the entry each linked chunk was served from
    cache: CacheReport
    fallbacks: tuple[FallbackReport, ...]
    load_ms: float = 0.0
    render_ms: float = 0.0
    sources: list[KVOrigin | None] | None = None  # aligned with plan.chunks: where each linked chunk's KV came from
    kv_nbytes: list[int | None] | None = None  # aligned with plan.chunks: each linked chunk's KV on the device


def kv_sources(read: LoadResult, repaired: LoadResult) -> list[KVOrigin | None]:
    """Where each of `repaired`'s KV came from: the loader's word for what it read (None where it had no
    entry to read: a hot chunk left out of the plan), COMPILED where the repairer rebuilt an entry rather
    than serving its backup."""
    sources = list(read.sources)
    for item in read.unreadable:
        if repaired.kvs[item.position] is not item.backup:
            sources[item.position] = KVOrigin.COMPILED
    return sources


class ContextBuilder:
    def __init__(self, vlm: VLM, renderer: Renderer, render_spec: RenderSpec, hot: HotTier, recompute: RecomputeSpec,
                 repairer: Repairer, images_root: str | None):
        self.vlm, self.renderer, self.render_spec, self.recompute = vlm, renderer, render_spec, recompute
        self.images_root = images_root  # scanned pages are read only under it
        self.hot = hot  # chunk KV resident on the device
        self.staging = Staging(vlm.device)  # misses onto the device: on CUDA pinned, on a side stream
        self.repairer = repairer
        # entry key → done when the request fetching it has put it in the hot tier (or failed); one event loop
        self._fetching: dict[str, asyncio.Future[None]] = {}

    async def build(self, plan: Plan, source: KVSource | None) -> Context:
        """A linked plan's chunk KV from the device tier, its misses from `source` (the loader's host and store
        tiers), what neither could read rebuilt; an online plan's chunk sources."""
        if plan.mode.online:
            return await self._online(plan)
        context = await self._linked(plan, source)
        if self.recompute.enabled:  # the chunks' sources, tokenised (and pages rendered) off the event loop
            started = time.perf_counter()
            last = [i for i, c in enumerate(plan.chunks) if c.group == len(plan.layout.texts) - 2]  # recomputed group
            inputs = await off_loop(recompute_inputs, self.vlm, self.renderer, [plan.chunks[i] for i in last],
                                    [context.served[i] for i in last], self.images_root)
            context.prefill.recompute = (self.recompute, inputs)
            context.render_ms = (time.perf_counter() - started) * 1e3  # pages rendered again, as full_image renders
        return context

    async def segments(self, plan: Plan) -> list[PreparedSegment]:
        """The plan's texts around its groups of chunks as the model takes them (images through its processor,
        off the event loop)."""
        layout = plan.layout
        if layout.images:
            # at a lower CPU priority: a 16 MP upload's decode and fit take ~350 ms of a core (issue 60)
            return await off_loop(lambda: [prepare_segment(self.vlm, t) for t in layout.texts], name="qvpic-images",
                                  nice=BULK_NICE)
        return [prepare_segment(self.vlm, t) for t in layout.texts]

    def _prompt(self, plan: Plan, chunks: list[ChunkKV], served: list[Entry], texts) -> LinkedContext:
        """The linked prompt: the layout's texts, and each group's chunks (named by the entry served) between them."""
        groups: list[list[ChunkKV]] = [[] for _ in range(len(texts) - 1)]
        identities: list[list[bytes]] = [[] for _ in range(len(texts) - 1)]
        for planned, chunk, entry in zip(plan.chunks, chunks, served):
            groups[planned.group].append(chunk)
            identities[planned.group].append(entry.key.encode())
        return LinkedContext(LinkedPrompt(list(texts), groups, identities), plan.cache_salt)

    async def _linked(self, plan: Plan, source: KVSource | None) -> Context:
        """The fall-through of serve/kv/tier.py across the process boundary: the device tier here, then `source`
        for its misses (host, then store), then the repairer for what no tier could read."""
        segments = await self.segments(plan)
        started = time.perf_counter()
        keys = [c.entry.key for c in plan.chunks]
        # Entries another request is bringing onto the device: wait for that copy rather than fetch them again
        # (affinity dispatch sends a popular chunk set's burst to one replica, so its requests overlap). Nothing
        # awaits between this lookup and claiming the misses, so each entry has one fetcher.
        if waits := {self._fetching[k] for k in keys if k in self._fetching}:
            await asyncio.wait([asyncio.shield(w) for w in waits])
        hot = self.hot.get_many([c.entry for c in plan.chunks]).found
        claimed = {k: asyncio.get_running_loop().create_future() for k in dict.fromkeys(keys)
                   if k not in hot and k not in self._fetching}
        self._fetching.update(claimed)
        try:
            missing = dataclasses.replace(plan, chunks=tuple(
                c if c.entry.key not in hot else dataclasses.replace(c, entry=None, fallback=None)
                for c in plan.chunks))
            fetched, sources = None, [KVOrigin.DEVICE] * len(plan.chunks)
            if len(hot) < len(plan.chunks):
                if source is None:
                    raise RuntimeError("this generator has no KV source to load its misses from")
                read = await source.load(missing)
                fetched = await self.repairer.repaired(missing, read)
                sources = [KVOrigin.DEVICE if s is None else s for s in kv_sources(read, fetched)]
            chunks, served, arrived = [], [], {}
            for position, planned in enumerate(plan.chunks):
                if planned.entry.key in hot:
                    kv, entry = hot[planned.entry.key]
                else:  # onto the device once; every later request re-anchors it there
                    loaded_kv = fetched.kvs[position]
                    kv, entry = self._chunk(loaded_kv, copy=True), loaded_kv.entry
                    arrived[entry.key] = (kv, entry)
                chunks.append(kv)
                served.append(entry)
            if arrived and (landed := self.staging.landed()) is not None:  # CUDA: the side stream's copies, waited
                await off_loop(landed.synchronize)  # for off the loop (the engine's stream never waits for them)
            self.hot.put_many(arrived)
        finally:  # put, failed or cancelled: a waiter looks again (and fetches what is still not resident)
            for key, done in claimed.items():
                self._fetching.pop(key, None)
                done.set_result(None)
        report = fetched.cache if fetched is not None else CacheReport(hits=0, misses=0, nbytes_from_store=0)
        report = report.model_copy(update={"device_hits": sum(c.entry.key in hot for c in plan.chunks)})
        fallbacks = fetched.fallbacks if fetched is not None else plan.fallbacks
        return Context(self._prompt(plan, chunks, served, segments), served, report, fallbacks,
                       (time.perf_counter() - started) * 1e3, sources=sources, kv_nbytes=[c.kv.nbytes for c in chunks])

    async def _online(self, plan: Plan) -> Context:
        report, render_ms = CacheReport(hits=0, misses=0, nbytes_from_store=0), 0.0
        if plan.mode.kind is ChunkKind.TEXT:  # full_text
            pieces = [c.text for c in plan.chunks]
        else:
            started = time.perf_counter()
            pieces = await off_loop(lambda: [self.pages(c) for c in plan.chunks])
            render_ms = (time.perf_counter() - started) * 1e3
        texts = await self.segments(plan)  # the instruction is in the first: prompt text, never a chunk
        groups: list[list] = [[] for _ in range(len(texts) - 1)]
        for planned, piece in zip(plan.chunks, pieces):
            groups[planned.group].append(piece)
        prefill = OnlineContext(texts, groups, plan.cache_salt, chunk_tokens=sum(c.num_tokens for c in plan.chunks))
        return Context(prefill, [None] * len(plan.chunks), report, plan.fallbacks, render_ms=render_ms)

    def _chunk(self, kv: LoadedKV, copy: bool) -> ChunkKV:
        # A copy detaches the hot tier from the object store's (or the loader LRU's) buffer; a quantised
        # entry is dequantised on the device, so the hot tier holds KV ready to re-anchor.
        tensor = kv_tensor(kv, self.vlm.device, self.vlm.dtype, copy, self.staging)
        return ChunkKV(tensor, kv.entry.position_span, kv.compile_start, kv.kind, kv.grid_thw)

    def pages(self, chunk: PlannedChunk) -> list[Image.Image]:
        """A chunk's pages at its tier, made the way ingest made the ones it compiled."""
        try:
            return page_images(self.renderer, chunk.text, chunk.image_path, self.render_spec.tier(chunk.tier),
                               images_root=self.images_root)[0]
        except PageImageError as error:  # the response names the chunk and a code; the log has the path
            log.warning("chunk %s: %s", chunk.chunk_id, error)
            failure = PageImageRefusedError if isinstance(error, PageImageRefused) else UnservableError
            raise failure(f"chunk {chunk.chunk_id}: {public_reason(error)}") from None
