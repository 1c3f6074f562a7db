"""Hybrid representation per chunk: the declared rule (serve/routing/hybrid.py) picks text for a short chunk and for
one whose pages read illegibly at ingest, pages otherwise; placement applies it only when enabled; ingest
stores the OCR score; a hybrid context is served."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.runtime import Renderer, page_legibility
from pipeline.runtime.ocr import matched_share
from pipeline.store import Store
from schemas.api import AnswerRequest
from schemas.config import HybridSpec, RouterSpec
from schemas.modes import Mode, Variant
from schemas.render import RenderSpec
from schemas.sampling import Sampling
from serve.config import GeneratorConfig, RouterConfig
from serve.engine import Generator
from serve.kv import LocalLoader
from serve.plan import Entry, entry_of
from serve.routing import PlacementSpec, Retrieved, Router, place
from serve.routing.hybrid import Representation, choose
from serve.routing.placement import ChunkEntries
from tests.support.store_factory import MAX_CHUNKS, MAX_CONTEXT_TOKENS, build_store, loader_of, serving_store  # noqa: F401

ON = HybridSpec(enabled=True)
LOW, HIGH = RenderSpec().tiers
CODE = "def f(x):\n    return [i**2 for i in range(x) if i % 3 == 0]\n\nprint(f(10))"
PROSE = ("To reset the router, hold the button for ten seconds until the light blinks. The warranty covers two "
         "years of normal use and excludes water damage.")


def index_row(variant: Variant, tier: str | None, num_tokens: int, legibility: float | None) -> dict:
    """An index row as placement reads it (its shard never read here)."""
    return {"chunk_key": "0" * 64, "tier": tier, "variant": variant.value, "fingerprint": "f" * 64,
            "kind": "text" if tier is None else "image", "num_tokens": num_tokens, "compile_start": 0,
            "vision_tokens": 0 if tier is None else num_tokens, "position_span": num_tokens, "grid_thw": [],
            "image_sizes_px": [], "dtype": "float32", "shard_path": "shards/x.safetensors", "tensor_key": "x",
            "nbytes": 0, "byte_offset": 0, "shape": [1, 2, 1, num_tokens, 8], "checksum": "0" * 64,
            "legibility": legibility}


def entry(variant: Variant, tier: str | None, num_tokens: int, legibility: float | None = None) -> Entry:
    return entry_of(index_row(variant, tier, num_tokens, legibility))


def chunk_slots(text_tokens: int, low_tokens: int, high_tokens: int, low_legibility: float | None) -> dict:
    """One chunk's index rows as placement reads them: text, low and high templated (the high tier legible)."""
    return {(None, Variant.TEXT): index_row(Variant.TEXT, None, text_tokens, None),
            ("low", Variant.TEMPLATE): index_row(Variant.TEMPLATE, "low", low_tokens, low_legibility),
            ("high", Variant.TEMPLATE): index_row(Variant.TEMPLATE, "high", high_tokens, 1.0)}


# (text, low, high tokens, low legibility): a short chunk, a digit table 72 DPI blurs, legible prose
SHORT, DIGITS, PROSE_CHUNK = (6, 13, 38, 0.99), (24, 14, 40, 0.80), (60, 20, 56, 0.99)


def placed(hybrid: HybridSpec | None, chunks=(SHORT, DIGITS, PROSE_CHUNK), relevance=(0.9, 0.5, 0.4),
           max_high_res: int = 1, room_tokens: int = 10_000):
    catalog = [{"chunk_id": f"c{i}", "doc_id": "d", "num_text_tokens": c[0]} for i, c in enumerate(chunks)]
    slots = [chunk_slots(*c) for c in chunks]
    rows = Retrieved(chunks=catalog, entries=[ChunkEntries(s) for s in slots], relevance=list(relevance),
                     texts=lambda: [])
    policy = RouterSpec(tau=1.0, max_high_res=max_high_res, hybrid=hybrid or HybridSpec())
    planned, _ = place(Mode.QVPIC, rows, PlacementSpec(policy=policy, low=LOW, tier="high"), room_tokens)
    return [(c.tier, c.entry.variant.value, c.num_tokens) for c in planned]


def test_rule_on_fixed_entries_with_negative_controls():
    text, low = entry(Variant.TEXT, None, 6), entry(Variant.TEMPLATE, "low", 13, 0.99)
    assert choose(ON, text, low) is Representation.TEXT_CHEAPER  # short: fewer tokens as text
    digits_text, blurred = entry(Variant.TEXT, None, 24), entry(Variant.TEMPLATE, "low", 14, 0.80)
    assert choose(ON, digits_text, blurred) is Representation.TEXT_LEGIBLE  # illegible pages, text ≤ 2× their tokens
    prose_text, legible = entry(Variant.TEXT, None, 60), entry(Variant.TEMPLATE, "low", 20, 0.99)
    assert choose(ON, prose_text, legible) is Representation.IMAGE
    # negative controls: the same illegible chunk unmeasured, or its text too dear, stays pages
    assert choose(ON, digits_text, entry(Variant.TEMPLATE, "low", 14, None)) is Representation.IMAGE
    assert choose(ON, entry(Variant.TEXT, None, 29), blurred) is Representation.IMAGE
    assert choose(ON, None, blurred) is Representation.IMAGE  # no text entry compiled


def test_placement_applies_the_rule_only_when_enabled():
    off = placed(None, max_high_res=2)
    assert off == placed(HybridSpec(), max_high_res=2) == [("high", "template", 38), ("high", "template", 40),
                                                           ("low", "template", 20)]
    # on: the short chunk is text and takes no promotion, so the third chunk gets the second one; the
    # promoted digit table is cheaper as text than at the high tier
    assert placed(ON, max_high_res=2) == [(None, "text", 6), (None, "text", 24), ("high", "template", 56)]
    # unpromoted, the digit table's 72-DPI pages are illegible and its text costs ≤ 2× them: text
    assert placed(ON, max_high_res=0) == [(None, "text", 6), (None, "text", 24), ("low", "template", 20)]
    # a swap that adds tokens must fit the room: 6 + 14 + 20 = 40 fits, 6 + 24 + 20 = 50 does not
    assert placed(ON, max_high_res=0, room_tokens=45) == [(None, "text", 6), ("low", "template", 14),
                                                          ("low", "template", 20)]


def test_ingest_legibility_scores_code_below_prose_at_72_dpi():
    renderer = Renderer(RenderSpec())
    scores = {(name, tier.name): page_legibility(text, renderer.render(text, tier).pages, tier.dpi)
              for name, text in (("code", CODE), ("prose", PROSE)) for tier in (LOW, HIGH)}
    assert scores[("prose", "low")] >= ON.min_legibility > 0.9 > scores[("code", "low")]
    assert scores[("code", "high")] > scores[("code", "low")]
    assert matched_share("abc", "abc") == 1.0 and matched_share("abcd", "ab") == 0.5 and matched_share("", "x") == 1.0


@pytest.fixture(scope="module")
def legible_store(serving_store, tmp_path_factory):
    root = tmp_path_factory.mktemp("legibility-store")
    return str(build_store(root, serving_store.vlm, serving_store.embedder, legibility=True).uri)


def test_ingest_stores_legibility_and_a_hybrid_context_is_served(legible_store, serving_store):
    index = Store.open(legible_store).index().to_pylist()
    assert all((r["legibility"] is None) == (r["tier"] is None) for r in index)
    assert all(0.0 <= r["legibility"] <= 1.0 for r in index if r["tier"] is not None)
    assert all(r["legibility"] is None for r in Store.open(serving_store.uri).index().to_pylist())  # not asked for

    request = AnswerRequest(query="When does part XK-4471-B ship?", doc_ids=["invoices", "manual"], mode=Mode.QVPIC,
                            max_new_tokens=4)
    # every text entry of these short sentences costs more than its 72-DPI page: a ratio that makes the
    # shortest chunk cheaper as text shows the mixed context end to end
    texts = sorted((r["num_tokens"], r["chunk_key"]) for r in index if r["variant"] == "text")
    lows = {r["chunk_key"]: r["num_tokens"] for r in index if r["variant"] == "template" and r["tier"] == "low"}
    ratio = min(t / lows[k] for t, k in texts) * 1.001
    hybrid = RouterSpec(hybrid=HybridSpec(enabled=True, text_cost_ratio=ratio, min_legibility=0.0))
    router = Router(RouterConfig(store=legible_store, model=serving_store.model, defaults=hybrid, max_chunks=MAX_CHUNKS,
                                 max_context_tokens=MAX_CONTEXT_TOKENS))
    plain = Router(RouterConfig(store=legible_store, model=serving_store.model, max_chunks=MAX_CHUNKS,
                                max_context_tokens=MAX_CONTEXT_TOKENS))
    hybrid_plan, plain_plan = asyncio.run(router.plan(request)), asyncio.run(plain.plan(request))
    kinds = [c.entry.variant for c in hybrid_plan.chunks]
    assert Variant.TEXT in kinds and Variant.TEMPLATE in kinds
    assert all(c.entry.variant is Variant.TEMPLATE for c in plain_plan.chunks)  # off: pure qvpic
    generator = Generator(GeneratorConfig(store=legible_store, model=serving_store.model),
                          LocalLoader(loader_of(legible_store)))
    answer = generator.generate_blocking(hybrid_plan, Sampling(max_new_tokens=4))
    assert [c.variant for c in answer.report.chunks] == kinds and answer.report.fallbacks == []
    assert answer.report.usage.context_text_tokens > generator.generate_blocking(
        plain_plan, Sampling(max_new_tokens=4)).report.usage.context_text_tokens
