"""Lazy high tier: a store ingested with `lazy_high_tier` holds no high-tier templated entries; the first
promotion compiles the entry once (concurrent promotions share one compile), writes it back, and later
requests hit it; what is served equals the eager store's answer (float32: KV and query logits ≤ 1e-5,
greedy tokens identical)."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from pipeline.ingest import RecompileConfig, new_manifest
from pipeline.ingest.recompile_job import finish
from pipeline.ingest.recompile_job import target_manifest as recompile_manifest
from pipeline.store import Store, entry_slots, written_back
from schemas.api import AnswerRequest
from schemas.modes import Mode, Variant
from schemas.render import RenderSpec
from schemas.sampling import Sampling
from schemas.store import CacheKey
from serve.config import GeneratorConfig, RouterConfig
from serve.engine import Generator
from serve.kv import LocalLoader, is_pending, store_row, to_wire
from serve.kv.lazy_tier import SingleFlight
from serve.plan import LoadedKV
from serve.routing import Router
from tests.pipeline.runtime.test_batched_compile import QUERY
from tests.support.store_factory import (  # noqa: F401
    MAX_CHUNKS,
    MAX_CONTEXT_TOKENS,
    build_store,
    corrupt_entry,
    loader_of,
    serving_store,
)

QUERY = "When does part XK-4471-B ship?"
REQUEST = AnswerRequest(query=QUERY, chunk_ids=["invoices#00000", "manual#00001"], mode=Mode.QVPIC, tau=0.5,
                        max_high_res=1, max_new_tokens=6)
SAMPLING = Sampling(max_new_tokens=6)


def query_logits(vlm, chunks) -> tuple[torch.Tensor, list[int]]:
    """Logits of every query token prefilled on the linked chunks, and 6 greedy tokens after them."""
    state = vlm.prefill_query(vlm.assemble(chunks), QUERY, all_logits=True)
    return state.logits[0].clone(), vlm.generate(state, Sampling(max_new_tokens=6))


@pytest.fixture(scope="module")
def lazy_root(serving_store, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lazy-store")
    build_store(root, serving_store.vlm, serving_store.embedder, lazy_high_tier=True)
    return root


def copy_of(root: Path, tmp_path: Path) -> str:
    shutil.copytree(root, tmp_path / "store")
    return str(tmp_path / "store")


def serving(uri: str, serving_store) -> tuple[Router, Generator]:
    router = Router(RouterConfig(store=uri, model=serving_store.model, max_chunks=MAX_CHUNKS,
                                 max_context_tokens=MAX_CONTEXT_TOKENS))
    return router, Generator(GeneratorConfig(store=uri, model=serving_store.model))


def counting(generator: Generator, delay_s: float = 0.0) -> list[str]:
    """Record every compile the lazy tier asks the generator for (after `delay_s`, to overlap callers)."""
    calls, compile_entry = [], generator.repairer.lazy.compile_entry

    def counted(chunk, entry):
        calls.append(entry.key)
        time.sleep(delay_s)
        return compile_entry(chunk, entry)

    generator.repairer.lazy.compile_entry = counted
    return calls


def test_lazy_manifest_skips_the_high_tier_at_ingest(lazy_root, serving_store):
    store = Store.open(str(lazy_root))
    manifest = store.load_manifest_or_raise()
    assert manifest.lazy_tiers == ("high",)
    index = store.index().to_pylist()
    assert not [r for r in index if r["tier"] == "high"]
    assert {(r["tier"], r["variant"]) for r in index} == {("low", v.value) for v in
                                                          (Variant.TEMPLATE, Variant.PLAIN, Variant.DUMMY)} | \
        {(None, Variant.TEXT.value), (None, Variant.TEXT_PLAIN.value)}
    assert ("high", Variant.TEMPLATE) not in entry_slots(manifest, manifest.variants)
    assert ("high", Variant.TEMPLATE) in entry_slots(manifest, manifest.variants, include_lazy=True)
    eager = Store.open(serving_store.uri).stats()
    assert store.stats().num_entries < eager.num_entries  # negative control: the eager store has them
    assert any(g.tier == "high" for g in eager.groups)
    with pytest.raises(ValueError, match="lazy tier"):  # the lowest tier backs the lazy one up: never lazy
        manifest.model_validate({**manifest.model_dump(), "lazy_tiers": ("low",)})
    fresh = new_manifest(serving_store.model, RenderSpec(), tuple(Variant), "e", 3, "j", lazy_high_tier=True)
    assert fresh.lazy_tiers == ("high",) and new_manifest(serving_store.model, RenderSpec(), tuple(Variant), "e", 3,
                                                          "j").lazy_tiers == ()


def test_first_promotion_compiles_once_writes_back_and_later_requests_hit(lazy_root, serving_store, tmp_path):
    uri = copy_of(lazy_root, tmp_path)
    router, generator = serving(uri, serving_store)
    calls = counting(generator)
    plan = asyncio.run(router.plan(REQUEST))
    pending = [c for c in plan.chunks if is_pending(c.entry)]
    assert len(pending) == 1 and pending[0].tier == "high"  # the router promotes: it does not skip the tier
    key = CacheKey.parse(pending[0].entry.key)
    assert written_back(Store.open(uri), key) is None

    first = generator.generate_blocking(plan, SAMPLING, source=LocalLoader(loader_of(uri)))
    assert calls == [key.to_str()] and first.report.fallbacks == []
    assert [c.tier for c in first.report.chunks] == [c.tier for c in plan.chunks]
    row = written_back(Store.open(uri), key)
    assert row is not None and Store.open(uri).has_entries([key]) == {key}  # one row, in the store's index
    served = next(c for c in first.report.chunks if c.tier == "high")
    assert (served.num_tokens, served.position_span) == (row["num_tokens"], row["position_span"])
    # The router priced it from the low tier's pages scaled (hinted glyph advances make widths not quite
    # proportional): close, and the served counts are the compiled entry's own.
    assert abs(pending[0].num_tokens - row["num_tokens"]) <= 0.1 * row["num_tokens"]

    second = generator.generate_blocking(plan, SAMPLING, source=LocalLoader(loader_of(uri)))
    assert calls == [key.to_str()] and second.text == first.text and second.report.cache.device_hits == 2
    generator.contexts.hot.clear()  # evicted from the device: the written-back entry is read, not compiled
    third = generator.generate_blocking(plan, SAMPLING, source=LocalLoader(loader_of(uri)))
    assert calls == [key.to_str()] and third.text == first.text
    assert generator.repairer.lazy.stats.from_store == 1 and generator.repairer.lazy.stats.compiled == 1

    other = Generator(GeneratorConfig(store=uri, model=serving_store.model))  # another replica
    other_calls = counting(other)
    assert other.generate_blocking(plan, SAMPLING, source=LocalLoader(loader_of(uri))).text == first.text
    assert other_calls == [] and other.repairer.lazy.stats.from_store == 1


def concurrent_promotions(uri: str, serving_store) -> tuple[list[str], Generator]:
    router, generator = serving(uri, serving_store)
    calls = counting(generator, delay_s=0.5)
    plan = asyncio.run(router.plan(REQUEST))
    loaded = [loader_of(uri).load(plan) for _ in range(2)]
    results = [None, None]

    def promote(i: int) -> None:
        results[i] = generator.repairer.repair(plan, loaded[i])

    threads = [threading.Thread(target=promote, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(r is not None and not r.unreadable and not r.fallbacks for r in results)
    assert [kv.entry.key for kv in results[0].kvs] == [kv.entry.key for kv in results[1].kvs]
    return calls, generator


def test_concurrent_first_promotions_compile_once(lazy_root, serving_store, tmp_path):
    calls, generator = concurrent_promotions(copy_of(lazy_root, tmp_path), serving_store)
    assert len(calls) == 1 and generator.repairer.lazy.stats.shared == 1


def test_negative_control_without_single_flight_both_compile(lazy_root, serving_store, tmp_path, monkeypatch):
    monkeypatch.setattr(SingleFlight, "run", lambda self, key, fn: (fn(), True))
    calls, _ = concurrent_promotions(copy_of(lazy_root, tmp_path), serving_store)
    assert len(calls) == 2  # the count above can fail: the second writer rewrote the same part, harmlessly


def test_lazy_answer_equals_the_eager_store(lazy_root, serving_store, tmp_path):
    uri = copy_of(lazy_root, tmp_path)
    lazy_router, lazy_generator = serving(uri, serving_store)
    eager_router, eager_generator = serving(serving_store.uri, serving_store)
    lazy_plan, eager_plan = asyncio.run(lazy_router.plan(REQUEST)), asyncio.run(eager_router.plan(REQUEST))
    assert [c.tier for c in lazy_plan.chunks] == [c.tier for c in eager_plan.chunks]
    lazy = lazy_generator.generate_blocking(lazy_plan, SAMPLING, source=LocalLoader(loader_of(uri)))
    eager = eager_generator.generate_blocking(eager_plan, SAMPLING,
                                              source=LocalLoader(loader_of(serving_store.uri)))
    assert lazy.text == eager.text
    assert [(c.tier, c.num_tokens, c.position_span) for c in lazy.report.chunks] == \
        [(c.tier, c.num_tokens, c.position_span) for c in eager.report.chunks]

    vlm = serving_store.vlm
    lazy_store, eager_store = Store.open(uri), Store.open(serving_store.uri)
    lazy_kvs = [lazy_generator.contexts.hot.get_many([c.entry]).found[c.entry.key][0] for c in lazy_plan.chunks]
    eager_kvs = [eager_generator.contexts.hot.get_many([c.entry]).found[c.entry.key][0] for c in eager_plan.chunks]
    high = next(i for i, c in enumerate(eager_plan.chunks) if c.tier == "high")
    stored_lazy = lazy_store.load_kv(written_back(lazy_store, CacheKey.parse(lazy_plan.chunks[high].entry.key)))
    assert float((stored_lazy - eager_store.load_kv(store_row(eager_plan.chunks[high].entry.row))).abs().max()) <= 1e-5
    lazy_logits, lazy_tokens = query_logits(vlm, lazy_kvs)
    eager_logits, eager_tokens = query_logits(vlm, eager_kvs)
    assert lazy_tokens == eager_tokens
    assert float((lazy_logits - eager_logits).abs().max()) <= 1e-5
    fallback = lazy_plan.chunks[high].fallback  # negative control: the low tier in the promoted chunk's place
    swapped = list(eager_kvs)
    array, dtype = to_wire(eager_store.load_kv(store_row(fallback.row)))
    swapped[high] = eager_generator.contexts._chunk(LoadedKV(array=array, dtype=dtype, entry=fallback), copy=True)
    assert float((query_logits(vlm, swapped)[0] - eager_logits).abs().max()) > 1e-3


def test_recompile_keeps_the_store_lazy_and_its_written_back_entries(lazy_root, serving_store, tmp_path):
    uri = copy_of(lazy_root, tmp_path)
    router, generator = serving(uri, serving_store)
    plan = asyncio.run(router.plan(REQUEST))
    generator.generate_blocking(plan, SAMPLING, source=LocalLoader(loader_of(uri)))
    key = CacheKey.parse(next(c.entry.key for c in plan.chunks if c.tier == "high"))
    store = Store.open(uri)
    new, _ = recompile_manifest(store.load_manifest_or_raise(), RecompileConfig(store=store.spec,
                                                                                 model=serving_store.model))
    assert new.lazy_tiers == ("high",)  # a recompile builds no high tier either
    finish(store.spec, "recompile-test", new, orphan_grace_s=3600.0, key=None)  # publish, compact to current
    # fingerprints (no seal key)
    assert Store.open(uri).has_entries([key]) == {key}
    eager_only = {new.entry_fingerprint(v, t) for t, v in entry_slots(new, new.variants)}
    Store.open(uri).compact(keep_fingerprints=eager_only)  # negative control: what keeping jobs' slots alone drops
    assert Store.open(uri).has_entries([key]) == set()


def test_an_unreadable_write_back_is_compiled_again(lazy_root, serving_store, tmp_path):
    uri = copy_of(lazy_root, tmp_path)
    router, generator = serving(uri, serving_store)
    plan = asyncio.run(router.plan(REQUEST))
    first = generator.generate_blocking(plan, SAMPLING, source=LocalLoader(loader_of(uri)))
    key = CacheKey.parse(next(c.entry.key for c in plan.chunks if c.tier == "high"))
    corrupt_entry(Path(uri), written_back(Store.open(uri), key))
    other = Generator(GeneratorConfig(store=uri, model=serving_store.model))
    calls = counting(other)
    again = other.generate_blocking(plan, SAMPLING, source=LocalLoader(loader_of(uri)))
    assert calls == [key.to_str()] and again.text == first.text and again.report.fallbacks == []
    assert Store.open(uri).load_kv(written_back(Store.open(uri), key)) is not None  # written over: readable again
