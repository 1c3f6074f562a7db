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
from pipeline.store import (
    GenerationWatcher,
    LeaseKeeper,
    Store,
    acquire_current,
    check_seal,
    ensure_generation,
    hmac_key,
    read_generation,
)
from schemas.api import MAX_QUERY_CHARS, AnswerRequest
from schemas.config import check_tau
from schemas.errors import ApiError, ContextLengthError, TooLargeError
from schemas.store import ManifestError
from schemas.utility import TokenizeRequest
from serve.config import RouterConfig
from serve.kv import lazy_planner
from serve.plan import Embedded, Plan, PlannedChunk, Tokenized
from serve.routing.embed_queue import EmbedQueue, Priority
from serve.routing.framer import Framer
from serve.routing.placement import PlacementSpec, Retrieved, mode_tier, place
from serve.routing.prompt import Framing, InvalidMessageError, PromptTemplate, template_order
from serve.routing.query_vectors import QueryVectors
from serve.routing.retrieval import Snapshot, open_snapshot
from serve.routing.token_floor import TokenFloor


class Router:
    def __init__(self, config: RouterConfig):
        self.config = config
        self.store = Store.open(config.store)
        self.prompt = PromptTemplate.load(config.model)
        self.token_floor = TokenFloor(self.prompt.tokenizer)
        self.framer = Framer(config.model, config.framing)  # its processes start with its first conversation
        self.embedder = Embedder(config.embedder_dir, threads=config.embed_threads)
        self.embeds = EmbedQueue(self.embedder.embed, self.embedder.batch_size,  # bulk: a thread of low priority
                                 bulk=self.embedder.on_one_thread().embed)
        self.query_vectors = QueryVectors(config.query_cache_entries)
        self.max_context_tokens = min(config.max_context_tokens or self.prompt.max_positions, self.prompt.max_positions)
        self.keeper = LeaseKeeper(self.store, "router", config.reload)
        self.hmac_key = hmac_key(config.hmac_key_file)  # None: seals are not checked
        ensure_generation(self.store)  # a store no job published yet: snapshot it once, here
        current = acquire_current(self.store, self.keeper)
        self.snapshot: Snapshot = self.open_generation(current)  # swapped whole on reload
        self.watcher = GenerationWatcher(self.store, self.keeper, config.reload, current, self.open_generation,
                                         self._install)

    def open_generation(self, generation: int) -> Snapshot:
        """`generation` opened and checked against this router's model and embedder, and its seal against the HMAC
        key when one is configured, before anything of it is opened (`ManifestError`; `SealError` is one)."""
        if self.hmac_key is not None:
            check_seal(self.store, read_generation(self.store, generation), self.hmac_key)
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
        return (await self.embeds.embed_texts([query], Priority.QUERY))[0]  # [dim], off the event loop

    async def embed_history(self, queries: list[str]) -> list[np.ndarray]:
        """A conversation's earlier user messages, each queued after every route's question, one at a time: a
        question arriving meanwhile waits for one at most (8 in one batch: b's p99 ×9 beside 256-turn histories)."""
        return [v[0] for v in await asyncio.gather(*(self.embeds.embed_texts([q], Priority.HISTORY) for q in queries))]

    async def embed(self, texts: list[str]) -> Embedded:
        """`texts` embedded as queries and chunks are, off the event loop, a batch at a time behind any route's
        query (serve/routing/embed_queue.py)."""
        vectors = await self.embeds.embed_texts(texts, Priority.BULK)
        return Embedded(vectors=vectors, prompt_tokens=await asyncio.to_thread(self.embedder.num_tokens, texts))

    async def plan(self, request: AnswerRequest, budget_tokens: int | None = None,
                   collections: frozenset[str] | None = None, cache_salt: bytes = b"") -> Plan:
        """`budget_tokens` caps the whole prompt (prefix + chunks + query): only promotions that fit it are made.
        Only the chunks of `collections` exist for the request (None: every collection, for offline callers; the
        ingress passes the authenticated tenant's grant, never anything a client sent). `cache_salt`: the
        tenant's (server-side), under which query vectors are remembered (serve/routing/query_vectors.py)."""
        started = time.perf_counter()
        self.refuse_over_long(request)  # before the history's queries embed and its messages are laid out
        queries = self.group_queries(request)
        vectors = [self.query_vectors.get(cache_salt, q) if q else None for q in queries]
        missing = [i for i, (q, v) in enumerate(zip(queries, vectors)) if q and v is None]
        # The prompt's text is laid out on a worker thread while the queries embed (the embedder's forward releases
        # the GIL: the layout's Python costs no wall time); framing decodes the messages' images and tokenises the
        # history, which would stall every other request of this replica's event loop (issue 60). A large
        # conversation is framed in a framing process, whose GIL is not the replica's (serve/routing/framer.py). The
        # question embeds at once, the history's queries after every route's question (Priority.HISTORY); a prompt that
        # framing finds longer than the context is refused there, its history's queries cancelled unembedded.
        question = asyncio.ensure_future(self.embed_query(queries[-1])) if len(queries) - 1 in missing else None
        earlier = [i for i in missing if i < len(queries) - 1]
        history = asyncio.ensure_future(self.embed_history([queries[i] for i in earlier])) if earlier else None
        try:
            offloaded = self.framer.offloads(request.messages, request.tools)
            framing = await (self.framer.frame(request, len(queries), cache_salt) if offloaded
                             else asyncio.to_thread(self.frame, request, len(queries)))
            if request.messages is not None:  # a native prompt may move its instruction (route recounts it)
                framing.refuse_past(self.max_context_tokens, request.max_new_tokens)
            embedded = ([await question] if question else []) + (await history if history else [])
        finally:
            for pending in (question, history):
                if pending is not None and not pending.done():
                    pending.cancel()
        for i, vector in zip(([len(queries) - 1] if question else []) + earlier, embedded):
            vectors[i] = vector
            self.query_vectors.put(cache_salt, queries[i], vector)
        return self.route(request, vectors, budget_tokens, started, collections, framing)

    def group_queries(self, request: AnswerRequest) -> list[str]:
        """What each group of chunks is scored against, oldest first: a conversation's earlier user messages (with
        `history_chunks`, when the request retrieves; the latest `max_history_queries` of them), then the question.
        An empty one selects nothing."""
        named = request.chunk_ids is not None or request.doc_ids is not None
        if not named and request.top_k == 0:
            return [""]
        if request.messages is None or named or not (request.history_chunks and self.config.history_chunks):
            return [request.query]
        earlier = [m.text()[:MAX_QUERY_CHARS] for m in request.messages if m.role == "user"][:-1]
        kept = self.config.max_history_queries  # the latest ones: the oldest groups are the first left empty anyway
        return (earlier[max(0, len(earlier) - kept):] if kept else []) + [request.query]

    def refuse_over_long(self, request: AnswerRequest) -> None:
        """ContextLengthError (400, naming `messages`) when the conversation's token floor and max_new_tokens
        already exceed the context: no layout, no embedding (serve/routing/token_floor.py)."""
        if request.messages is not None:
            self.token_floor.refuse(request.messages, request.max_new_tokens, self.max_context_tokens)

    def frame(self, request: AnswerRequest, groups: int) -> Framing:
        """The prompt's text around `groups` groups of chunks, laid out and counted, on the calling thread
        (`PromptTemplate.frame`): the part of a route that needs no query vector."""
        self.refuse_over_long(request)  # `route` called without `plan` (eval, benchmarks): still before the layout
        return self.prompt.frame(request, groups)

    def route(self, request: AnswerRequest, vectors: list[np.ndarray | None] | np.ndarray | None,
              budget_tokens: int | None = None, started: float | None = None,
              collections: frozenset[str] | None = None, framing: Framing | None = None) -> Plan:
        """The plan of `request` for its embedded queries (one per group, see `group_queries`): retrieval and
        placement against one generation. A conversation's groups sit at its user messages, the last at the
        question; the oldest history groups are left empty when the context cannot hold them all. `framing`:
        `frame(request, len(vectors))`, where the caller already has it."""
        started = time.perf_counter() if started is None else started
        if vectors is None or isinstance(vectors, np.ndarray):
            vectors = [vectors]
        snapshot = self.snapshot
        framing = framing or self.frame(request, len(vectors))
        layout, text_tokens = framing.layout, framing.text_tokens
        prefix_tokens, query_tokens = sum(text_tokens[:-1]), text_tokens[-1]
        fixed_tokens = prefix_tokens + query_tokens + request.max_new_tokens
        room_tokens = self.max_context_tokens - fixed_tokens
        if budget_tokens is not None:
            room_tokens = min(room_tokens, budget_tokens - prefix_tokens - query_tokens)  # it covers the whole prompt
        spec = self.placement_spec(request, snapshot)
        groups: list[list[PlannedChunk]] = []
        fallbacks: list = []
        for g, vector in reversed(list(enumerate(vectors))):  # the question first: it gets the room it needs
            chunks, dropped = self.group(request, vector, snapshot, spec, room_tokens, g, collections)
            if g < len(vectors) - 1 and (sum(c.num_tokens for c in chunks) > room_tokens
                                         or sum(map(len, groups)) + len(chunks) > self.config.max_chunks):
                chunks, dropped = [], []  # an earlier question's chunks that no longer fit: that group stays empty
            groups.insert(0, chunks)
            fallbacks = dropped + fallbacks
            room_tokens -= sum(c.num_tokens for c in chunks)
        chunks = [c for group in groups for c in group]
        if len(chunks) > self.config.max_chunks:
            raise TooLargeError(f"{len(chunks)} chunks selected; this server takes at most {self.config.max_chunks} "
                                "per request")
        instruction, query_prompt = request.instruction, request.query_prompt
        if self.prompt.template.images_first and request.messages is None:
            chunks, instruction, text_after = template_order(chunks, instruction, request.text_after_chunks)
            if instruction != request.instruction:  # it moved after the pages: count it there
                query_prompt = text_after
                layout = self.prompt.native(instruction, text_after)
                prefix_tokens, query_tokens = self.prompt.tokens(layout.before), self.prompt.tokens(layout.after)
                fixed_tokens = prefix_tokens + query_tokens + request.max_new_tokens
        needed = fixed_tokens + sum(c.num_tokens for c in chunks)
        if needed > self.max_context_tokens:
            raise ContextLengthError(
                f"request needs {needed} tokens (prompt text {prefix_tokens} + chunks {needed - fixed_tokens} + "
                f"question {query_tokens} + max_new_tokens {request.max_new_tokens}); "
                f"the context holds {self.max_context_tokens}", counted_tokens=needed - request.max_new_tokens)
        route_ms = (time.perf_counter() - started) * 1e3
        return Plan(mode=request.mode, query=request.query, chunks=tuple(chunks), prefix_tokens=prefix_tokens,
                    query_tokens=query_tokens, fallbacks=tuple(fallbacks), route_ms=route_ms,
                    query_embedding=vectors[-1], generation=snapshot.generation, instruction=instruction,
                    query_prompt=query_prompt, layout=layout,
                    conversation=framing.conversation, conversation_chain=framing.conversation_chain)

    def placement_spec(self, request: AnswerRequest, snapshot: Snapshot) -> PlacementSpec:
        overrides = {"tau": request.tau, "max_high_res": request.max_high_res, "normalisation": request.normalisation}
        policy = self.config.defaults.model_copy(update={k: v for k, v in overrides.items() if v is not None})
        try:  # model_copy does not validate: a request's τ > 1 under the server's bounded normalisation
            check_tau(policy.tau, policy.normalisation)
        except ValueError as error:
            raise ApiError(str(error)) from None
        return PlacementSpec(policy=policy,
                             low=snapshot.low, tier=mode_tier(request.mode, request.tier, snapshot.manifest.tiers),
                             pending=lazy_planner(snapshot.manifest, self.config.model))

    def group(self, request: AnswerRequest, vector: np.ndarray | None, snapshot: Snapshot, spec: PlacementSpec,
              room_tokens: int, group: int, collections: frozenset[str] | None = None
              ) -> tuple[list[PlannedChunk], list]:
        """One group's chunks, placed: what `vector` retrieves (or the named chunks, scored against it)."""
        named = request.chunk_ids is not None or request.doc_ids is not None
        if vector is None and not named:
            return [], []  # top_k 0 (plain chat), or nothing to retrieve with (an image-only question)
        if vector is None:  # named chunks without a question to score them against: relevance 0
            vector = np.zeros(self.embedder.dim, dtype=np.float32)
        rows, relevance = snapshot.select(request, vector, self.config.max_chunks, collections)  # 413 past max_chunks
        catalog = snapshot.catalog
        entries = snapshot.chunk_entries(rows)
        selected = Retrieved(chunks=catalog.chunk_rows(rows), entries=entries, relevance=relevance,
                             texts=lambda: catalog.texts(rows))
        chunks, fallbacks = place(request.mode, selected, spec, room_tokens, group)
        if self.config.carry_sources:  # selective recompute rebuilds each linked chunk's tokens from its source
            chunks = [c if c.text is not None else
                      dataclasses.replace(c, text=source["text"], image_path=source["image_path"] or None)
                      for c, source in zip(chunks, catalog.texts(rows))]
        if self.prompt.template.images_first and request.messages is not None:
            chunks = template_order(chunks, "", "")[0]  # pages first, as the template renders a turn
        return chunks, list(fallbacks)

    async def tokenize(self, request: TokenizeRequest) -> Tokenized:
        """`/tokenize`: a prompt's tokens, or the messages' as a chat request's prompt holds them with no store
        chunks (InvalidMessageError: a 400, as on chat), and the context this router fills. A large conversation
        is rendered in a framing process, as a chat request's is."""
        if request.prompt is not None:
            tokens = await asyncio.to_thread(self.prompt.encode, request.prompt)
        elif self.framer.offloads(request.messages):
            tokens = await self.framer.tokenize(request.messages)
        else:
            tokens = await asyncio.to_thread(self.prompt.conversation_tokens, request.messages)
        return Tokenized(tokens=tokens, max_model_len=self.max_context_tokens)

    async def detokenize(self, tokens: list[int]) -> str:
        """`/detokenize`: the text of `tokens` (special tokens written out, as vLLM's); an id past the vocabulary
        is a 400 naming `tokens`."""
        vocabulary = len(self.prompt.tokenizer)
        if any(t >= vocabulary for t in tokens):
            raise InvalidMessageError(f"tokens: every id must be below the vocabulary's size, {vocabulary}", "tokens")
        return await asyncio.to_thread(self.prompt.tokenizer.decode, tokens)

    def reload(self) -> bool:
        """Switch to the store's current generation now, if it is newer (the watcher also does it on its own)."""
        return self.watcher.check()

    def close(self) -> None:
        self.framer.close()
        self.watcher.close()
        self.keeper.close()
        self.embeds.close()

    def __del__(self) -> None:  # Serve calls it on graceful shutdown: drop this replica's lease
        if hasattr(self, "watcher"):
            self.close()


class BatchingRouter(Router):
    """The deployed router: queries arriving together are embedded in one call (`@serve.batch` needs a
    Serve replica, so the plain `Router` embeds one at a time)."""

    def __init__(self, config: RouterConfig):
        super().__init__(config)
        if config.framing.processes:
            self.framer.start()  # the first large conversation should not wait for the processes to load

    # No waiting for company: a lone query pays nothing; queries arriving while one embeds form the next batch.
    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.0)
    async def embed_query(self, queries: list[str]) -> list[np.ndarray]:
        return list(await self.embeds.embed_texts(queries, Priority.QUERY))  # [n, dim] -> n x [dim]
