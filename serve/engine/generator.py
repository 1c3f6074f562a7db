"""Generator: holds the VLM and its batching engine, builds each request's context, streams its answer.

Linked modes (qvpic, uniform, uniform_high, image_pic, image_pic_dummy, text_pic, text_pic_plain) place
the loaded KV after the serving prefix — the chat-template prefix and the request's instruction, computed
once per distinct instruction — re-anchor it, and prefill only the text after the chunks (the query
prompt, or the query) and the turn's closing. The online modes prefill everything, the instruction
first: full_text the chunks' source text, full_image their pages — rendered with the store's
RenderSpec (or, for a scanned page, its own image scaled) at the tier the router chose. Those are
the pages and tiers qvpic links, so full_image is qvpic's exact, uncached reference and the gap
between the two is the cost (or error) of caching alone.

A request reads as context → submit → stream: its chunk KV comes from the device hot tier
(serve/kv/hot_tier.py), its misses from the loader; the engine (serve/engine/) runs it in one batch with
every other request in flight, a token per step, and this side detokenises incrementally. A caller
that goes away (cancelled, or its stream closed) cancels the request: the engine drops it at its next
step and frees its KV. Past its deadline it ends with 504.

An entry the loader could not read (missing or corrupt shard) is rebuilt here before assembly, the way
ingest built it: the chunk's stored source text (or page image), rendered with the store's RenderSpec
and compiled by this model — the same bytes on the same hardware. Only when that is impossible (a
page image this replica cannot read) does the request take the loader's lower-tier backup, reported
as a fallback, or fail with 503. Each outcome is counted in `qvpic_kv_recompiles`. A pending entry of
a lazily compiled tier takes the same path, through serve/kv/lazy_tier.py: compiled once, written back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pyarrow.compute as pc
from PIL import Image
from ray.serve.handle import DeploymentHandle

from pipeline.store import PageImageError, build_sized_entry, page_images
from pipeline.store import check_device, stored
from pipeline.runtime import Renderer
from pipeline.runtime import ChunkKV
from pipeline.runtime import VLM
from pipeline.store import Store
from schemas.api import (
    AnswerReport,
    CacheReport,
    CacheStats,
    ChunkReport,
    FallbackReport,
    FinishReason,
    Timings,
    TokenUsage,
)
from schemas.config import Mode
from schemas.errors import DeadlineExceededError, UnservableError
from schemas.sampling import Sampling
from serve.http import cancelling
from serve.kv import recompute_inputs
from serve.config import GeneratorConfig
from serve.engine.detokenizer import Detokenizer
from serve.engine.loop import Engine, EngineStats, LinkedContext, OnlineContext
from serve.engine.sequence import End, Finished, Sequence
from serve.kv import HotTier
from serve.kv import LazyTier
from serve.kv import CacheLoader, kv_tensor, to_wire
from serve.metrics import serve_metrics
from serve.kv import is_pending
from serve.plan import Answer, Entry, LoadedKV, LoadResult, Plan, PlannedChunk
from serve.routing import check_store

ONLINE_MODES = (Mode.FULL_TEXT, Mode.FULL_IMAGE)
FINISH = {End.STOP: FinishReason.STOP, End.LENGTH: FinishReason.LENGTH}


@dataclass
class Context:
    """What one request puts in context, and where it came from."""

    prefill: LinkedContext | OnlineContext
    served: list[Entry | None]  # aligned with plan.chunks: the entry each linked chunk was served from
    cache: CacheReport
    fallbacks: tuple[FallbackReport, ...]
    load_ms: float = 0.0
    render_ms: float = 0.0


class Generator:
    def __init__(self, config: GeneratorConfig, loader: DeploymentHandle | CacheLoader | None = None):
        self.config = config
        self.store = Store.open(config.store)  # its chunk table is read only to rebuild an unreadable entry
        manifest = self.store.load_manifest_or_raise()
        check_store(manifest, config.model)
        self.vlm = VLM(config.model)
        check_device(manifest.kv_quant, self.vlm.device)  # it dequantises the store's entries there
        self.render_spec = manifest.render
        self.kv_quant = manifest.kv_quant  # a rebuilt entry is stored as the store's own are
        self.renderer = Renderer(manifest.render)
        self.prefix_tokens = self.vlm.prefix.num_tokens  # the serving prefix KV, computed here once
        self.loader = loader  # where the hot tier's misses come from
        self.hot = HotTier(config.engine.hot_tier_nbytes)
        self.engine = Engine(self.vlm, config.engine)
        self.metrics = serve_metrics()
        self.lazy = LazyTier(self.store, manifest, self.compile_entry)  # a lazily compiled tier's entries

    async def generate(self, plan: Plan, sampling: Sampling, timeout_s: float | None = None, *,
                       loaded: LoadResult | None = None, loader: CacheLoader | None = None) -> Answer:
        async with contextlib.aclosing(self.stream(plan, sampling, timeout_s, loaded=loaded, loader=loader)) as events:
            async for event in events:
                if isinstance(event, Answer):
                    return event
        raise RuntimeError("the stream ended without an answer")

    async def stream(self, plan: Plan, sampling: Sampling, timeout_s: float | None = None, *,
                     loaded: LoadResult | None = None,
                     loader: CacheLoader | None = None) -> AsyncIterator[str | Answer]:
        """Answer text deltas as tokens decode, then the `Answer` (full text and report).

        `loaded`: use this KV instead of the hot tier and the loader; `loader`: fetch misses from it
        instead of the deployment's loader (in-process use)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                context = await self.context(plan, loaded, loader or self.loader)
        except TimeoutError:
            raise DeadlineExceededError(f"the request passed its {timeout_s:.3g} s deadline while loading") from None
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        num_query = len(context.prefill.query_ids) if isinstance(context.prefill, LinkedContext) else 0
        num_prompt = (self.prefix_tokens + self.instruction_tokens(plan.instruction)  # as served: a lazily compiled
                      + sum((s or c).num_tokens for c, s in zip(plan.chunks, context.served))  # entry's own count
                      + (num_query or plan.query_tokens))
        seq = Sequence(sampling, context.prefill, num_prompt, num_query,
                       emit=lambda event: loop.call_soon_threadsafe(events.put_nowait, event), deadline=deadline)
        self.engine.submit(seq)
        detokenizer, pieces = Detokenizer(self.vlm.tokenizer), []
        try:
            while not isinstance(event := await events.get(), Finished):
                if piece := detokenizer.add(event):
                    pieces.append(piece)
                    yield piece
            if event.end is End.DEADLINE:
                raise DeadlineExceededError(f"the request passed its {timeout_s:.3g} s deadline; its decoding stopped "
                                            f"after {len(seq.token_ids)} tokens")
            if event.end is not End.STOP and event.end is not End.LENGTH:
                raise event.error or RuntimeError(f"generation ended: {event.end.value}")
            if piece := detokenizer.flush():
                pieces.append(piece)
                yield piece
            yield Answer(text="".join(pieces), report=self._report(plan, context, seq))
        finally:
            self.engine.cancel(seq)  # a no-op once finished; else the caller went away: the row leaves

    def generate_blocking(self, plan: Plan, sampling: Sampling, *, loaded: LoadResult | None = None,
                          loader: CacheLoader | None = None) -> Answer:
        """`generate` for callers without an event loop (scripts, evaluation, tests)."""
        return asyncio.run(self.generate(plan, sampling, loaded=loaded, loader=loader))

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def hot_tier_stats(self) -> CacheStats:
        return self.hot.stats()

    # ---- context -----------------------------------------------------------------------------------
    async def context(self, plan: Plan, loaded: LoadResult | None, loader) -> Context:
        if plan.mode in ONLINE_MODES:
            return await self._online_context(plan)
        context = await self._linked_context(plan, loaded, loader)
        if self.config.recompute.enabled:  # the chunks' sources, tokenised (and pages rendered) off the event loop
            started = time.perf_counter()
            inputs = await asyncio.to_thread(recompute_inputs, self.vlm, self.renderer, plan.chunks, context.served)
            context.prefill.recompute = (self.config.recompute, inputs)
            context.render_ms = (time.perf_counter() - started) * 1e3  # pages rendered again, as full_image renders
        return context

    async def _linked_context(self, plan: Plan, loaded: LoadResult | None, loader) -> Context:
        query_ids = self.vlm.query_turn_ids(plan.text_after_chunks)  # the query prompt, or the query
        if loaded is not None:  # given KV, used as it is: the hot tier is neither read nor filled
            loaded = await self._repaired(plan, loaded)
            chunks = [self._chunk(kv, copy=False) for kv in loaded.kvs]
            return Context(LinkedContext(chunks, query_ids, plan.instruction), [kv.entry for kv in loaded.kvs], loaded.cache,
                           loaded.fallbacks, loaded.load_ms)
        started = time.perf_counter()
        hot = self.hot.get_many(c.entry.key for c in plan.chunks)
        missing = dataclasses.replace(plan, chunks=tuple(
            c if c.entry.key not in hot else dataclasses.replace(c, entry=None, fallback=None) for c in plan.chunks))
        fetched = None
        if len(hot) < len(plan.chunks):
            fetched = await self._repaired(missing, await self._load(missing, loader))
        chunks, served = [], []
        for position, planned in enumerate(plan.chunks):
            if planned.entry.key in hot:
                kv, entry = hot[planned.entry.key]
            else:  # onto the device once; every later request re-anchors it there
                loaded_kv = fetched.kvs[position]
                kv, entry = self._chunk(loaded_kv, copy=True), loaded_kv.entry
                self.hot.put(entry.key, kv, entry)
            chunks.append(kv)
            served.append(entry)
        report = fetched.cache if fetched is not None else CacheReport(hits=0, misses=0, nbytes_from_store=0)
        report = report.model_copy(update={"device_hits": sum(c.entry.key in hot for c in plan.chunks)})
        fallbacks = fetched.fallbacks if fetched is not None else plan.fallbacks
        return Context(LinkedContext(chunks, query_ids, plan.instruction), served, report, fallbacks,
                       (time.perf_counter() - started) * 1e3)

    async def _online_context(self, plan: Plan) -> Context:
        report, render_ms = CacheReport(hits=0, misses=0, nbytes_from_store=0), 0.0
        if plan.mode is Mode.FULL_TEXT:
            pieces = [c.text for c in plan.chunks]
        else:
            started = time.perf_counter()
            pieces = await asyncio.to_thread(lambda: [self.pages(c) for c in plan.chunks])
            render_ms = (time.perf_counter() - started) * 1e3
        instruction = [plan.instruction] if plan.instruction else []  # prompt text before the chunks, never a chunk
        return Context(OnlineContext(instruction + pieces, plan.text_after_chunks), [None] * len(plan.chunks), report, plan.fallbacks,
                       render_ms=render_ms)

    async def _load(self, plan: Plan, loader) -> LoadResult:
        if loader is None:
            raise RuntimeError("this generator has no loader to fetch KV from")
        if isinstance(loader, DeploymentHandle):
            return await cancelling(loader.load.remote(plan))
        return await asyncio.to_thread(loader.load, plan)

    async def _repaired(self, plan: Plan, loaded: LoadResult) -> LoadResult:
        return loaded if not loaded.unreadable else await asyncio.to_thread(self.repair, plan, loaded)

    def _chunk(self, kv: LoadedKV, copy: bool) -> ChunkKV:
        # A copy detaches the hot tier from the object store's (or the loader LRU's) buffer; a quantised
        # entry is dequantised on the device, so the hot tier holds KV ready to re-anchor.
        tensor = kv_tensor(kv, self.vlm.device, self.vlm.dtype, copy)
        return ChunkKV(tensor, kv.entry.position_span, kv.compile_start, kv.kind, kv.grid_thw)

    def repair(self, plan: Plan, loaded: LoadResult) -> LoadResult:
        """`loaded` with every unreadable entry rebuilt (its time added to `load_ms`), or replaced by its
        lower-tier backup and reported as a fallback; `UnservableError` when an entry has neither."""
        if not loaded.unreadable:
            return loaded
        started = time.perf_counter()
        kvs, fallbacks, unservable = list(loaded.kvs), list(loaded.fallbacks), []
        for item in loaded.unreadable:
            chunk = plan.chunks[item.position]
            try:
                tensor, entry, outcome = (self.lazy.promote(chunk, item.entry) if is_pending(item.entry)  # lazy tier
                                          else (self.recompile(chunk, item.entry).kv, item.entry, "recompiled"))
                array, dtype = to_wire(stored(tensor, self.kv_quant))  # as the store keeps it
            except ValueError as error:  # UnservableError: e.g. a page image this replica cannot read
                outcome = "unservable" if item.backup is None else "backup"
                self.metrics.kv_recompiles.inc(outcome=outcome)
                if item.backup is None:
                    unservable.append(f"{chunk.chunk_id}: {item.reason}; not rebuilt: {error}")
                    continue
                kvs[item.position] = item.backup
                fallbacks.append(FallbackReport(chunk_id=chunk.chunk_id, requested_tier=item.entry.tier or "-",
                                                served_tier=item.backup.entry.tier or "-",
                                                reason=f"{item.reason}; not rebuilt: {error}"))
                continue
            self.metrics.kv_recompiles.inc(outcome=outcome)
            kvs[item.position] = LoadedKV(array=array, dtype=dtype, entry=entry)  # exact: no fallback to report
        if unservable:
            raise UnservableError(f"KV entries unreadable and not rebuildable here: {unservable[:5]}")
        load_ms = loaded.load_ms + (time.perf_counter() - started) * 1e3
        return dataclasses.replace(loaded, kvs=tuple(kvs), fallbacks=tuple(fallbacks), unreadable=(), load_ms=load_ms)

    def recompile(self, chunk: PlannedChunk, entry: Entry) -> ChunkKV:
        return self.compile_entry(chunk, entry)[0]

    def compile_entry(self, chunk: PlannedChunk, entry: Entry) -> tuple[ChunkKV, list[list[int]]]:
        """`entry` compiled (again) as ingest compiles it, and its pages' sizes: the text of the first chunk
        (by id) with its content key, which is the one ingest compiled, rendered at the entry's tier."""
        table = self.store.chunks()
        rows = table.filter(pc.equal(table["chunk_key"], entry.cache_key.chunk_key))
        if rows.num_rows == 0:
            raise UnservableError(f"chunk {chunk.chunk_id} has no source text in the store")
        source = min(rows.select(["chunk_id", "text", "image_path"]).to_pylist(), key=lambda r: r["chunk_id"])
        with self.engine.model_lock:  # between engine steps
            return build_sized_entry(self.vlm, self.renderer, source["text"], source["image_path"], entry.tier,
                                     entry.variant)

    def pages(self, chunk: PlannedChunk) -> list[Image.Image]:
        """A chunk's pages at its tier, made the way ingest made the ones it compiled."""
        try:
            return page_images(self.renderer, chunk.text, chunk.image_path, self.render_spec.tier(chunk.tier))[0]
        except PageImageError as error:
            raise UnservableError(f"chunk {chunk.chunk_id}: {error}") from error

    def query_tokens(self, query: str) -> int:
        return len(self.vlm.query_turn_ids(query))

    def instruction_tokens(self, instruction: str) -> int:
        """Tokens the instruction adds to the serving prefix (see VLM.serving_prefix)."""
        return len(self.vlm.adapter.encode(instruction)) if instruction else 0

    def _report(self, plan: Plan, context: Context, seq: Sequence) -> AnswerReport:
        chunks = []
        for planned, served in zip(plan.chunks, context.served):  # served: after any fallback; None online
            chunks.append(ChunkReport(
                chunk_id=planned.chunk_id, doc_id=planned.doc_id, relevance=planned.relevance,
                tier=served.tier if served else planned.tier, variant=served.variant if served else None,
                num_tokens=served.num_tokens if served else planned.num_tokens,
                vision_tokens=served.vision_tokens if served else planned.vision_tokens,
                position_span=served.position_span if served else planned.position_span,
            ))
        vision_tokens = sum(c.vision_tokens for c in chunks)
        query_tokens = self.query_tokens(plan.text_after_chunks)
        context_tokens = seq.num_prompt_tokens - query_tokens  # as prefilled (the engine sets it)
        usage = TokenUsage(
            context_tokens=context_tokens, context_vision_tokens=vision_tokens,
            context_text_tokens=context_tokens - vision_tokens,
            cached_tokens=0 if plan.mode in ONLINE_MODES else context_tokens,
            query_tokens=query_tokens, completion_tokens=len(seq.token_ids),
        )
        phases = (plan.route_ms, context.load_ms, context.render_ms, seq.queue_ms, seq.reanchor_ms, seq.prefill_ms,
                  seq.decode_ms)
        timings = Timings(route_ms=plan.route_ms, load_ms=context.load_ms, render_ms=context.render_ms,
                          queue_ms=seq.queue_ms, reanchor_ms=seq.reanchor_ms, prefill_ms=seq.prefill_ms,
                          decode_ms=seq.decode_ms, total_ms=sum(phases))
        return AnswerReport(mode=plan.mode, finish_reason=FINISH[seq.end], chunks=chunks, usage=usage,
                            timings=timings, cache=context.cache, fallbacks=list(context.fallbacks),
                            generation=plan.generation)
