"""Placement policy: which tier and variant each selected chunk is served at — pure functions over the
rows retrieval selected and their stored entries; nothing here reads a store.

`allocate` decides promotions from relevance alone (plus the budgets); `place` turns the decision
into planned chunks, falling back to the low tier where a high-tier entry was never compiled and
refusing (503) a mode whose entries are missing. `place` reads what retrieval selected (`Retrieved`)
under one request's policy (`PlacementSpec`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from schemas.config import RouterSpec, ScoreNormalisation
from schemas.errors import UnknownTierError, UnservableError
from schemas.modes import ChunkKind, Mode, TierDefault, Variant
from schemas.render import TierSpec
from schemas.report import FallbackReport, TierReason
from serve.kv import PendingPlanner
from serve.plan import Entry, PlannedChunk, entry_of
from serve.routing.hybrid import TEXT_VARIANT, apply_rule, cheaper_as_text
from serve.routing.hybrid import as_text as hybrid_text

EntrySlots = dict[tuple[str | None, Variant], dict[str, Any]]  # one chunk's index rows by (tier, variant)


@dataclass(frozen=True)
class Retrieved:
    """What retrieval selected, aligned by position: catalog rows (CATALOG_COLUMNS), each one's entries (its
    entry rows, kept made by the router per snapshot: serve/routing/retrieval.py `EntryCache`) and its relevance.
    `texts()` reads their text and image path; only the online modes call it."""

    chunks: list[dict[str, Any]]
    entries: list[ChunkEntries]
    relevance: list[float]
    texts: Callable[[], list[dict[str, Any]]]


@dataclass(frozen=True)
class PlacementSpec:
    """The policy one request is placed under."""

    policy: RouterSpec  # τ, B, score normalisation, hybrid rule: the router's, with the request's τ and B
    low: TierSpec  # the generation's lowest tier, which routed modes promote from
    tier: str | None  # `mode_tier`'s: the tier a uniform mode serves, the one a routed mode promotes to
    pending: PendingPlanner | None = None  # stands in for a lazily compiled tier's entries (serve/kv/pending.py)


def servable_modes(variants: Sequence[Variant]) -> list[Mode]:
    """Modes a store compiled with `variants` can serve (full_text needs none: its text is the catalog's)."""
    return [m for m in Mode if m.variant is None or m.variant in variants]


def mode_tier(mode: Mode, tier: str | None, tiers: Sequence[TierSpec]) -> str | None:
    """The tier a request's mode serves (uniform modes) or promotes to (routed modes); None for text.

    Raises `UnknownTierError` (404) for a tier the store does not have; a tier given to a mode without
    tiers never gets here (the request model refuses it, 422).
    """
    if tier is not None and not mode.takes_tier:
        raise ValueError(f"mode {mode.value!r} takes no tier")
    if tier is not None and tier not in {t.name for t in tiers}:
        raise UnknownTierError(f"unknown tier {tier!r}; the store has {[t.name for t in tiers]}")
    if mode.kind is ChunkKind.TEXT:
        return None
    if tier is not None:
        return tier
    lowest, highest = min(tiers, key=lambda t: t.dpi), max(tiers, key=lambda t: t.dpi)
    return lowest.name if mode.shape.tier is TierDefault.LOWEST else highest.name


def relevance_shares(relevance: Sequence[float], normalisation: ScoreNormalisation = ScoreNormalisation.LINEAR,
                     temperature: float = 0.05) -> np.ndarray:
    """Each chunk's share of the request's relevance: `[n]` float64 summing to 1 or all 0 (nothing relevant);
    RAW: the clipped cosines themselves.

    LINEAR clips negative cosines to 0 (an irrelevant chunk has no share, so it is never promoted) and
    divides by the sum; RAW clips them alike but does not divide (then neither the shares nor τ are bounded
    by 1: τ is a cumulative cosine, as tuned on raw sums); SOFTMAX takes softmax(cosine / temperature), so
    every chunk has a share and a low temperature concentrates the mass on the best chunks.
    """
    scores = np.asarray(relevance, dtype=np.float64)
    if normalisation is ScoreNormalisation.SOFTMAX:
        if scores.size == 0:
            return scores
        weights = np.exp((scores - scores.max()) / temperature)  # shifted: no overflow at small temperatures
    else:
        weights = np.clip(scores, 0.0, None)
        if normalisation is ScoreNormalisation.RAW:
            return weights
    total = float(weights.sum())
    return weights / total if total > 0.0 else weights


def allocate(relevance: Sequence[float], tau: float, max_high_res: int,
             promotion_costs: Sequence[int | None], budget_tokens: int | None,
             normalisation: ScoreNormalisation = ScoreNormalisation.LINEAR, temperature: float = 0.05) -> list[bool]:
    """Which chunks to promote to the high tier; aligned with the input order, which never changes
    (`tier_reasons`, reduced to promoted or not)."""
    return [r is TierReason.PROMOTED for r in tier_reasons(relevance, tau, max_high_res, promotion_costs,
                                                           budget_tokens, normalisation, temperature)]


def tier_reasons(relevance: Sequence[float], tau: float, max_high_res: int,
                 promotion_costs: Sequence[int | None], budget_tokens: int | None,
                 normalisation: ScoreNormalisation = ScoreNormalisation.LINEAR,
                 temperature: float = 0.05) -> list[TierReason]:
    """Whether each chunk is promoted and, if not, which limit kept it low; aligned with the input order.

    Chunks are ranked by relevance (ties: earlier chunk first) and given shares by `relevance_shares`.
    A chunk is a candidate while the share of the chunks ranked above it is below `tau` and its own
    share is positive. Candidates are promoted in rank order while fewer than `max_high_res` are.

    Skipped chunks: a candidate that cannot be promoted (its cost is None: no high-tier entry, or the
    hybrid rule serves it as text) or whose extra tokens exceed what is left of `budget_tokens` stays
    low, is not counted toward `max_high_res`, and the walk goes on to the next candidates, which may be
    smaller. Its share still counts toward the share above them: τ bounds how much of the relevance
    mass is considered for promotion, so a tight budget cannot push promotion into the irrelevant tail.
    """
    if len(relevance) != len(promotion_costs):
        raise ValueError(f"{len(relevance)} relevances but {len(promotion_costs)} promotion costs")
    shares = relevance_shares(relevance, normalisation, temperature)
    scores = np.asarray(relevance, dtype=np.float64)
    reasons = [TierReason.LOW_BY_TAU] * len(shares)
    remaining = budget_tokens
    share_above, num_promoted = 0.0, 0
    for i in sorted(range(len(shares)), key=lambda i: (-scores[i], i)):
        if shares[i] <= 0.0 or share_above >= tau:
            break  # every chunk ranked below is kept low by τ too: the share above only grows
        share_above += shares[i]  # counted past B too, so the reasons show where τ would have cut
        if promotion_costs[i] is None:  # no high entry to promote to (or served as text): takes no B slot
            reasons[i] = TierReason.NO_HIGH_ENTRY
            continue
        if num_promoted >= max_high_res:
            reasons[i] = TierReason.LOW_BY_B
            continue
        if remaining is not None and promotion_costs[i] > remaining:
            reasons[i] = TierReason.LOW_BY_BUDGET
            continue
        reasons[i] = TierReason.PROMOTED
        num_promoted += 1
        if remaining is not None:
            remaining -= promotion_costs[i]
    return reasons


def _pending(pending: PendingPlanner | None, low: Entry | None, tier: str | None) -> Entry | None:
    return None if pending is None or tier == (low.tier if low else None) else pending(low, tier)


class ChunkEntries:
    """One chunk's entries, each made from its index row once: placement looks a chunk's low-tier entry up
    to four times, and `entry_of` is most of what placement costs. Shared between requests and threads by the
    router's `EntryCache`: `rows` are never changed, and `made` only gains what `entry_of` makes of them."""

    __slots__ = ("rows", "made")

    def __init__(self, rows: EntrySlots):
        self.rows, self.made = rows, {}

    def find(self, tier: str | None, variant: Variant) -> Entry | None:
        key = (tier, variant)
        if key not in self.made:
            row = self.rows.get(key)
            self.made[key] = None if row is None else entry_of(row)
        return self.made[key]


def require(chunks: list[dict], slots: list[ChunkEntries], tier: str | None, variant: Variant,
            mode: Mode) -> list[Entry]:
    found = [s.find(tier, variant) for s in slots]
    missing = [c["chunk_id"] for c, e in zip(chunks, found) if e is None]
    if missing:
        raise UnservableError(f"mode {mode.value!r} needs {variant.value} entries of tier {tier!r}, not compiled "
                              f"for chunks {missing[:10]}; run `qvpic recompile` on the store")
    return found


def place(mode: Mode, rows: Retrieved, spec: PlacementSpec, room_tokens: int,
          group: int = 0) -> tuple[list[PlannedChunk], list[FallbackReport]]:
    """Planned chunks (request order) for the selected `rows` under `spec`, in prompt group `group`.
    `room_tokens` is what the context holds for chunks: promotions that would not fit stay low. The hybrid
    rule (when enabled) serves qvpic chunks as text (serve/routing/hybrid.py)."""
    chunks, slots, relevance = rows.chunks, rows.entries, rows.relevance
    low, tier, pending, hybrid = spec.low, spec.tier, spec.pending, spec.policy.hybrid
    if mode.variant is None:  # full_text: each chunk's source text, counted from its text entry or the catalog
        planned = []
        for chunk, entries, rel, source in zip(chunks, slots, relevance, rows.texts()):
            text_entry = entries.find(None, Variant.TEXT)
            num_tokens = text_entry.num_tokens if text_entry else chunk["num_text_tokens"]
            planned.append(PlannedChunk(chunk_id=chunk["chunk_id"], doc_id=chunk["doc_id"], relevance=rel, tier=None,
                                        num_tokens=num_tokens, vision_tokens=0, position_span=num_tokens, entry=None,
                                        text=source["text"], group=group))
        return planned, []
    variant = mode.variant
    hybrid_on = hybrid.enabled and mode is Mode.QVPIC
    if mode.routed:  # price every promotion from the index, then allocate
        lows = require(chunks, slots, low.name, variant, mode)
        highs = [s.find(tier, variant) or _pending(pending, lo, tier) for s, lo in zip(slots, lows)]
        text_entries = [s.find(None, TEXT_VARIANT) for s in slots] if hybrid_on else [None] * len(chunks)
        text_first = cheaper_as_text(hybrid, text_entries, lows) if hybrid_on else [False] * len(chunks)
        budget = room_tokens - sum(t.num_tokens if first else lo.num_tokens
                                   for t, lo, first in zip(text_entries, lows, text_first))
        # no promotion candidate (None): a chunk served as text, or one with no entry at the tier promoted to
        costs = [None if first or h is None else h.num_tokens - lo.num_tokens
                 for lo, h, first in zip(lows, highs, text_first)]
        policy = spec.policy
        reasons = tier_reasons(relevance, policy.tau, policy.max_high_res, costs, max(budget, 0),
                               policy.normalisation, policy.temperature)
        wanted = [tier if r is TierReason.PROMOTED else low.name for r in reasons]
    else:
        wanted, reasons = [tier] * len(chunks), [TierReason.MODE] * len(chunks)
        text_entries, text_first = [None] * len(chunks), [False] * len(chunks)
    online = mode.online  # full_image: priced from the stored entry, pages rendered and encoded online
    sources = rows.texts() if online else [None] * len(chunks)
    planned, fallbacks = [], []
    for chunk, entries, rel, wanted_tier, source, reason in zip(chunks, slots, relevance, wanted, sources, reasons):
        entry = entries.find(wanted_tier, variant) or _pending(pending, entries.find(low.name, variant), wanted_tier)
        # The lowest tier backs a templated entry up (not compiled yet, or unreadable); a baseline asked
        # for at a tier fails loudly instead, so a sweep never measures a silently swapped tier.
        backup = entries.find(low.name, variant) \
            if wanted_tier != low.name and variant is Variant.TEMPLATE else None
        if entry is None and backup is not None:
            fallbacks.append(FallbackReport(chunk_id=chunk["chunk_id"], requested_tier=wanted_tier,
                                            served_tier=backup.tier,
                                            reason=f"{variant.value} entry of tier {wanted_tier!r} is not compiled"))
            entry, backup = backup, None
            reason = TierReason.NO_HIGH_ENTRY if reason is TierReason.PROMOTED else reason
        if entry is None:
            require([chunk], [entries], wanted_tier, variant, mode)
        planned.append(PlannedChunk(chunk_id=chunk["chunk_id"], doc_id=chunk["doc_id"], relevance=rel, tier=entry.tier,
                                    num_tokens=entry.num_tokens, vision_tokens=entry.vision_tokens,
                                    position_span=entry.position_span, entry=None if online else entry,
                                    fallback=None if online else backup, text=source["text"] if online else None,
                                    image_path=(source["image_path"] or None) if online else None, tier_reason=reason,
                                    group=group))
    if hybrid_on:
        planned = [hybrid_text(c, t) if first else c for c, t, first in zip(planned, text_entries, text_first)]
        planned = apply_rule(hybrid, planned, text_entries, room_tokens)
    return planned, fallbacks
