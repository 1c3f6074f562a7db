"""Cache loader (byte-bounded LRU, unreadable entries) and generator (every mode, exactness, streaming)."""

from __future__ import annotations

import asyncio
import random
import shutil
import threading

import numpy as np
import pytest
import torch

from pipeline.runtime import VLM
from schemas.api import AnswerRequest, FinishReason
from schemas.config import DType, ModelSpec
from schemas.modes import Mode
from schemas.report import KVOrigin
from schemas.sampling import Sampling
from serve.config import LoaderConfig
from serve.kv import CacheLoader, GivenKV, HotTier, LocalLoader, from_wire, store_row, to_wire
from serve.kv.lru import ByteLRU
from serve.plan import Answer, Plan
from tests.support.store_factory import build_store, corrupt_entry, loader_of, roles, serving_store, stack_of  # noqa: F401  (fixtures)

QUERY = "When does part XK-4471-B ship?"
DOCUMENT = "Invoice 4471: part XK-4471-B ships on 12 March. The total is $1,093.40."


def plan(roles, **fields) -> Plan:
    return asyncio.run(roles.router.plan(AnswerRequest(query=QUERY, **fields)))


def answer(roles, max_new_tokens: int = 12, sampling: Sampling | None = None, **fields) -> Answer:
    planned = plan(roles, max_new_tokens=max_new_tokens, **fields)
    sampling = sampling or Sampling(max_new_tokens=max_new_tokens)
    return roles.generator.generate_blocking(planned, sampling)


def as_given(generator, planned: Plan, sampling: Sampling, result) -> Answer:
    """`planned` answered from exactly the KV in `result` (the device tier emptied first, so none of it is a hit):
    the reference the tiers' answer must equal."""
    generator.clear_hot_tier()
    return generator.generate_blocking(planned, sampling, source=GivenKV(result))


def collect(events) -> list:
    async def drain() -> list:
        return [event async for event in events]
    return asyncio.run(drain())


# ---- LRU ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
def test_lru_never_exceeds_its_cap_and_evicts_least_recent(seed):
    rng = random.Random(seed)
    cap = rng.randrange(100, 4000)
    # model: key -> nbytes, in recency order (dicts keep insertion order)
    lru, model = ByteLRU(cap, lambda item: item[0].nbytes), {}
    for _ in range(500):
        key = f"k{rng.randrange(40)}"
        if rng.random() < 0.5:
            nbytes = rng.choice([rng.randrange(1, cap // 3 + 2), rng.randrange(1, 2 * cap)])
            lru.put(key, (np.zeros(nbytes, dtype=np.uint8), DType.FLOAT32))
            model.pop(key, None)
            if nbytes <= cap:
                while sum(model.values()) + nbytes > cap:
                    del model[next(iter(model))]
                model[key] = nbytes
        else:
            hit = lru.get(key)
            assert (hit is not None) == (key in model)
            if hit is not None:
                model[key] = model.pop(key)
        assert lru.nbytes == sum(model.values()) <= cap
        assert lru.keys() == list(model)
    stats = lru.stats()
    assert stats.nbytes <= stats.max_nbytes and stats.entries == len(model)


def test_wire_round_trip_keeps_bits():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        tensor = torch.randn(2, 2, 1, 5, 4).to(dtype)
        array, wire_dtype = to_wire(tensor)
        assert isinstance(array, np.ndarray) and not array.flags.writeable
        assert torch.equal(from_wire(array, wire_dtype), tensor)


# ---- loader ---------------------------------------------------------------------------------------
def test_loader_counts_hits_and_misses(roles, serving_store):
    loader = loader_of(serving_store.uri)
    planned = plan(roles, doc_ids=["invoices", "manual"], mode=Mode.TEXT_PIC)
    first, second = loader.load(planned), loader.load(planned)
    assert (first.cache.hits, first.cache.misses) == (0, 4)
    assert first.cache.nbytes_from_store == sum(c.entry.row.stored.nbytes for c in planned.chunks)
    assert (second.cache.hits, second.cache.misses, second.cache.nbytes_from_store) == (4, 0, 0)
    assert [kv.entry.key for kv in second.kvs] == [c.entry.key for c in planned.chunks]


def test_unreadable_entries_are_handed_on_with_their_backup_and_rebuilt(roles, serving_store, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(serving_store.uri, root)
    planned = plan(roles, chunk_ids=["invoices#00000", "manual#00000"], mode=Mode.UNIFORM_HIGH)
    clean = roles.generator.generate_blocking(planned, Sampling(max_new_tokens=4))
    corrupt_entry(root, store_row(planned.chunks[0].entry.row))
    result = loader_of(str(root)).load(planned)
    (unreadable,) = result.unreadable
    assert (unreadable.position, unreadable.entry.tier, unreadable.backup.entry.tier) == (0, "high", "low")
    assert result.kvs[0] is None and result.kvs[1].entry.tier == "high" and "checksum" in unreadable.reason
    # rebuilt, not downgraded
    reply = as_given(roles.generator, planned, Sampling(max_new_tokens=4), result)
    assert [c.tier for c in reply.report.chunks] == ["high", "high"] and reply.report.fallbacks == []
    assert [c.kv_source for c in reply.report.chunks] == [KVOrigin.COMPILED, KVOrigin.STORE]
    assert reply.text == clean.text

    low_only = plan(roles, chunk_ids=["manual#00001"], mode=Mode.IMAGE_PIC)
    corrupt_entry(root, store_row(low_only.chunks[0].entry.row))
    result = loader_of(str(root)).load(low_only)
    assert result.kvs == (None,) and result.unreadable[0].backup is None
    rebuilt = as_given(roles.generator, low_only, Sampling(max_new_tokens=4), result)
    assert rebuilt.report.chunks[0].kv_source is KVOrigin.COMPILED
    assert rebuilt.text == roles.generator.generate_blocking(low_only, Sampling(max_new_tokens=4)).text


# ---- generator ------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", list(Mode))
def test_every_mode_answers_with_honest_accounting(roles, mode):
    roles.generator.clear_prefix_cache()  # cold: only the linked chunks' KV is reused
    reply = answer(roles, doc_ids=["invoices", "manual"], mode=mode, tau=0.6, max_high_res=2)
    report = reply.report
    assert report.mode is mode and report.usage.completion_tokens > 0
    assert [c.chunk_id for c in report.chunks] == ["invoices#00000", "invoices#00001", "manual#00000", "manual#00001"]
    assert report.usage.context_tokens == roles.generator.prefix_tokens + sum(c.num_tokens for c in report.chunks)
    assert report.usage.context_vision_tokens == sum(c.vision_tokens for c in report.chunks)
    online = mode in (Mode.FULL_TEXT, Mode.FULL_IMAGE)
    # cold, the template prefix is computed too (then kept in the prefix cache); only linked chunks are reused
    assert report.usage.cached_tokens == (0 if online else sum(c.num_tokens for c in report.chunks))
    assert (report.timings.reanchor_ms == 0) == online and report.timings.prefill_ms > 0
    assert (report.timings.render_ms > 0) == (mode is Mode.FULL_IMAGE)
    assert report.usage.prefix_cached_tokens == 0
    # warm: the same request again finds its whole prompt in the prefix cache, and the logits after it; the online
    # baselines recompute its last token (as vLLM's prefix cache does)
    again = answer(roles, doc_ids=["invoices", "manual"], mode=mode, tau=0.6, max_high_res=2).report.usage
    prompt_tokens = again.context_tokens + again.query_tokens
    assert again.prefix_cached_tokens == again.cached_tokens == prompt_tokens - (1 if online else 0)
    assert again.context_tokens == report.usage.context_tokens and again.query_tokens == report.usage.query_tokens


@pytest.mark.parametrize("tau, tier", [(0.0, "low"), (1.0, "high")])
def test_linked_answers_equal_online_answers_for_one_chunk(roles, tau, tier):
    """A single linked chunk is exact (float32): qvpic == full_image at the same tier, text_pic == full_text."""
    fields = {"chunk_ids": ["invoices#00000"], "tau": tau, "max_new_tokens": 16}
    roles.generator.clear_prefix_cache()  # each cold: a warm one would find the other's prompt KV
    linked = answer(roles, mode=Mode.QVPIC, **fields)
    roles.generator.clear_prefix_cache()
    online = answer(roles, mode=Mode.FULL_IMAGE, **fields)
    assert [c.tier for c in linked.report.chunks] == [c.tier for c in online.report.chunks] == [tier]
    linked_tokens = sum(c.num_tokens for c in linked.report.chunks)  # cold: the template prefix is computed
    assert linked.text == online.text and linked.report.usage == online.report.usage.model_copy(
        update={"cached_tokens": linked_tokens})
    assert answer(roles, mode=Mode.TEXT_PIC, **fields).text == answer(roles, mode=Mode.FULL_TEXT, **fields).text


def test_instruction_and_query_prompt_frame_the_chunks_in_every_mode(roles):
    """The instruction is prefilled online before the chunks, the query prompt after them, in every mode
    alike; routing ignores both: relevance is the bare query's. (Linked chunks do not attend to the
    instruction, as they attend to no other chunk: the exactness suite checks that against its reference.)"""
    instruction, query_prompt = "Read the invoice and answer briefly.\n\n", f"Question: {QUERY}\nAnswer:"
    fields = {"chunk_ids": ["invoices#00000"], "tau": 1.0, "max_new_tokens": 16}
    framed = {**fields, "instruction": instruction, "query_prompt": query_prompt}
    for linked, online in ((Mode.QVPIC, Mode.FULL_IMAGE), (Mode.TEXT_PIC, Mode.FULL_TEXT)):
        a, b = answer(roles, mode=linked, **framed), answer(roles, mode=online, **framed)
        assert a.report.usage.context_tokens == b.report.usage.context_tokens
        bare = answer(roles, mode=linked, **fields)
        instruction_tokens = len(roles.generator.vlm.adapter.encode(instruction))
        assert a.report.usage.context_tokens == bare.report.usage.context_tokens + instruction_tokens
        adapter = roles.generator.vlm.adapter
        assert a.report.usage.query_tokens == len(adapter.encode(query_prompt)) + len(adapter.turn_suffix_ids)
        assert [c.relevance for c in a.report.chunks] == [c.relevance for c in bare.report.chunks]
    planned = plan(roles, **framed)
    assert planned.prefix_tokens == roles.generator.prefix_tokens + instruction_tokens


def test_stream_deltas_add_up_to_the_answer(roles):
    planned = plan(roles, top_k=3, max_new_tokens=10)
    events = collect(roles.generator.stream(planned, Sampling(max_new_tokens=10)))
    *deltas, final = events
    assert isinstance(final, Answer) and all(isinstance(d, str) and d for d in deltas)
    assert "".join(deltas) == final.text
    assert final.report.finish_reason is (FinishReason.LENGTH if final.report.usage.completion_tokens == 10
                                          else FinishReason.STOP)


def test_seeded_sampling_is_reproducible(roles):
    sampling = Sampling(max_new_tokens=12, temperature=1.3, top_p=0.9, seed=7)
    first = answer(roles, chunk_ids=["recipes#00000"], sampling=sampling, max_new_tokens=12)
    second = answer(roles, chunk_ids=["recipes#00000"], sampling=sampling, max_new_tokens=12)
    assert first.text == second.text


@pytest.mark.parametrize("name", ["tiny-glm", "tiny-qwen2", "tiny-llava"])
def test_other_families_linked_answers_equal_online_answers(serving_store, tmp_path, name):
    """The other families through the same store and serving path: GLM's rotary layout (interleaved pairs,
    part of each head), Qwen2-VL's vision tower, LLaVA-OneVision's AnyRes tiles and 1-D RoPE."""
    model = ModelSpec(path=name, device="cpu")
    build_store(tmp_path, VLM(model), serving_store.embedder, {"invoices": [DOCUMENT]})
    uri = str(tmp_path)
    glm = stack_of(uri, model, max_chunks=4)
    for linked, online in ((Mode.QVPIC, Mode.FULL_IMAGE), (Mode.TEXT_PIC, Mode.FULL_TEXT)):
        fields = {"chunk_ids": ["invoices#00000"], "tau": 1.0, "max_new_tokens": 16}
        assert answer(glm, mode=linked, **fields).text == answer(glm, mode=online, **fields).text


# ---- device hot tier --------------------------------------------------------------------------------
class CountingLoader(CacheLoader):
    """A loader that records which entries each call asked for."""

    def __init__(self, config: LoaderConfig):
        super().__init__(config)
        self.asked: list[list[str]] = []

    def load(self, plan):
        self.asked.append([c.entry.key for c in plan.chunks if c.entry is not None])
        return super().load(plan)


def test_hot_chunks_cross_to_the_device_once_and_misses_fetch_only_what_is_missing(roles, serving_store):
    roles.generator.contexts.hot.clear()
    loader = CountingLoader(LoaderConfig(store=serving_store.uri, max_nbytes=1 << 20))
    first = plan(roles, chunk_ids=["invoices#00000", "manual#00000"], mode=Mode.TEXT_PIC, max_new_tokens=4)
    second = plan(roles, chunk_ids=["manual#00000", "recipes#00000", "invoices#00000"], mode=Mode.TEXT_PIC,
                  max_new_tokens=4)
    sampling = Sampling(max_new_tokens=4)
    cold = roles.generator.generate_blocking(first, sampling, source=LocalLoader(loader)).report.cache
    warm = roles.generator.generate_blocking(first, sampling, source=LocalLoader(loader)).report.cache
    mixed = roles.generator.generate_blocking(second, sampling, source=LocalLoader(loader)).report.cache
    assert (cold.device_hits, cold.misses) == (0, 2) and (warm.device_hits, warm.hits, warm.misses) == (2, 0, 0)
    assert (mixed.device_hits, mixed.hits + mixed.misses) == (2, 1)
    assert loader.asked == [[c.entry.key for c in first.chunks], [second.chunks[1].entry.key]]  # warm: no call
    # the same answer whichever tier served each chunk
    given = as_given(roles.generator, second, sampling, roles.loader.load(second))
    assert roles.generator.generate_blocking(second, sampling, source=LocalLoader(loader)).text == given.text


class GatedLoader(CountingLoader):
    """A counting loader whose reads wait for `gate`: requests are certain to overlap while it is shut.
    `fail_first` makes the first read raise (after the gate opens)."""

    def __init__(self, config: LoaderConfig, fail_first: bool = False):
        super().__init__(config)
        self.gate, self.fail_first = threading.Event(), fail_first

    def load(self, plan):
        self.gate.wait(timeout=30)
        if self.fail_first:
            self.fail_first = False
            self.asked.append(["failed"])
            raise OSError("injected: the first read fails")
        return super().load(plan)


def overlapping(generator, loader: GatedLoader, plans: list[Plan], sampling: Sampling) -> list:
    """Start every plan's request, open the loader's gate once all have reached the hot tier, gather."""
    async def run() -> list:
        tasks = [asyncio.create_task(generator.generate(p, sampling, source=LocalLoader(loader))) for p in plans]
        await asyncio.sleep(0.5)  # every request has looked its entries up and waits on a read or on a fetch
        loader.gate.set()
        return await asyncio.gather(*tasks, return_exceptions=True)
    return asyncio.run(run())


def test_requests_in_flight_for_the_same_entries_fetch_them_once(roles, serving_store):
    roles.generator.contexts.hot.clear()
    loader = GatedLoader(LoaderConfig(store=serving_store.uri, max_nbytes=1 << 20))
    ids = ["invoices#00000", "manual#00000"]
    first = plan(roles, chunk_ids=ids, mode=Mode.TEXT_PIC, max_new_tokens=4)
    overlap = plan(roles, chunk_ids=["manual#00000", "recipes#00000"], mode=Mode.TEXT_PIC, max_new_tokens=4)
    sampling = Sampling(max_new_tokens=4)
    a, b, c = overlapping(roles.generator, loader, [first, first, overlap], sampling)
    # one read of the first set; the overlapping plan reads only the entry nobody was fetching
    assert sorted(map(sorted, loader.asked)) == sorted([sorted(c.entry.key for c in first.chunks),
                                                         [overlap.chunks[1].entry.key]])
    assert (a.report.cache.device_hits, a.report.cache.misses) == (0, 2)
    assert (b.report.cache.device_hits, b.report.cache.hits + b.report.cache.misses) == (2, 0)
    assert c.report.cache.device_hits == 1
    # the answers are those of the same plans served one at a time from what the loader reads
    for planned, got in ((first, a), (first, b), (overlap, c)):
        assert got.text == as_given(roles.generator, planned, sampling, roles.loader.load(planned)).text


def test_a_failed_fetch_leaves_its_waiters_to_fetch_for_themselves(roles, serving_store):
    roles.generator.contexts.hot.clear()
    loader = GatedLoader(LoaderConfig(store=serving_store.uri, max_nbytes=1 << 20), fail_first=True)
    first = plan(roles, chunk_ids=["invoices#00000"], mode=Mode.TEXT_PIC, max_new_tokens=4)
    failed, waited = overlapping(roles.generator, loader, [first, first], Sampling(max_new_tokens=4))
    assert isinstance(failed, OSError) and not isinstance(waited, BaseException)
    assert loader.asked == [["failed"], [first.chunks[0].entry.key]]  # the waiter read it itself, no hang
    assert waited.report.cache.misses == 1 and not roles.generator.contexts._fetching


def test_the_hot_tier_keeps_its_byte_cap(roles, serving_store):
    sizes = {}
    for chunk_id in ("invoices#00000", "manual#00000", "recipes#00000"):
        planned = plan(roles, chunk_ids=[chunk_id], mode=Mode.TEXT_PIC)
        sizes[chunk_id] = planned.chunks[0].entry.row.stored.nbytes
    generator = roles.generator
    saved = generator.contexts.hot
    generator.contexts.hot = HotTier(sizes["invoices#00000"] + sizes["manual#00000"])
    try:
        for chunk_id in sizes:
            planned = plan(roles, chunk_ids=[chunk_id], mode=Mode.TEXT_PIC, max_new_tokens=2)
            generator.generate_blocking(planned, Sampling(max_new_tokens=2))
            assert generator.contexts.hot.nbytes <= generator.contexts.hot.max_nbytes
        assert len(generator.contexts.hot.keys()) == 2 and generator.contexts.hot.stats().evictions >= 1
    finally:
        generator.contexts.hot = saved


@pytest.mark.parametrize("mode", [Mode.FULL_TEXT, Mode.FULL_IMAGE])
def test_an_online_prompt_reserves_its_chunks_columns(roles, monkeypatch, mode):
    """An online request's KV reservation counts the chunks it prefills with the question (as the router priced
    them), not only the text around them: under a cap that holds its text but not its chunks it is refused at once
    (413); a cap that holds both admits it."""
    from schemas.errors import TooLargeError
    from serve.engine.qvpic import column_nbytes

    planned = plan(roles, doc_ids=["invoices", "manual"], mode=mode, tau=1.0, max_new_tokens=2)
    chunk_tokens = sum(c.num_tokens for c in planned.chunks)
    per_token, scheduler = column_nbytes(roles.generator.vlm), roles.generator.engine.scheduler
    whole = planned.prompt_tokens + 2 - 1  # the prompt as priced, and the one answer token fed back
    for columns, admitted in ((whole - chunk_tokens // 2, False), (whole + 16, True)):
        monkeypatch.setattr(scheduler, "config", scheduler.config.model_copy(
            update={"max_kv_nbytes": columns * per_token}))
        if admitted:
            assert roles.generator.generate_blocking(planned, Sampling(max_new_tokens=2)).report.mode is mode
        else:
            with pytest.raises(TooLargeError, match="max_kv_nbytes"):
                roles.generator.generate_blocking(planned, Sampling(max_new_tokens=2))
