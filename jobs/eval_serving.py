"""The serving roles in-process for `qvpic eval`: answers, routing plans and fidelity traces.

Router, loader and generator are the deployed classes run as plain objects (no Serve), so what the
evaluation measures is what the service does: the same routing, the same stored KV, the same model.
"""

from __future__ import annotations

import asyncio
import dataclasses

from pipeline.eval import (
    Answered,
    QAItem,
    RoutedChunk,
    RoutePlanner,
    ServingSpec,
    StoreView,
    Trace,
    answer_token_ids,
    item_request,
    trace_full,
    trace_linked,
)
from pipeline.runtime import ChunkKV
from schemas.api import MAX_IDS_PER_REQUEST, AnswerRequest
from schemas.config import ModelSpec, RouterSpec
from schemas.modes import ChunkKind
from schemas.sampling import Sampling
from serve import LocalStack, build_local
from serve.kv import kv_tensor
from serve.routing import Router

LRU_NBYTES = 4 << 30


class InProcessAnswerer:
    """The three serving roles as plain objects (serve/local.py `build_local`); TTFT = route + load + render +
    re-anchor + prefill, each timed by the role that does it (the wall time to the first token, decoding excluded)."""

    def __init__(self, stack: LocalStack):
        self.stack = stack
        self.router, self.loader, self.generator = stack.router, stack.loader, stack.generator

    @classmethod
    def open(cls, store: str, model: ModelSpec, router: RouterSpec | None = None) -> InProcessAnswerer:
        return cls(build_local({"store": store, "model": model.model_dump(),
                                "router": {"defaults": (router or RouterSpec()).model_dump(),
                                           "max_chunks": MAX_IDS_PER_REQUEST},
                                "loader": {"max_nbytes": LRU_NBYTES}}))

    def clear_caches(self) -> None:
        """Empty the generator's device hot tier and the loader's host cache: the next request reads the store."""
        self.stack.clear_caches()

    def __call__(self, request: AnswerRequest) -> Answered:
        plan = asyncio.run(self.router.plan(request))
        answer = self.generator.generate_blocking(plan, Sampling.of(request))
        t = answer.report.timings
        return Answered(answer.text, answer.report, t.route_ms + t.load_ms + t.render_ms + t.reanchor_ms + t.prefill_ms)


def planner(router: Router) -> RoutePlanner:
    """The router's plan of a request, reduced to what the legibility check reads (no KV moves)."""
    def plan(request: AnswerRequest) -> list[RoutedChunk]:
        return [RoutedChunk(c.chunk_id, c.tier, c.vision_tokens) for c in asyncio.run(router.plan(request)).chunks]
    return plan


class ServedTraces:
    """(cached, reference) traces of an item in a cached configuration, for `run_fidelity`.

    Cached: the router plans the request as it serves it, the loader reads the stored KV, the generator's
    model assembles it after the serving prefix and instruction and prefills the query. Reference: one full
    prefill of the same pieces — the chunks' pages rendered at exactly the tiers served (full_image), or
    their source texts (full_text) — shared by every configuration that serves the same tiers.
    """

    def __init__(self, answerer: InProcessAnswerer, view: StoreView, num_answer_tokens: int = 16):
        self.answerer, self.view, self.num_answer_tokens = answerer, view, num_answer_tokens
        self._references: dict[tuple, Trace] = {}

    def __call__(self, item: QAItem, serving: ServingSpec) -> tuple[Trace, Trace]:
        router, loader, generator = self.answerer.router, self.answerer.loader, self.answerer.generator
        vlm = generator.vlm
        plan = asyncio.run(router.plan(item_request(item, self.view, serving)))
        loaded = generator.repairer.repair(plan, loader.load(plan))
        chunks = [ChunkKV(kv_tensor(kv, vlm.device, vlm.dtype, copy=False), kv.entry.position_span, kv.compile_start,
                          kv.kind, kv.grid_thw)
                  for kv in loaded.kvs]
        answer = answer_token_ids(vlm, item, self.num_answer_tokens)
        query = plan.text_after_chunks
        cached = trace_linked(vlm, vlm.assemble(chunks, plan.instruction), query, answer)
        text = serving.mode.kind is ChunkKind.TEXT
        tiers = tuple(kv.entry.tier for kv in loaded.kvs)  # as served, after any fallback
        key = (item.task, item.id, tiers)
        if key not in self._references:
            pieces = [self.view.text_of[c.chunk_id] if text else generator.contexts.pages(dataclasses.replace(
                c, tier=tier, text=self.view.text_of[c.chunk_id], image_path=self.view.image_path_of.get(c.chunk_id)))
                for c, tier in zip(plan.chunks, tiers)]
            instruction = [plan.instruction] if plan.instruction else []
            self._references[key] = trace_full(vlm, instruction + pieces, query, answer)
        return cached, self._references[key]
