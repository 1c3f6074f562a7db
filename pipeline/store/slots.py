"""Which entries a chunk needs and how pipeline rows name them: manifest logic only, no model stack, so the
Ray Data tasks that dedup and account (pipeline/ingest/stages/dedup.py) start workers without importing torch."""

from __future__ import annotations

from collections.abc import Sequence

from schemas.modes import AblationTiers, Variant
from schemas.store import CacheKey, Manifest


def entry_slots(manifest: Manifest, variants: Sequence[Variant],
                include_lazy: bool = False) -> list[tuple[str | None, Variant]]:
    """(tier, variant) of every entry a chunk needs: templated pages at every tier, the ablations' pages
    (plain, dummy prefix) at the lowest or, as the manifest's `ablation_tiers` says, at every tier, each
    text variant once. Slots the manifest compiles lazily (on first promotion, see serve/kv/lazy_tier.py)
    are left out unless `include_lazy`: jobs do not build them, but keep what serving wrote back."""
    slots: list[tuple[str | None, Variant]] = []
    every = [t.name for t in manifest.tiers]
    ablation = every if manifest.ablation_tiers is AblationTiers.EVERY else [manifest.render.lowest_tier.name]
    for variant in variants:
        tiers = {Variant.TEXT: [None], Variant.TEXT_PLAIN: [None], Variant.PLAIN: ablation,
                 Variant.DUMMY: ablation}.get(variant, every)
        slots += [(tier, variant) for tier in tiers if include_lazy or not manifest.is_lazy(tier, variant)]
    return slots


def slot_name(tier: str | None, variant: Variant | str) -> str:
    """`<tier or ->/<variant>`: how pipeline rows name an entry slot."""
    return f"{tier or CacheKey.NO_TIER}/{Variant(variant).value}"


def required_keys(manifest: Manifest, chunk_key: str, variants: Sequence[Variant]) -> list[CacheKey]:
    return [CacheKey(chunk_key, tier, variant, manifest.entry_fingerprint(variant, tier))
            for tier, variant in entry_slots(manifest, variants)]
