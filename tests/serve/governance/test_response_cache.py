"""Response caches l1/l2/l3 on the in-process LRU and on a real Redis, through the HTTP app (no Ray)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

import pytest

from schemas.report import ResponseCacheLevel
from serve.app import api_spec
from serve.config import AppConfig
from serve.governance import Governor
from serve.governance.config import ResponseCacheConfig
from serve.governance.response_cache import CacheDirectives, MemoryBackend, Put, RedisBackend
from serve.governance.shared_state import RedisConnection, SharedStateUnavailable
from serve.http import make_api
from serve.local import InProcessBackend
from tests.serve.governance.test_budget import governed_app
from tests.serve.http.test_api import call, sse_events
from tests.serve.http.test_metrics import metric
from tests.support.fixtures_redis import redis_url, start_redis  # noqa: F401  (fixture)
from tests.support.store_factory import roles, serving_store  # noqa: F401  (fixtures)

QUERY = "When does part XK-4471-B ship?"
BACKENDS = ["memory", "redis"]


def answer(app, headers: dict | None = None, **fields):
    body = {"query": QUERY, "chunk_ids": ["invoices#00000", "manual#00001"], "mode": "qvpic", "tau": 0.0,
            "max_new_tokens": 4, **fields}
    response = call(app, "POST", "/v1/answer", json=body, headers=headers or {})
    assert response.status_code == 200, response.text
    return response


def ask(app, headers: dict | None = None, **fields) -> dict:
    return answer(app, headers, **fields).json()


def level(reply: dict) -> str | None:
    return reply["response_cache"]["level"]


def cache_app(roles, serving_store, redis_url, backend: str, **cache):
    return governed_app(roles, serving_store, redis_url=redis_url, response_cache={"backend": backend, **cache})


def fresh_query() -> str:
    """A query no earlier test cached (the session's Redis outlives each test's app)."""
    return f"{QUERY} #{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_l1_exact_hits_do_no_model_work(roles, serving_store, redis_url, backend):
    app, _ = cache_app(roles, serving_store, redis_url, backend)
    query = fresh_query()
    before = metric(app, "qvpic_response_cache_total", result="l1")
    first = ask(app, query=query)
    hit = ask(app, query=f"  {query.replace(' ', '   ')} ")  # normalised: runs of whitespace, trimmed
    assert level(first) is None and level(hit) == "l1" and hit["answer"] == first["answer"]
    assert hit["usage"] == first["usage"] and hit["chunks"] == first["chunks"]
    assert hit["cache"] == {"device_hits": 0, "hits": 0, "misses": 0, "nbytes_from_store": 0}
    # a hit says so, and reports no model phase rather than a 0 that would read as a measurement
    assert hit["cache_hit"] is True and first["cache_hit"] is False
    assert {k: v for k, v in hit["timings"].items() if v is None} == {
        phase: None for phase in ("load_ms", "render_ms", "queue_ms", "reanchor_ms", "prefill_ms", "decode_ms")}
    assert hit["timings"]["total_ms"] > 0 and hit["response_cache"]["lookup_ms"] > 0
    assert first["timings"]["prefill_ms"] > 0 and first["response_cache"]["lookup_ms"] > 0  # a miss was looked up
    assert metric(app, "qvpic_response_cache_total", result="l1") - before == 1
    assert level(ask(app, query=query, max_new_tokens=5)) is None  # other sampling: another key
    assert level(ask(app, query=query, tau=1.0)) is None  # other tiers: another context
    assert level(ask(app, query=query, instruction="Answer in one word.\n")) is None  # another prompt around
    assert level(ask(app, query=query, query_prompt=f"Question: {query}\nAnswer:")) is None  # the same chunks
    streamed = call(app, "POST", "/v1/answer", json={"query": query, "chunk_ids": ["invoices#00000", "manual#00001"],
                                                     "tau": 0.0, "max_new_tokens": 4, "stream": True})
    *deltas, done = [json.loads(e) for e in sse_events(streamed.text)]
    assert done["response"]["response_cache"]["level"] == "l1" and done["response"]["cache_hit"] is True
    assert "".join(d["text"] for d in deltas) == first["answer"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_control_no_cache_computes_and_no_store_keeps_out(roles, serving_store, redis_url, backend):
    app, _ = cache_app(roles, serving_store, redis_url, backend)
    query = fresh_query()
    before = metric(app, "qvpic_response_cache_total", result="no_cache")
    kept_out = answer(app, {"Cache-Control": "no-store"}, query=query)
    assert kept_out.headers["Cache-Status"] == "qvpic; fwd=uri-miss"
    assert not kept_out.json()["cache_hit"] and level(ask(app, query=query)) is None  # no-store: nothing kept
    assert level(ask(app, query=query)) == "l1"  # the plain request before stored it
    for headers in ({"Cache-Control": "no-cache"}, {"Cache-Control": "max-age=0"}, {"Pragma": "no-cache"},
                    {"Cache-Control": "no-store, No-Cache"}):
        bypassed = answer(app, headers, query=query)
        reply = bypassed.json()
        assert bypassed.headers["Cache-Status"] == "qvpic; fwd=request", headers
        assert not reply["cache_hit"] and level(reply) is None and reply["timings"]["prefill_ms"] > 0
        assert reply["response_cache"]["lookup_ms"] is None  # not looked up at all
    assert metric(app, "qvpic_response_cache_total", result="no_cache") - before == 4
    unasked = fresh_query()
    assert answer(app, {"Cache-Control": "no-cache"}, query=unasked).headers["Cache-Status"] == "qvpic; fwd=request"
    assert level(ask(app, query=unasked)) is None  # no-cache computed it and kept nothing: it never writes
    hit = answer(app, {"Cache-Control": "max-age=60"}, query=query)  # other directives leave the cache on
    assert hit.json()["cache_hit"] and hit.headers["Cache-Status"] == "qvpic; hit; detail=l1"
    assert answer(app, {"Cache-Control": "no-cache", "Pragma": "x"}, query=query, temperature=0.5).headers[
        "Cache-Status"] == "qvpic; fwd=bypass"  # sampled: never cacheable, whatever the request says


def test_no_cache_on_the_openai_route_and_streams(roles, serving_store, redis_url):
    app, _ = cache_app(roles, serving_store, redis_url, "memory")
    query = fresh_query()
    body = {"model": "qvpic", "messages": [{"role": "user", "content": query}], "max_tokens": 4, "temperature": 0,
            "qvpic": {"chunk_ids": ["invoices#00000"]}}
    first = call(app, "POST", "/v1/chat/completions", json=body).json()["qvpic"]
    again = call(app, "POST", "/v1/chat/completions", json=body).json()["qvpic"]
    computed = call(app, "POST", "/v1/chat/completions", json=body, headers={"Cache-Control": "no-cache"})
    assert not first["cache_hit"] and again["cache_hit"] and again["timings"]["prefill_ms"] is None
    assert not computed.json()["qvpic"]["cache_hit"] and computed.json()["qvpic"]["timings"]["prefill_ms"] > 0
    assert computed.headers["Cache-Status"] == "qvpic; fwd=request"
    streamed = call(app, "POST", "/v1/chat/completions", json={**body, "stream": True},
                    headers={"Cache-Control": "no-cache"})
    final = [json.loads(e) for e in sse_events(streamed.text) if e != "[DONE]"][-1]
    assert not final["qvpic"]["cache_hit"] and final["qvpic"]["timings"]["prefill_ms"] > 0


@pytest.mark.parametrize("headers, lookup, store", [
    ({}, True, True), ({"cache-control": "no-cache"}, False, True), ({"cache-control": "NO-STORE"}, True, False),
    ({"cache-control": 'max-age=0, no-store'}, False, False), ({"cache-control": "max-age=10"}, True, True),
    ({"pragma": "no-cache"}, False, True), ({"pragma": "no-cache", "cache-control": "max-age=5"}, True, True),
    ({"cache-control": " , private ,"}, True, True),
])
def test_cache_directives_follow_rfc_9111(headers, lookup, store):
    assert CacheDirectives.of(headers) == CacheDirectives(lookup=lookup, store=store)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampled_requests_are_never_cached(roles, serving_store, redis_url, backend):
    app, _ = cache_app(roles, serving_store, redis_url, backend)
    query = fresh_query()
    before = metric(app, "qvpic_response_cache_total", result="bypass")
    assert [level(ask(app, query=query, temperature=0.8)) for _ in range(2)] == [None, None]
    assert metric(app, "qvpic_response_cache_total", result="bypass") - before == 2
    seeded = [level(ask(app, query=query, temperature=0.8, seed=3)) for _ in range(2)]
    assert seeded == [None, "l1"]  # a seed makes sampling repeatable


@pytest.mark.parametrize("backend", BACKENDS)
def test_l3_answers_a_repeated_task_whatever_the_wording(roles, serving_store, redis_url, backend):
    task = f"shipping-{uuid.uuid4().hex[:8]}"
    app, _ = cache_app(roles, serving_store, redis_url, backend, levels=["l1", "l3"],
                       task_types={task: {"query_independent": True}, f"{task}-2": {"query_independent": True}})
    first = ask(app, query="Summarise the shipping dates.", task_type=task)
    reworded = ask(app, query="Which shipping dates are there?", headers={"X-Task-Type": task})
    assert level(first) is None and level(reworded) == "l3" and reworded["answer"] == first["answer"]
    assert level(ask(app, query="Which shipping dates are there?", task_type=f"{task}-2")) is None
    assert level(ask(app, query="Which shipping dates are there?", task_type=task, mode="image_pic")) is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_l2_semantic_needs_a_close_query_and_the_same_chunks(roles, serving_store, redis_url, backend):
    app, _ = cache_app(roles, serving_store, redis_url, backend, levels=["l2"], l2_threshold=0.9)
    first = ask(app, chunk_ids=["invoices#00000", "manual#00001"])
    close = ask(app, query="When will part XK-4471-B ship?", chunk_ids=["invoices#00000", "manual#00001"])
    assert level(first) is None and level(close) == "l2" and close["answer"] == first["answer"]
    assert 0.9 <= close["response_cache"]["similarity"] < 1.0
    assert level(ask(app, query="How long does the warranty last?",
                     chunk_ids=["invoices#00000", "manual#00001"])) is None
    assert level(ask(app, query="When will part XK-4471-B ship?", chunk_ids=["invoices#00000"])) is None


def test_fingerprint_change_invalidates_everything(roles, serving_store, redis_url):
    app, governor = cache_app(roles, serving_store, redis_url, "redis")
    query = fresh_query()
    ask(app, query=query)
    assert level(ask(app, query=query)) == "l1"
    # the same store recompiled for another model/template: the same Redis, another namespace
    settings = api_spec(AppConfig(store={"uri": serving_store.uri}, model=serving_store.model, router={"max_chunks": 4},
                                     ingress={"default_top_k": 2}))
    recompiled = settings.store.model_copy(update={"fingerprint": "0" * 64})
    other = Governor(governor.config, recompiled)
    other_app = make_api(InProcessBackend(roles.router, roles.loader, roles.generator), settings, other)
    assert other.cache.namespace != governor.cache.namespace
    assert level(ask(other_app, query=query)) is None


def test_redis_down_degrades_to_a_miss(roles, serving_store):
    server = start_redis()
    try:
        app, governor = governed_app(roles, serving_store, redis_url=server.url,
                                     response_cache={"backend": "redis", "levels": ["l1", "l2"]},
                                     limits={"backend": "redis", "default": {"requests_per_s": 100}})
        ask(app)
        assert level(ask(app)) == "l1"
    finally:
        server.stop()
    before = {use: metric(app, "qvpic_shared_state_errors_total", use=use) for use in ("response_cache", "rate_limits")}
    started = time.perf_counter()
    replies = [ask(app) for _ in range(3)]  # served, from the model, with replica-local rate limits
    assert [level(r) for r in replies] == [None] * 3 and len({r["answer"] for r in replies}) == 1
    assert time.perf_counter() - started < 5  # one connection timeout, then the breaker skips Redis
    assert all(metric(app, "qvpic_shared_state_errors_total", use=use) > before[use] for use in before)
    governor.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_expire_and_bound_entries(redis_url, backend):
    async def scenario() -> None:
        store = MemoryBackend(max_entries=3) if backend == "memory" else RedisBackend(RedisConnection(redis_url))
        a, b, c, d, m = (f"test:{uuid.uuid4().hex}:{name}" for name in "abcdm")
        await store.write([Put(a, b"A", ttl_s=0.2), Put(b, b"B", ttl_s=60)])
        for i in range(5):
            await store.write([Put(m, str(i).encode(), ttl_s=60, max_members=3)])
        assert await store.read([a, b, c], m) == ([b"A", b"B", None], [b"4", b"3", b"2"])  # newest first, trimmed
        await asyncio.sleep(0.3)
        assert await store.read([a, b], None) == ([None, b"B"], [])
        if backend == "memory":  # at most max_entries keys: the least recently used goes first
            await store.write([Put(c, b"C", ttl_s=60), Put(d, b"D", ttl_s=60)])
            assert await store.read([b, c, d], m) == ([b"B", b"C", b"D"], [])

    asyncio.run(scenario())


def test_unreachable_redis_raises_once_then_fails_fast():
    connection = RedisConnection("redis://127.0.0.1:1/0", timeout_s=0.2, retry_after_s=60)

    async def attempts() -> list[float]:
        elapsed = []
        for _ in range(3):
            started = time.perf_counter()
            with pytest.raises(SharedStateUnavailable):
                await connection.call("test", lambda client: client.get("k"))
            elapsed.append(time.perf_counter() - started)
        return elapsed

    _, *rest = asyncio.run(attempts())
    assert max(rest) < 0.01  # the breaker answers without touching the network


def test_levels_config_is_validated():
    args = ResponseCacheConfig(levels=["l1", "l2"], ttl_s={"l1": 5, "l2": 1})
    assert args.levels == {ResponseCacheLevel.L1, ResponseCacheLevel.L2}
    with pytest.raises(ValueError, match="positive ttl_s"):
        ResponseCacheConfig(levels=["l3"], ttl_s={"l1": 5})
    with pytest.raises(ValueError, match="per_tenant was removed"):  # an old config must not change meaning silently
        ResponseCacheConfig(per_tenant=True)


def test_a_redis_password_never_reaches_a_log_line_or_an_error(caplog):
    """Issue 37: the Redis URL, password included, was logged when Redis went down."""
    caplog.set_level(logging.DEBUG)
    connection = RedisConnection("redis://qvpic:hunter2@127.0.0.1:1/0", timeout_s=0.2, retry_after_s=60)
    messages = []
    for _ in range(2):  # the first attempt logs; the second is refused by the breaker, naming the server
        with pytest.raises(SharedStateUnavailable) as raised:
            asyncio.run(connection.call("test", lambda client: client.get("k")))
        messages.append(str(raised.value))
    logged = caplog.text
    assert "127.0.0.1:1" in logged and "127.0.0.1:1" in messages[1]  # still says which server
    assert "hunter2" not in logged + "".join(messages)
