"""Generator: holds the VLM, builds each request's context in request order, prefills, decodes.

Linked modes (qvpic, uniform_high, image_pic, text_pic) place the loaded KV after the serving prefix
(computed once, at start-up), re-anchor it, and prefill only the query. The online modes prefill
everything: full_text the chunks' source text, full_image their pages — rendered with the store's
RenderSpec (or, for a scanned page, its own image scaled) at the tier the router chose. Those are
the pages and tiers qvpic links, so full_image is qvpic's exact, uncached reference and the gap
between the two is the cost (or error) of caching alone.

Forward passes are serialised with a lock per step, so concurrent streams interleave token by token
on the one model instead of racing for its memory.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from PIL import Image

from pipeline.compile import scale_page
from pipeline.render import Renderer
from pipeline.runtime.kv import ChunkKV
from pipeline.runtime.model import VLM, Prefill, Sampling
from pipeline.store import Store
from schemas.api import (
    AnswerReport,
    ChunkReport,
    FinishReason,
    Timings,
    TokenUsage,
    UnservableError,
)
from schemas.config import Mode, ModelSpec
from schemas.store import StoreSpec
from serve.loader import LoadResult, from_wire
from serve.router import Plan, PlannedChunk, check_store

ONLINE_MODES = (Mode.FULL_TEXT, Mode.FULL_IMAGE)
_INCOMPLETE = "\ufffd"  # a byte-level tokenizer's partial UTF-8 character: wait for the next token


@dataclass(frozen=True)
class Answer:
    text: str
    report: AnswerReport


@dataclass
class _Clock:
    render_ms: float = 0.0
    reanchor_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0

    def since(self, started: float) -> float:
        return (time.perf_counter() - started) * 1e3


class Generator:
    def __init__(self, store: StoreSpec | str, model: ModelSpec):
        manifest = Store.open(store).load_manifest_or_raise()
        check_store(manifest, model)
        self.vlm = VLM(model)
        self.render_spec = manifest.render
        self.renderer = Renderer(manifest.render)
        self.prefix_tokens = self.vlm.prefix.num_tokens  # the serving prefix KV, computed here once
        self._lock = threading.Lock()

    def generate(self, plan: Plan, loaded: LoadResult, sampling: Sampling) -> Answer:
        *_, answer = self.stream(plan, loaded, sampling)
        return answer

    def stream(self, plan: Plan, loaded: LoadResult, sampling: Sampling) -> Iterator[str | Answer]:
        """Yield answer text deltas as tokens decode, then the `Answer` (full text and report)."""
        clock = _Clock()
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
        query_tokens = self.query_tokens(plan.query)
        if plan.mode is Mode.FULL_TEXT:
            pieces = [c.text for c in plan.chunks]
        elif plan.mode is Mode.FULL_IMAGE:
            started = time.perf_counter()
            pieces = [self.pages(c) for c in plan.chunks]
            clock.render_ms = clock.since(started)
        else:
            chunks = [ChunkKV(from_wire(kv.array, kv.dtype), kv.entry.position_span, kv.compile_start, kv.kind,
                              kv.grid_thw) for kv in loaded.kvs]
            with self._lock:
                started = time.perf_counter()
                context = self.vlm.assemble(chunks)
                clock.reanchor_ms = clock.since(started)
                started = time.perf_counter()
                state = self.vlm.prefill_query(context, plan.query)
                clock.prefill_ms = clock.since(started)
            return state, context.num_tokens
        with self._lock:
            started = time.perf_counter()
            state = self.vlm.prefill_full(pieces, plan.query)
            clock.prefill_ms = clock.since(started)
        return state, state.cache.get_seq_length() - query_tokens

    def pages(self, chunk: PlannedChunk) -> list[Image.Image]:
        """A chunk's pages at its tier, made the way ingest made the ones it compiled."""
        tier = self.render_spec.tier(chunk.tier)
        if chunk.image_path is None:
            return self.renderer.render(chunk.text, tier).pages
        try:
            with Image.open(chunk.image_path) as image:
                return [scale_page(image, self.render_spec, tier)]
        except OSError as error:
            message = f"page image of chunk {chunk.chunk_id} is not readable on this replica: {error}"
            raise UnservableError(message) from error

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
            query_tokens=self.query_tokens(plan.query), completion_tokens=completion_tokens,
        )
        timings = Timings(route_ms=plan.route_ms, load_ms=loaded.load_ms, render_ms=clock.render_ms,
                          reanchor_ms=clock.reanchor_ms, prefill_ms=clock.prefill_ms, decode_ms=clock.decode_ms,
                          total_ms=plan.route_ms + loaded.load_ms + clock.render_ms + clock.reanchor_ms
                          + clock.prefill_ms + clock.decode_ms)
        return AnswerReport(mode=plan.mode, finish_reason=finish, chunks=chunks, usage=usage, timings=timings,
                            cache=loaded.cache, fallbacks=list(loaded.fallbacks))
