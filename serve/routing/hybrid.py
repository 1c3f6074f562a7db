"""Hybrid representation per chunk: pages or text, chosen by the declared rule of `HybridSpec`.

Some chunks are cheaper as text than as pages (a short chunk's page still costs a row of patches per
line), and some lose characters at a low tier (small digits, code), which text never does. The rule
reads only what ingest stored: the text entry's tokens, each image tier's tokens, and each image
tier's OCR legibility (`qvpic ingest --legibility`). Both text variants' KV is compiled under the same
chat-template prefix as the templated pages, so a text entry links into a qvpic context like a page.

Pure functions over placement's entries; placement (serve/routing/placement.py) applies them in qvpic mode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from enum import Enum

from schemas.config import HybridSpec
from schemas.modes import Variant
from schemas.report import TierReason
from serve.plan import Entry, PlannedChunk

TEXT_VARIANT = Variant.TEXT  # compiled under the template prefix, like the pages qvpic links


class Representation(str, Enum):
    """How the hybrid rule serves one chunk: its pages, or its text (and by which rule)."""

    IMAGE = "image"
    TEXT_CHEAPER = "text_cheaper"  # rule 1
    TEXT_LEGIBLE = "text_legible"  # rule 2


def choose(spec: HybridSpec, text: Entry | None, image: Entry) -> Representation:
    """The rule for one chunk whose pages would be served as `image`."""
    if text is None:
        return Representation.IMAGE
    if text.num_tokens <= spec.text_cost_ratio * image.num_tokens:
        return Representation.TEXT_CHEAPER
    legibility = image.row.legibility
    if legibility is not None and legibility < spec.min_legibility and \
            text.num_tokens <= spec.illegible_text_cost_ratio * image.num_tokens:
        return Representation.TEXT_LEGIBLE
    return Representation.IMAGE


def as_text(chunk: PlannedChunk, text: Entry) -> PlannedChunk:
    return dataclasses.replace(chunk, tier=None, num_tokens=text.num_tokens, vision_tokens=0,
                               position_span=text.position_span, entry=text, fallback=None,
                               tier_reason=TierReason.HYBRID_TEXT)


def cheaper_as_text(spec: HybridSpec, texts: Sequence[Entry | None], lows: Sequence[Entry]) -> list[bool]:
    """Rule 1 at the lowest tier, before promotion: these chunks are text and take no promotion."""
    return [choose(spec, t, lo) is Representation.TEXT_CHEAPER for t, lo in zip(texts, lows)]


def apply_rule(spec: HybridSpec, planned: list[PlannedChunk], texts: Sequence[Entry | None],
               room_tokens: int) -> list[PlannedChunk]:
    """The rule at each chunk's routed tier, most relevant chunk first; a swap that adds tokens (rule 2)
    only while the context still fits `room_tokens`."""
    out = list(planned)
    used = sum(c.num_tokens for c in out)
    for i in sorted(range(len(out)), key=lambda i: (-out[i].relevance, i)):
        chunk, text = out[i], texts[i]
        if chunk.entry is None or chunk.entry.variant is TEXT_VARIANT or text is None:
            continue
        representation = choose(spec, text, chunk.entry)
        extra = text.num_tokens - chunk.num_tokens
        if representation is Representation.TEXT_CHEAPER or (representation is Representation.TEXT_LEGIBLE
                                                             and used + extra <= room_tokens):
            used += extra
            out[i] = as_text(chunk, text)
    return out
