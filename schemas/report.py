"""Wire contracts of what the native API answers: `/v1/answer`'s report (each chunk's tier and why, where its KV came
from, token usage, timings, caches), `/v1/estimate`'s and the stream's events. The requests: schemas/api.py."""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import Field

from schemas.api import FinishReason
from schemas.decoding import ChoiceLogprobs
from schemas.modes import Mode, Variant
from schemas.wire import Strict


class TierReason(str, Enum):
    """Why a chunk got its tier (serve/routing/placement.py decides it; the inspector shows it)."""

    PROMOTED = "promoted"  # within τ's share of the relevance, B and the token budget
    LOW_BY_TAU = "low_by_tau"  # the chunks ranked above it already hold τ of the relevance (or it has no share)
    LOW_BY_B = "low_by_b"  # B chunks were already promoted
    LOW_BY_BUDGET = "low_by_budget"  # its promotion would not fit the token budget
    NO_HIGH_ENTRY = "no_high_entry"  # within τ, but no high-tier entry is compiled: served low, took no B slot
    HYBRID_TEXT = "hybrid_text"  # the hybrid rule serves it as text
    MODE = "mode"  # the mode serves every chunk at one tier (or as text): nothing was routed


class KVOrigin(str, Enum):
    """Where a linked chunk's KV came from, fastest first."""

    DEVICE = "device"  # the generator's device hot tier
    HOST = "host"  # the loader's host-memory LRU
    STORE = "store"  # read from the store's shards
    COMPILED = "compiled"  # compiled by the generator: a lazily compiled tier, or an unreadable entry rebuilt


class ChunkReport(Strict):
    chunk_id: str
    doc_id: str
    relevance: float  # cosine(query, chunk text) in [-1, 1]
    tier: str | None  # tier of the pages in context; null for text
    variant: Variant | None  # stored KV variant linked; null for the online (full_*) modes
    num_tokens: int
    vision_tokens: int
    position_span: int
    tier_reason: TierReason
    kv_source: KVOrigin | None = None  # where its KV came from; null: the online (full_*) modes prefill the chunk
    kv_nbytes: int | None = None  # its KV on the generator's device ([layers, 2, kv_heads, tokens, head_dim])
    group: int = 0  # which user message it was placed before (a conversation: 0 = the first; else always 0)


class FallbackReport(Strict):
    chunk_id: str
    requested_tier: str
    served_tier: str
    reason: str


class TokenUsage(Strict):
    context_tokens: int  # template prefix + every chunk
    context_vision_tokens: int
    context_text_tokens: int  # prefix, image markup and text chunks
    cached_tokens: int  # prompt tokens whose KV was not computed: linked chunks' (the store) and prefix-cache hits
    prefix_cached_tokens: int = 0  # of those, from the prefix KV cache (earlier requests' prompts and answers)
    query_tokens: int  # the query turn, prefilled online
    completion_tokens: int


class Timings(Strict):
    """Where a request's time went. The model phases are null when no model work ran: a response-cache hit
    (`cache_hit: true`), whose own latency is `total_ms` (and the lookup's `response_cache.lookup_ms`)."""

    route_ms: float
    load_ms: float | None
    render_ms: float | None  # full_image only: rendering pages online
    queue_ms: float | None = 0.0  # waiting for a row in the generator's batch
    reanchor_ms: float | None  # assembling and re-rotating cached KV
    prefill_ms: float | None  # the generator's time to first token: query prefill (or full prefill)
    decode_ms: float | None
    total_ms: float  # wall time seen by the ingress


class CacheReport(Strict):
    """Where each linked KV entry came from, fastest tier first."""

    device_hits: int = 0  # resident on the generator's device (its hot tier): no transfer at all
    hits: int  # the loader's host-memory LRU
    misses: int  # read from the store
    nbytes_from_store: int


class ResponseCacheLevel(str, Enum):
    L1 = "l1"  # exact: normalised query, ordered chunks and tiers, mode, sampling
    L2 = "l2"  # semantic: a query embedding close enough, with the identical chunks, tiers and mode
    L3 = "l3"  # task: a declared query-independent task type over the identical chunks, tiers, mode, any wording


class ResponseCacheReport(Strict):
    level: ResponseCacheLevel | None = None  # the level that answered; null: the model did
    similarity: float | None = None  # l2: cosine of this query's embedding to the cached one's
    lookup_ms: float | None = None  # time spent looking the request up; null: not looked up (see `Cache-Control`)


class AnswerReport(Strict):
    mode: Mode
    finish_reason: FinishReason
    chunks: list[ChunkReport]
    usage: TokenUsage
    timings: Timings
    cache: CacheReport  # the KV cache of the loader
    fallbacks: list[FallbackReport]
    cache_hit: bool = False  # answered by the response cache: no model work, no model timings
    response_cache: ResponseCacheReport = Field(default_factory=ResponseCacheReport)
    generation: int = 0  # the store's serving generation the answer's entries all come from

    def with_total_ms(self, total_ms: float) -> AnswerReport:
        return self.model_copy(update={"timings": self.timings.model_copy(update={"total_ms": total_ms})})


class AnswerResponse(AnswerReport):
    id: str
    answer: str
    logprobs: ChoiceLogprobs | None = None  # with `logprobs: true`: each answer token's (OpenAI's shape)


class TokenEstimate(Strict):
    context_tokens: int  # template prefix + every chunk at its planned tier
    context_vision_tokens: int
    context_text_tokens: int
    query_tokens: int
    max_new_tokens: int  # the most completion tokens the request may produce


class EstimateResponse(Strict):
    """`POST /v1/estimate`: what an `/v1/answer` request would put in context, priced from the index alone."""

    mode: Mode
    chunks: list[ChunkReport]
    usage: TokenEstimate
    high_res_chunks: int  # chunks planned at the highest tier
    budget_tokens: int | None  # the context-token budget that applies (header or tenant default)
    within_budget: bool


class StreamEventType(str, Enum):
    DELTA = "delta"
    DONE = "done"
    ERROR = "error"


class StreamDelta(Strict):
    """One SSE `data:` event of a streamed `/v1/answer`: new answer text."""

    type: Literal[StreamEventType.DELTA] = StreamEventType.DELTA
    text: str


class StreamDone(Strict):
    type: Literal[StreamEventType.DONE] = StreamEventType.DONE
    response: AnswerResponse


class StreamError(Strict):
    type: Literal[StreamEventType.ERROR] = StreamEventType.ERROR
    status_code: int
    detail: str
