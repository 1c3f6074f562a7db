"""Placement policy: which tier and variant each selected chunk is served at — pure functions over the
rows retrieval selected and their stored entries; nothing here reads a store.

`allocate` decides promotions from relevance alone (plus the budgets); `place` turns the decision
into planned chunks, falling back to the low tier where a high-tier entry was never compiled and
refusing (503) a mode whose entries are missing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from schemas.api import FallbackReport, UnservableError
from schemas.config import Mode, TierSpec, Variant
from schemas.store import CacheKey
from serve.plan import Entry, PlannedChunk

LINKED_VARIANT = {Mode.QVPIC: Variant.TEMPLATE, Mode.UNIFORM_HIGH: Variant.TEMPLATE,
                  Mode.IMAGE_PIC: Variant.PLAIN, Mode.TEXT_PIC: Variant.TEXT}
EntrySlots = dict[tuple[str | None, Variant], dict[str, Any]]  # one chunk's index rows by (tier, variant)


def servable_modes(variants: Sequence[Variant]) -> list[Mode]:
    """Modes a store compiled with `variants` can serve (full_image prices pages from TEMPLATE entries)."""
    needs = {**LINKED_VARIANT, Mode.FULL_IMAGE: Variant.TEMPLATE}
    return [m for m in Mode if m not in needs or needs[m] in variants]


def allocate(relevance: Sequence[float], tau: float, max_high_res: int,
             promotion_costs: Sequence[int], budget_tokens: int | None) -> list[bool]:
    """Which chunks to promote to the high tier; aligned with the input order, which never changes.

    Chunks are ranked by relevance (ties: earlier chunk first). A chunk is a candidate while the
    relevance share of the chunks ranked above it is below `tau` (negative cosines count as 0, so
    irrelevant chunks are never candidates). Candidates are promoted in rank order while fewer than
    `max_high_res` are promoted; one whose extra tokens exceed the remaining budget stays low and the
    walk goes on to smaller ones.
    """
    if len(relevance) != len(promotion_costs):
        raise ValueError(f"{len(relevance)} relevances but {len(promotion_costs)} promotion costs")
    weights = np.clip(np.asarray(relevance, dtype=np.float64), 0.0, None)
    total = float(weights.sum())
    promoted = [False] * len(weights)
    if total <= 0.0:
        return promoted
    remaining = budget_tokens
    share_above, num_promoted = 0.0, 0
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        if weights[i] <= 0.0 or share_above >= tau or num_promoted >= max_high_res:
            break
        share_above += weights[i] / total
        if remaining is not None and promotion_costs[i] > remaining:
            continue
        promoted[i] = True
        num_promoted += 1
        if remaining is not None:
            remaining -= promotion_costs[i]
    return promoted


def entry_of(row: dict[str, Any]) -> Entry:
    """The one way an index row becomes an `Entry` the loader can fetch."""
    variant = Variant(row["variant"])
    key = CacheKey(row["chunk_key"], row["tier"], variant, row["fingerprint"]).to_str()
    return Entry(key, row["tier"], variant, row["num_tokens"], row["vision_tokens"], row["position_span"], row)


def find(slots: EntrySlots, tier: str | None, variant: Variant) -> Entry | None:
    row = slots.get((tier, variant))
    return None if row is None else entry_of(row)


def require(chunks: list[dict], slots: list[EntrySlots], tier: str | None, variant: Variant,
            mode: Mode) -> list[Entry]:
    found = [find(s, tier, variant) for s in slots]
    missing = [c["chunk_id"] for c, e in zip(chunks, found) if e is None]
    if missing:
        raise UnservableError(f"mode {mode.value!r} needs {variant.value} entries of tier {tier!r}, not compiled "
                              f"for chunks {missing[:10]}; run `qvpic recompile` on the store")
    return found


def place(mode: Mode, chunks: list[dict], slots: list[EntrySlots], relevance: list[float],
          texts: Callable[[], list[dict]], low: TierSpec, high: TierSpec, tau: float, max_high_res: int,
          room_tokens: int) -> tuple[list[PlannedChunk], list[FallbackReport]]:
    """Planned chunks (request order) for `chunks` (catalog rows), each chunk's entry `slots` and
    relevance. `texts()` fetches the chunks' text and image path; only the online modes call it.
    `room_tokens` is what the context holds for chunks: promotions that would not fit stay low."""
    if mode is Mode.FULL_TEXT:
        planned = []
        for chunk, entries, rel, source in zip(chunks, slots, relevance, texts()):
            text_entry = find(entries, None, Variant.TEXT)
            num_tokens = text_entry.num_tokens if text_entry else chunk["num_text_tokens"]
            planned.append(PlannedChunk(chunk["chunk_id"], chunk["doc_id"], rel, None, num_tokens, 0, num_tokens,
                                        None, text=source["text"]))
        return planned, []
    variant = LINKED_VARIANT.get(mode, Variant.TEMPLATE)
    if variant is Variant.TEXT:
        wanted = [None] * len(chunks)
    elif mode is Mode.IMAGE_PIC:
        wanted = [low.name] * len(chunks)
    elif mode is Mode.UNIFORM_HIGH:
        wanted = [high.name] * len(chunks)
    else:  # routed: price every promotion from the index, then allocate
        lows = require(chunks, slots, low.name, variant, mode)
        highs = [find(s, high.name, variant) for s in slots]
        costs = [h.num_tokens - lo.num_tokens if h else 0 for lo, h in zip(lows, highs)]
        budget = room_tokens - sum(lo.num_tokens for lo in lows)
        promoted = allocate(relevance, tau, max_high_res, costs, max(budget, 0))
        wanted = [high.name if p else low.name for p in promoted]
    online = mode is Mode.FULL_IMAGE  # prices from the stored entry, pages rendered and encoded online
    sources = texts() if online else [None] * len(chunks)
    planned, fallbacks = [], []
    for chunk, entries, rel, tier, source in zip(chunks, slots, relevance, wanted, sources):
        entry = find(entries, tier, variant)
        backup = find(entries, low.name, variant) if tier == high.name else None
        if entry is None and backup is not None:
            fallbacks.append(FallbackReport(chunk_id=chunk["chunk_id"], requested_tier=tier, served_tier=backup.tier,
                                            reason=f"{variant.value} entry of tier {tier!r} is not compiled"))
            entry, backup = backup, None
        if entry is None:
            require([chunk], [entries], tier, variant, mode)
        planned.append(PlannedChunk(chunk["chunk_id"], chunk["doc_id"], rel, entry.tier, entry.num_tokens,
                                    entry.vision_tokens, entry.position_span, None if online else entry,
                                    None if online else backup, source["text"] if online else None,
                                    (source["image_path"] or None) if online else None))
    return planned, fallbacks
