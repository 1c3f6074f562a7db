"""Relevance router: which chunks, in which order, at which tier and variant — decided before any KV moves.

`Router(config)` reads what it needs of its `RouterConfig` (serve/config.py). `Router.plan` embeds the
query (the deployed `BatchingRouter` batches concurrent queries with `@serve.batch`) and `route`s it
against one serving generation: retrieval selects rows from the generation's memory-mapped catalog and
vector index (serve/routing/retrieval.py), placement decides tiers from relevance and prices every choice
from the entry table (serve/routing/placement.py). The router follows the store's published generations
without a redeploy (pipeline/store/reload.py): a plan carries the
generation it was routed against, and every entry in it comes from that generation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
from ray import serve

from pipeline.runtime import Embedder, check_store
from pipeline.store import GenerationWatcher, LeaseKeeper, Store, acquire_current, ensure_generation
from schemas.api import AnswerRequest
from schemas.config import check_tau
from schemas.errors import ApiError, TooLargeError
from schemas.store import ManifestError
from serve.config import RouterConfig
from serve.kv import lazy_planner
from serve.plan import Plan, PlannedChunk
from serve.routing.placement import PlacementSpec, Selection, mode_tier, place
from serve.routing.prompt import PromptTemplate, conversation_digest
from serve.routing.retrieval import Snapshot, open_snapshot


def template_order(chunks: list[PlannedChunk], instruction: str, text_after: str
                   ) -> tuple[list[PlannedChunk], str, str]:
    """`(chunks, instruction, text after the chunks)` in the order a chat template that renders every image of a
    turn before any of its text (`ChatTemplate.images_first`: LLaVA-OneVision's) renders the same content: the
    chunks served as pages first, then those served as text, each in request order; with pages in context the
    instruction, being text, follows them too, at the front of the text prefilled after the chunks. That is the
    template's own prompt unless text chunks sit beside pages: the template would put the instruction before
    them, and linked KV leaves no place to prefill text between chunks, so there it comes after them."""
    pages = [c for c in chunks if c.tier is not None]
    if not pages:
        return chunks, instruction, text_after
    return pages + [c for c in chunks if c.tier is None], "", instruction + text_after


class Router:
    def __init__(self, config: RouterConfig):
        self.config = config
        self.store = Store.open(config.store)
        self.prompt = PromptTemplate.load(config.model)
        self.embedder = Embedder(config.embedder_dir)
        self.max_context_tokens = min(config.max_context_tokens or self.prompt.max_positions, self.prompt.max_positions)
        self.keeper = LeaseKeeper(self.store, "router", config.reload)
        ensure_generation(self.store)  # a store no job published yet: snapshot it once, here
        current = acquire_current(self.store, self.keeper)
        self.snapshot: Snapshot = self.open_generation(current)  # swapped whole on reload
        self.watcher = GenerationWatcher(self.store, self.keeper, config.reload, current, self.open_generation,
                                         self._install)

    def open_generation(self, generation: int) -> Snapshot:
        """`generation` opened and checked against this router's model and embedder (`ManifestError`)."""
        snapshot = open_snapshot(self.store, generation, self.config.scan)
        check_store(snapshot.manifest, self.config.model)
        if self.embedder.model_name != snapshot.manifest.embedder:
            raise ManifestError(f"store was embedded with {snapshot.manifest.embedder!r}, "
                                f"the router loaded {self.embedder.model_name!r}")
        return snapshot

    def _install(self, generation: int, snapshot: Snapshot) -> None:
        self.snapshot = snapshot  # one reference: requests in flight keep the snapshot they started with

    @property
    def generation(self) -> int:
        return self.snapshot.generation

    async def embed_query(self, query: str) -> np.ndarray:
        return (await asyncio.to_thread(self.embedder.embed, [query]))[0]  # [dim], off the event loop

    async def plan(self, request: AnswerRequest, budget_tokens: int | None = None) -> Plan:
        """`budget_tokens` caps the context (prefix + chunks): only promotions that fit it are made."""
        started = time.perf_counter()
        # Named chunks are scored against the question too (relevance routes their tiers); top_k 0 selects nothing.
        selects = request.chunk_ids is not None or request.doc_ids is not None or request.top_k != 0
        query_vector = await self.embed_query(request.query) if selects and request.query else None
        return self.route(request, query_vector, budget_tokens, started)

    def route(self, request: AnswerRequest, query_vector: np.ndarray | None, budget_tokens: int | None = None,
              started: float | None = None) -> Plan:
        """The plan of `request` for an embedded query: retrieval and placement against one generation."""
        started = time.perf_counter() if started is None else started
        snapshot = self.snapshot
        if query_vector is None and request.chunk_ids is None and request.doc_ids is None:
            rows, relevance = [], []  # top_k 0 (plain chat), or nothing to retrieve with (an image-only question)
        else:
            if query_vector is None:  # named chunks: scored against the question when there is one, else 0
                query_vector = np.zeros(self.embedder.dim, dtype=np.float32)
            rows, relevance = snapshot.select(request, query_vector)
        if len(rows) > self.config.max_chunks:
            raise TooLargeError(f"{len(rows)} chunks selected; this server takes at most {self.config.max_chunks} "
                                "per request")
        if request.messages is not None:
            layout = self.prompt.conversation(request.messages)
        else:
            layout = self.prompt.native(request.instruction, request.text_after_chunks)
        prefix_tokens = self.prompt.tokens(layout.before)
        query_tokens = self.prompt.tokens(layout.after)
        fixed_tokens = prefix_tokens + query_tokens + request.max_new_tokens
        room_tokens = self.max_context_tokens - fixed_tokens
        if budget_tokens is not None:
            room_tokens = min(room_tokens, budget_tokens - prefix_tokens)
        catalog, defaults = snapshot.catalog, self.config.defaults
        overrides = {"tau": request.tau, "max_high_res": request.max_high_res, "normalisation": request.normalisation}
        policy = defaults.model_copy(update={k: v for k, v in overrides.items() if v is not None})
        try:  # model_copy does not validate: a request's τ > 1 under the server's bounded normalisation
            check_tau(policy.tau, policy.normalisation)
        except ValueError as error:
            raise ApiError(str(error)) from None
        spec = PlacementSpec(policy=policy,
                             low=snapshot.low, tier=mode_tier(request.mode, request.tier, snapshot.manifest.tiers),
                             pending=lazy_planner(snapshot.manifest, self.config.model))
        selected = Selection(chunks=catalog.chunk_rows(rows), slots=catalog.entries_of(rows), relevance=relevance,
                             texts=lambda: catalog.texts(rows))
        chunks, fallbacks = place(request.mode, selected, spec, room_tokens)
        instruction, query_prompt = request.instruction, request.query_prompt
        if self.prompt.template.images_first:
            chunks, instruction, text_after = template_order(chunks, instruction, request.text_after_chunks)
            if instruction != request.instruction:  # it moved after the pages: count it there
                query_prompt = text_after
                layout = self.prompt.native(instruction, text_after)
                prefix_tokens, query_tokens = self.prompt.tokens(layout.before), self.prompt.tokens(layout.after)
                fixed_tokens = prefix_tokens + query_tokens + request.max_new_tokens
        needed = fixed_tokens + sum(c.num_tokens for c in chunks)
        if needed > self.max_context_tokens:
            raise TooLargeError(
                f"request needs {needed} tokens (prefix {prefix_tokens} + chunks {needed - fixed_tokens} + "
                f"query {query_tokens} + max_new_tokens {request.max_new_tokens}); "
                f"the context holds {self.max_context_tokens}")
        if self.config.carry_sources:  # selective recompute rebuilds each linked chunk's tokens from its source
            chunks = [c if c.text is not None else
                      dataclasses.replace(c, text=source["text"], image_path=source["image_path"] or None)
                      for c, source in zip(chunks, catalog.texts(rows))]
        route_ms = (time.perf_counter() - started) * 1e3
        return Plan(mode=request.mode, query=request.query, chunks=tuple(chunks), prefix_tokens=prefix_tokens,
                    query_tokens=query_tokens, fallbacks=tuple(fallbacks), route_ms=route_ms,
                    query_embedding=query_vector, generation=snapshot.generation, instruction=instruction,
                    query_prompt=query_prompt, layout=layout,
                    conversation=conversation_digest(request.messages) if request.messages is not None else "")

    def reload(self) -> bool:
        """Switch to the store's current generation now, if it is newer (the watcher also does it on its own)."""
        return self.watcher.check()

    def close(self) -> None:
        self.watcher.close()
        self.keeper.close()

    def __del__(self) -> None:  # Serve calls it on graceful shutdown: drop this replica's lease
        if hasattr(self, "watcher"):
            self.close()


class BatchingRouter(Router):
    """The deployed router: queries arriving together are embedded in one call (`@serve.batch` needs a
    Serve replica, so the plain `Router` embeds one at a time)."""

    # No waiting for company: a lone query pays nothing; queries arriving while one embeds form the next batch.
    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.0)
    async def embed_query(self, queries: list[str]) -> list[np.ndarray]:
        return list(await asyncio.to_thread(self.embedder.embed, queries))  # [n, dim] -> n x [dim]
