"""Generator: holds the VLM, builds each request's context in request order, prefills, decodes.

Linked modes (qvpic, uniform_high, image_pic, text_pic) place the loaded KV after the serving prefix
(computed once, at start-up), re-anchor it, and prefill only the query. The online modes prefill
everything: full_text the chunks' source text, full_image their pages — rendered with the store's
RenderSpec (or, for a scanned page, its own image scaled) at the tier the router chose. Those are
the pages and tiers qvpic links, so full_image is qvpic's exact, uncached reference and the gap
between the two is the cost (or error) of caching alone.

Forward passes are serialised with a lock per step, so concurrent streams interleave token by token
on the one model instead of racing for its memory.

An entry the loader could not read (missing or corrupt shard) is rebuilt here before assembly, the way
ingest built it: the chunk's stored source text (or page image), rendered with the store's RenderSpec
and compiled by this model — the same bytes on the same hardware. Only when that is impossible (a
page image this replica cannot read) does the request take the loader's lower-tier backup, reported
as a fallback, or fail with 503. Each outcome is counted in `qvpic_kv_recompiles`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow.compute as pc
import torch
from PIL import Image

from pipeline.entries import PageImageError, build_entry, page_images
from pipeline.render import Renderer
from pipeline.runtime.kv import ChunkKV
from pipeline.runtime.model import VLM, Prefill
from schemas.sampling import Sampling
from pipeline.store import Store
from schemas.api import (
    AnswerReport,
    ChunkReport,
    FallbackReport,
    FinishReason,
    Timings,
    TokenUsage,
    UnservableError,
)
from schemas.config import Mode, ModelSpec
from schemas.store import StoreSpec
from serve.loader import from_wire, to_wire
from serve.plan import Answer, Entry, LoadedKV, LoadResult, Plan, PlannedChunk
from serve.metrics import serve_metrics
from serve.router import check_store

ONLINE_MODES = (Mode.FULL_TEXT, Mode.FULL_IMAGE)
_INCOMPLETE = "\ufffd"  # a byte-level tokenizer's partial UTF-8 character: wait for the next token


@dataclass
class _Clock:
    device: torch.device
    render_ms: float = 0.0
    reanchor_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0

    def since(self, started: float) -> float:
        if self.device.type == "cuda":  # kernels run asynchronously: wait for the phase's work to finish
            torch.cuda.synchronize(self.device)
        return (time.perf_counter() - started) * 1e3


class Generator:
    def __init__(self, store: StoreSpec | str, model: ModelSpec):
        self.store = Store.open(store)  # its chunk table is read only to rebuild an unreadable entry
        manifest = self.store.load_manifest_or_raise()
        check_store(manifest, model)
        self.vlm = VLM(model)
        self.render_spec = manifest.render
        self.renderer = Renderer(manifest.render)
        self.prefix_tokens = self.vlm.prefix.num_tokens  # the serving prefix KV, computed here once
        self._lock = threading.Lock()
        self.metrics = serve_metrics()

    def generate(self, plan: Plan, loaded: LoadResult, sampling: Sampling) -> Answer:
        *_, answer = self.stream(plan, loaded, sampling)
        return answer

    def stream(self, plan: Plan, loaded: LoadResult, sampling: Sampling) -> Iterator[str | Answer]:
        """Yield answer text deltas as tokens decode, then the `Answer` (full text and report)."""
        clock = _Clock(self.vlm.device)
        loaded = self.repair(plan, loaded)
        state, context_tokens = self._prefill(plan, loaded, clock)
        tokenizer, ids, emitted = self.vlm.tokenizer, [], ""
        tokens = self.vlm.decode(state, sampling)
        while True:
            with self._lock:
                started = time.perf_counter()
                token = next(tokens, None)
                clock.decode_ms += clock.since(started)
            if token is None:
                break
            ids.append(token)
            text = tokenizer.decode(ids, skip_special_tokens=True)
            if not text.endswith(_INCOMPLETE) and text.startswith(emitted) and len(text) > len(emitted):
                yield text[len(emitted):]
                emitted = text
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if text.startswith(emitted) and len(text) > len(emitted):
            yield text[len(emitted):]
        finish = FinishReason.LENGTH if len(ids) >= sampling.max_new_tokens else FinishReason.STOP
        yield Answer(text, self._report(plan, loaded, clock, context_tokens, len(ids), finish))

    def _prefill(self, plan: Plan, loaded: LoadResult, clock: _Clock) -> tuple[Prefill, int]:
        """The prefilled state and the number of context tokens (prefix + chunks) it holds."""
        query_tokens = self.query_tokens(plan.text_after_chunks)
        instruction = [plan.instruction] if plan.instruction else []  # prompt text, never a chunk
        if plan.mode is Mode.FULL_TEXT:
            pieces = instruction + [c.text for c in plan.chunks]
        elif plan.mode is Mode.FULL_IMAGE:
            started = time.perf_counter()
            pieces = instruction + [self.pages(c) for c in plan.chunks]
            clock.render_ms = clock.since(started)
        else:
            chunks = [ChunkKV(from_wire(kv.array, kv.dtype), kv.entry.position_span, kv.compile_start, kv.kind,
                              kv.grid_thw) for kv in loaded.kvs]
            with self._lock:
                started = time.perf_counter()
                context = self.vlm.assemble(chunks, plan.instruction)
                clock.reanchor_ms = clock.since(started)
                started = time.perf_counter()
                state = self.vlm.prefill_query(context, plan.text_after_chunks)
                clock.prefill_ms = clock.since(started)
            return state, context.num_tokens
        with self._lock:
            started = time.perf_counter()
            state = self.vlm.prefill_full(pieces, plan.text_after_chunks)
            clock.prefill_ms = clock.since(started)
        return state, state.cache.get_seq_length() - query_tokens

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
                array, dtype = to_wire(self.recompile(chunk, item.entry).kv)
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
            self.metrics.kv_recompiles.inc(outcome="recompiled")
            kvs[item.position] = LoadedKV(array, dtype, item.entry)  # exact: no fallback to report
        if unservable:
            raise UnservableError(f"KV entries unreadable and not rebuildable here: {unservable[:5]}")
        load_ms = loaded.load_ms + (time.perf_counter() - started) * 1e3
        return dataclasses.replace(loaded, kvs=tuple(kvs), fallbacks=tuple(fallbacks), unreadable=(), load_ms=load_ms)

    def recompile(self, chunk: PlannedChunk, entry: Entry) -> ChunkKV:
        """`entry` compiled again from its source as ingest compiled it: the text of the first chunk (by
        id) with its content key, which is the one ingest compiled, rendered at the entry's tier."""
        table = self.store.chunks()
        rows = table.filter(pc.equal(table["chunk_key"], entry.row["chunk_key"]))
        if rows.num_rows == 0:
            raise UnservableError(f"chunk {chunk.chunk_id} has no source text in the store")
        source = min(rows.select(["chunk_id", "text", "image_path"]).to_pylist(), key=lambda r: r["chunk_id"])
        with self._lock:
            return build_entry(self.vlm, self.renderer, source["text"], source["image_path"], entry.tier, entry.variant)

    def pages(self, chunk: PlannedChunk) -> list[Image.Image]:
        """A chunk's pages at its tier, made the way ingest made the ones it compiled."""
        try:
            return page_images(self.renderer, chunk.text, chunk.image_path, self.render_spec.tier(chunk.tier))[0]
        except PageImageError as error:
            raise UnservableError(f"chunk {chunk.chunk_id}: {error}") from error

    def query_tokens(self, query: str) -> int:
        return len(self.vlm.adapter.encode(query)) + len(self.vlm.adapter.turn_suffix_ids)

    def _report(self, plan: Plan, loaded: LoadResult, clock: _Clock, context_tokens: int,
                completion_tokens: int, finish: FinishReason) -> AnswerReport:
        chunks = []
        for planned, kv in zip(plan.chunks, loaded.kvs):
            served = kv.entry if kv is not None else None  # after any loader fallback
            chunks.append(ChunkReport(
                chunk_id=planned.chunk_id, doc_id=planned.doc_id, relevance=planned.relevance,
                tier=served.tier if served else planned.tier, variant=served.variant if served else None,
                num_tokens=served.num_tokens if served else planned.num_tokens,
                vision_tokens=served.vision_tokens if served else planned.vision_tokens,
                position_span=served.position_span if served else planned.position_span,
            ))
        vision_tokens = sum(c.vision_tokens for c in chunks)
        usage = TokenUsage(
            context_tokens=context_tokens, context_vision_tokens=vision_tokens,
            context_text_tokens=context_tokens - vision_tokens,
            cached_tokens=0 if plan.mode in ONLINE_MODES else context_tokens,
            query_tokens=self.query_tokens(plan.text_after_chunks), completion_tokens=completion_tokens,
        )
        timings = Timings(route_ms=plan.route_ms, load_ms=loaded.load_ms, render_ms=clock.render_ms,
                          reanchor_ms=clock.reanchor_ms, prefill_ms=clock.prefill_ms, decode_ms=clock.decode_ms,
                          total_ms=plan.route_ms + loaded.load_ms + clock.render_ms + clock.reanchor_ms
                          + clock.prefill_ms + clock.decode_ms)
        return AnswerReport(mode=plan.mode, finish_reason=finish, chunks=chunks, usage=usage, timings=timings,
                            cache=loaded.cache, fallbacks=list(loaded.fallbacks), generation=plan.generation)
