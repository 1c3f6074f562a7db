"""Pending entries: a lazily compiled tier's entry, planned before it exists.

A store ingested with `--lazy-high-tier` has no templated entry at its highest tier until a request
promotes the chunk (serve/kv/lazy_tier.py compiles it then). The router still promotes: it prices the
entry from the chunk's low-tier row — its pages scaled to the higher DPI, each page's vision tokens and
M-RoPE span from the family's own processor arithmetic (pipeline/runtime/tokens.py) — and plans a pending
entry under the key the entry will have. The loader does not read a pending entry; the generator
compiles it (or finds it written back) and serves the real entry, whose counts replace the estimate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pipeline.runtime import MERGE_SIZE, vision_grid, vision_tokens
from schemas.config import ModelFamily, ModelSpec
from schemas.modes import Variant
from schemas.store import CacheKey, Manifest
from serve.plan import Entry, EntryRow


def is_pending(entry: Entry | None) -> bool:
    return entry is not None and entry.row.pending


def page_cost(family: ModelFamily, size_px: Sequence[int], model: ModelSpec) -> tuple[int, int, tuple[int, int, int]]:
    """(vision tokens, positions spanned, (t, h, w) grid) of one page of `size_px` = [width, height]."""
    width, height = size_px
    if family is ModelFamily.LLAVA_ONEVISION:  # 1-D positions: a token a position; no thw grid to store
        tokens = vision_tokens(family, width, height)
        return tokens, tokens, (0, 0, 0)
    bounds = {"min_pixels": model.min_pixels, "max_pixels": model.max_pixels}
    t, h, w = vision_grid(family, width, height, **bounds)
    return vision_tokens(family, width, height, **bounds), max(h, w) // MERGE_SIZE, (t, h, w)


def pending_entry(manifest: Manifest, model: ModelSpec, low: Entry, tier: str) -> Entry:
    """The templated entry of `low`'s chunk at the lazy `tier`, priced from `low`'s pages."""
    family = manifest.model.family
    scale = manifest.render.tier(tier).dpi / manifest.render.tier(low.tier or "").dpi
    low_sizes = low.row.image_sizes_px
    sizes = tuple((max(1, round(w * scale)), max(1, round(h * scale))) for w, h in low_sizes)
    low_costs = [page_cost(family, s, model) for s in low_sizes]
    costs = [page_cost(family, s, model) for s in sizes]
    extra_tokens = sum(c[0] for c in costs) - sum(c[0] for c in low_costs)
    extra_span = sum(c[1] for c in costs) - sum(c[1] for c in low_costs)
    key = CacheKey(low.cache_key.chunk_key, tier, Variant.TEMPLATE, manifest.entry_fingerprint(Variant.TEMPLATE, tier))
    row = EntryRow(kind=low.row.kind, compile_start=low.row.compile_start, grid_thw=tuple(c[2] for c in costs),
                   image_sizes_px=sizes, stored=None, pending=True)
    return Entry(key=key.to_str(), tier=tier, variant=Variant.TEMPLATE, num_tokens=low.num_tokens + extra_tokens,
                 vision_tokens=low.vision_tokens + extra_tokens, position_span=low.position_span + extra_span, row=row)


PendingPlanner = Callable[[Entry | None, str | None], Entry | None]  # (low-tier entry, tier) -> pending entry or None


def lazy_planner(manifest: Manifest, model: ModelSpec) -> PendingPlanner | None:
    """For placement: the pending entry standing in for a missing (tier, templated) entry that `manifest`
    compiles lazily, given the chunk's low-tier entry; None when the store compiles every tier at ingest."""
    if not manifest.lazy_tiers:
        return None

    def plan(low: Entry | None, tier: str | None) -> Entry | None:
        if low is None or tier is None or not manifest.is_lazy(tier, low.variant):
            return None
        return pending_entry(manifest, model, low, tier)

    return plan
