"""Relevance router: which chunks, in which order, at which tier and variant — decided before any KV moves.

`allocate` is the pure policy. `Router` resolves a request's chunk selection against a snapshot of the
store's chunk table and index (taken at start-up: a recompiled store is served after a redeploy),
embeds the query (the deployed `BatchingRouter` batches concurrent queries with `@serve.batch`),
scores chunks by cosine and prices every choice from index columns in O(1) per chunk. Top-k
retrieval is one numpy mat-vec over the `[chunks, dim]` embedding matrix plus a partial sort: exact,
and ~3 ms for 10^5 chunks (384-d float32, 150 MB); an approximate vector index pays off far beyond.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from ray import serve
from transformers import AutoConfig, AutoTokenizer

from pipeline.embed import Embedder
from pipeline.runtime.adapters import ChatTemplate
from pipeline.runtime.model import model_identity, resolve_path
from pipeline.store import Store
from schemas.api import (
    AnswerRequest,
    FallbackReport,
    UnknownTierError,
    TooLargeError,
    UnknownIdsError,
    UnservableError,
)
from schemas.config import ChunkKind, Mode, ModelSpec, RouterSpec, ScoreNormalisation, TierSpec, Variant
from schemas.store import CacheKey, Manifest, ManifestError, StoreSpec
from serve.plan import Entry, Plan, PlannedChunk

# Each mode is a choice of stored variant and of tiers. Routed modes promote chunks from the lowest tier
# to the request's `tier` (default: the highest); uniform modes serve every chunk at one tier.
LINKED_VARIANT = {Mode.QVPIC: Variant.TEMPLATE, Mode.UNIFORM: Variant.TEMPLATE, Mode.UNIFORM_HIGH: Variant.TEMPLATE,
                  Mode.IMAGE_PIC: Variant.PLAIN, Mode.IMAGE_PIC_DUMMY: Variant.DUMMY, Mode.TEXT_PIC: Variant.TEXT,
                  Mode.TEXT_PIC_PLAIN: Variant.TEXT_PLAIN}
PRICED_VARIANT = {**LINKED_VARIANT, Mode.FULL_IMAGE: Variant.TEMPLATE}  # full_image prices pages from TEMPLATE entries
ROUTED_MODES = (Mode.QVPIC, Mode.FULL_IMAGE)
UNIFORM_LOWEST = (Mode.IMAGE_PIC, Mode.IMAGE_PIC_DUMMY)  # baselines: the lowest tier unless the request names one


def servable_modes(variants: Sequence[Variant]) -> list[Mode]:
    """Modes a store compiled with `variants` can serve."""
    return [m for m in Mode if m not in PRICED_VARIANT or PRICED_VARIANT[m] in variants]


def mode_tier(mode: Mode, tier: str | None, tiers: Sequence[TierSpec]) -> str | None:
    """The tier a request's mode serves (uniform modes) or promotes to (routed modes); None for text.

    Raises `UnknownTierError` (404) for a tier the store does not have; a tier given to a mode without
    tiers never gets here (the request model refuses it, 422).
    """
    if tier is not None and not mode.takes_tier:
        raise ValueError(f"mode {mode.value!r} takes no tier")
    if tier is not None and tier not in {t.name for t in tiers}:
        raise UnknownTierError(f"unknown tier {tier!r}; the store has {[t.name for t in tiers]}")
    if PRICED_VARIANT.get(mode, Variant.TEXT).kind is ChunkKind.TEXT:
        return None
    if tier is not None:
        return tier
    lowest, highest = min(tiers, key=lambda t: t.dpi), max(tiers, key=lambda t: t.dpi)
    return lowest.name if mode in UNIFORM_LOWEST else highest.name


def relevance_shares(relevance: Sequence[float], normalisation: ScoreNormalisation = ScoreNormalisation.LINEAR,
                     temperature: float = 0.05) -> np.ndarray:
    """Each chunk's share of the request's relevance: `[n]` float64 summing to 1, or all 0 (nothing relevant).

    LINEAR clips negative cosines to 0 (an irrelevant chunk has no share, so it is never promoted) and
    divides by the sum; SOFTMAX takes softmax(cosine / temperature), so every chunk has a share and a low
    temperature concentrates the mass on the best chunks.
    """
    scores = np.asarray(relevance, dtype=np.float64)
    if normalisation is ScoreNormalisation.SOFTMAX:
        if scores.size == 0:
            return scores
        weights = np.exp((scores - scores.max()) / temperature)  # shifted: no overflow at small temperatures
    else:
        weights = np.clip(scores, 0.0, None)
    total = float(weights.sum())
    return weights / total if total > 0.0 else weights


def allocate(relevance: Sequence[float], tau: float, max_high_res: int,
             promotion_costs: Sequence[int], budget_tokens: int | None,
             normalisation: ScoreNormalisation = ScoreNormalisation.LINEAR, temperature: float = 0.05) -> list[bool]:
    """Which chunks to promote to the high tier; aligned with the input order, which never changes.

    Chunks are ranked by relevance (ties: earlier chunk first) and given shares by `relevance_shares`.
    A chunk is a candidate while the share of the chunks ranked above it is below `tau` and its own
    share is positive. Candidates are promoted in rank order while fewer than `max_high_res` are.

    Budget-skipped chunks: a candidate whose extra tokens exceed what is left of `budget_tokens` stays
    low, is not counted toward `max_high_res`, and the walk goes on to the next candidates, which may be
    smaller. Its share still counts toward the share above them: τ bounds how much of the relevance
    mass is considered for promotion, so a tight budget cannot push promotion into the irrelevant tail.
    """
    if len(relevance) != len(promotion_costs):
        raise ValueError(f"{len(relevance)} relevances but {len(promotion_costs)} promotion costs")
    shares = relevance_shares(relevance, normalisation, temperature)
    scores = np.asarray(relevance, dtype=np.float64)
    promoted = [False] * len(shares)
    remaining = budget_tokens
    share_above, num_promoted = 0.0, 0
    for i in sorted(range(len(shares)), key=lambda i: (-scores[i], i)):
        if shares[i] <= 0.0 or share_above >= tau or num_promoted >= max_high_res:
            break
        share_above += shares[i]
        if remaining is not None and promotion_costs[i] > remaining:
            continue
        promoted[i] = True
        num_promoted += 1
        if remaining is not None:
            remaining -= promotion_costs[i]
    return promoted


@dataclass(frozen=True)
class PromptTemplate:
    """What the router needs of the model without loading its weights: token counts and limits."""

    tokenizer: object
    template: ChatTemplate
    max_positions: int

    @classmethod
    def load(cls, spec: ModelSpec) -> PromptTemplate:
        path = resolve_path(spec)
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=spec.trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=spec.trust_remote_code)
        template = ChatTemplate.from_tokenizer(tokenizer, tokenizer.convert_ids_to_tokens(config.image_token_id))
        text_config = getattr(config, "text_config", config)
        return cls(tokenizer, template, int(text_config.max_position_embeddings))

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)


def check_store(manifest: Manifest, spec: ModelSpec) -> None:
    """Raise `ManifestError` unless the store was compiled for this model, dtype and template (the
    identity ingest fingerprints with), read from the checkpoint without loading its weights."""
    model_id, revision, _, template_prefix = model_identity(spec)
    manifest.check_model(model_id, revision, spec.dtype, template_prefix)


def require_known(field: str, ids: Sequence[str], known: dict) -> None:
    missing = [i for i in ids if i not in known]
    if missing:
        more = f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""
        raise UnknownIdsError(f"unknown {field}: {missing[:10]}{more}")


class Router:
    def __init__(self, store: StoreSpec | str, model: ModelSpec, defaults: RouterSpec, max_chunks: int,
                 max_context_tokens: int | None = None, embedder_dir: str | None = None):
        self.store = Store.open(store)
        self.manifest = self.store.load_manifest_or_raise()
        check_store(self.manifest, model)
        self.prompt = PromptTemplate.load(model)
        self.embedder = Embedder(embedder_dir)
        if self.embedder.model_name != self.manifest.embedder:
            raise ManifestError(f"store was embedded with {self.manifest.embedder!r}, "
                                f"the router loaded {self.embedder.model_name!r}")
        self.defaults, self.max_chunks = defaults, max_chunks
        self.max_context_tokens = min(max_context_tokens or self.prompt.max_positions, self.prompt.max_positions)
        self.prefix_tokens = self.prompt.count(self.manifest.template_prefix)
        self.low: TierSpec = self.manifest.render.lowest_tier
        self.high: TierSpec = self.manifest.render.highest_tier

        chunks = self.store.chunks()
        columns = ["chunk_id", "doc_id", "order", "chunk_key", "text", "num_text_tokens", "image_path"]
        self.chunk_rows = chunks.select(columns).to_pylist()
        self.row_of_chunk = {r["chunk_id"]: i for i, r in enumerate(self.chunk_rows)}
        self.rows_of_doc: dict[str, list[int]] = {}
        for i in sorted(range(len(self.chunk_rows)), key=lambda i: self.chunk_rows[i]["order"]):
            self.rows_of_doc.setdefault(self.chunk_rows[i]["doc_id"], []).append(i)
        # [chunks, dim] float32, rows L2-normalised at ingest: cosine = dot product
        embeddings = chunks["embedding"].to_pylist()
        self.embeddings = np.asarray(embeddings, dtype=np.float32).reshape(len(self.chunk_rows), -1)
        self.entries = self._current_entries()

    def _current_entries(self) -> dict[tuple[str, str | None, Variant], Entry]:
        """Index rows compiled under the current fingerprints, keyed by (chunk_key, tier, variant)."""
        current = {(t.name, v): self.manifest.entry_fingerprint(v, t.name) for t in self.manifest.tiers for v in Variant
                   if v.kind is ChunkKind.IMAGE}
        current.update({(None, v): self.manifest.entry_fingerprint(v, None) for v in Variant if v.kind is ChunkKind.TEXT})
        entries = {}
        for row in self.store.index().to_pylist():
            tier, variant = row["tier"], Variant(row["variant"])
            if current.get((tier, variant)) != row["fingerprint"]:
                continue  # stale (another model, template or renderer) or a tier no longer configured
            key = CacheKey(row["chunk_key"], tier, variant, row["fingerprint"]).to_str()
            entries[(row["chunk_key"], tier, variant)] = Entry(
                key, tier, variant, row["num_tokens"], row["vision_tokens"], row["position_span"], row)
        return entries

    async def embed_query(self, query: str) -> np.ndarray:
        return (await asyncio.to_thread(self.embedder.embed, [query]))[0]  # [dim], off the event loop

    async def plan(self, request: AnswerRequest, budget_tokens: int | None = None) -> Plan:
        """`budget_tokens` caps the context (prefix + chunks): only promotions that fit it are made."""
        started = time.perf_counter()
        query_vector = await self.embed_query(request.query)
        rows = self._select(request, query_vector)
        if len(rows) > self.max_chunks:
            raise TooLargeError(f"{len(rows)} chunks selected; this server takes at most {self.max_chunks} per request")
        relevance = [float(v) for v in self.embeddings[rows] @ query_vector] if rows else []
        query_tokens = self.prompt.count(request.text_after_chunks) + self.prompt.count(self.prompt.template.turn_suffix)
        prefix_tokens = self.prefix_tokens + (self.prompt.count(request.instruction) if request.instruction else 0)
        fixed_tokens = prefix_tokens + query_tokens + request.max_new_tokens
        room_tokens = self.max_context_tokens - fixed_tokens
        if budget_tokens is not None:
            room_tokens = min(room_tokens, budget_tokens - prefix_tokens)
        chunks, fallbacks = self._place(request, rows, relevance, room_tokens)
        needed = fixed_tokens + sum(c.num_tokens for c in chunks)
        if needed > self.max_context_tokens:
            raise TooLargeError(
                f"request needs {needed} tokens (prefix {prefix_tokens} + chunks {needed - fixed_tokens} + "
                f"query {query_tokens} + max_new_tokens {request.max_new_tokens}); "
                f"the context holds {self.max_context_tokens}")
        route_ms = (time.perf_counter() - started) * 1e3
        return Plan(request.mode, request.query, tuple(chunks), prefix_tokens, query_tokens, tuple(fallbacks),
                    route_ms, query_vector, request.instruction, request.query_prompt)

    def _select(self, request: AnswerRequest, query_vector: np.ndarray) -> list[int]:
        if request.chunk_ids is not None:
            require_known("chunk_ids", request.chunk_ids, self.row_of_chunk)
            return [self.row_of_chunk[c] for c in request.chunk_ids]
        if request.doc_ids is not None:
            require_known("doc_ids", request.doc_ids, self.rows_of_doc)
            return [i for d in request.doc_ids for i in self.rows_of_doc[d]]
        scores = self.embeddings @ query_vector  # [chunks]
        k = min(request.top_k, len(scores))
        if k == 0:
            return []
        kth_best = np.partition(scores, len(scores) - k)[len(scores) - k]
        candidates = np.flatnonzero(scores >= kth_best)  # O(chunks); ascending store order
        ranked = candidates[np.argsort(-scores[candidates], kind="stable")]  # best first, ties by store order
        return [int(i) for i in ranked[:k]]

    def _place(self, request: AnswerRequest, rows: list[int], relevance: list[float],
               budget_tokens: int) -> tuple[list[PlannedChunk], list[FallbackReport]]:
        mode = request.mode
        tier = mode_tier(mode, request.tier, self.manifest.tiers)
        chunk_rows = [self.chunk_rows[i] for i in rows]
        if mode is Mode.FULL_TEXT:
            planned = []
            for row, rel in zip(chunk_rows, relevance):
                text_entry = self.entries.get((row["chunk_key"], None, Variant.TEXT))
                num_tokens = text_entry.num_tokens if text_entry else row["num_text_tokens"]
                planned.append(PlannedChunk(row["chunk_id"], row["doc_id"], rel, None, num_tokens, 0, num_tokens,
                                            None, text=row["text"]))
            return planned, []
        variant = PRICED_VARIANT[mode]
        if mode in ROUTED_MODES:  # price every promotion from the index, then allocate
            lows = self._require(chunk_rows, self.low.name, variant, mode)
            highs = [self.entries.get((r["chunk_key"], tier, variant)) for r in chunk_rows]
            costs = [h.num_tokens - lo.num_tokens if h else 0 for lo, h in zip(lows, highs)]
            budget = budget_tokens - sum(lo.num_tokens for lo in lows)
            tau = self.defaults.tau if request.tau is None else request.tau
            max_high_res = self.defaults.max_high_res if request.max_high_res is None else request.max_high_res
            promoted = allocate(relevance, tau, max_high_res, costs, max(budget, 0),
                                self.defaults.normalisation, self.defaults.temperature)
            wanted = [tier if p else self.low.name for p in promoted]
        else:
            wanted = [tier] * len(rows)
        planned, fallbacks = [], []
        for row, rel, tier in zip(chunk_rows, relevance, wanted):
            entry = self.entries.get((row["chunk_key"], tier, variant))
            # The lowest tier backs a templated entry up (not compiled yet, or unreadable); a baseline asked
            # for at a tier fails loudly instead, so a sweep never measures a silently swapped tier.
            low = self.entries.get((row["chunk_key"], self.low.name, variant)) \
                if tier != self.low.name and variant is Variant.TEMPLATE else None
            if entry is None and low is not None:
                fallbacks.append(FallbackReport(chunk_id=row["chunk_id"], requested_tier=tier, served_tier=low.tier,
                                                reason=f"{variant.value} entry of tier {tier!r} is not compiled"))
                entry, low = low, None
            if entry is None:
                self._require([row], tier, variant, mode)
            online = mode is Mode.FULL_IMAGE  # prices from the stored entry, pages rendered and encoded online
            planned.append(PlannedChunk(row["chunk_id"], row["doc_id"], rel, entry.tier, entry.num_tokens,
                                        entry.vision_tokens, entry.position_span, None if online else entry,
                                        None if online else low, row["text"] if online else None,
                                        (row["image_path"] or None) if online else None))
        return planned, fallbacks

    def _require(self, chunk_rows: list[dict], tier: str | None, variant: Variant, mode: Mode) -> list[Entry]:
        found = [self.entries.get((r["chunk_key"], tier, variant)) for r in chunk_rows]
        missing = [r["chunk_id"] for r, e in zip(chunk_rows, found) if e is None]
        if missing:
            raise UnservableError(f"mode {mode.value!r} needs {variant.value} entries of tier {tier!r}, not compiled "
                                  f"for chunks {missing[:10]}; run `qvpic recompile` on the store")
        return found


class BatchingRouter(Router):
    """The deployed router: queries arriving together are embedded in one call (`@serve.batch` needs a
    Serve replica, so the plain `Router` embeds one at a time)."""

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005)
    async def embed_query(self, queries: list[str]) -> list[np.ndarray]:
        return list(await asyncio.to_thread(self.embedder.embed, queries))  # [n, dim] -> n x [dim]
