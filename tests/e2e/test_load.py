"""A bounded load through the whole Serve graph: mixed modes, streamed and repeated requests at a fixed
concurrency, zero errors, and memory that stays bounded (the loader's LRU holds its byte cap while it
evicts; no replica's private heap grows much). The full-size run is `python -m benchmarks.scale.load`."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from benchmarks.scale.load import DEPLOYMENTS, replica_rss_nbytes, request_mix, run_load
from schemas.modes import Mode
from tests.support.ray_fixtures import free_port, ray_session  # noqa: F401  (pytest fixture)
from tests.support.store_factory import DOCUMENTS, MAX_CHUNKS, serving_store  # noqa: F401  (pytest fixture)

pytestmark = pytest.mark.e2e
APP_NAME = "qvpic-load-test"
NUM_REQUESTS, CONCURRENCY = 60, 8
LRU_MAX_NBYTES = 96 << 10  # below the store's ~300 KB of KV, so the loader must evict to hold it
PRIVATE_GROWTH_LIMIT_NBYTES = 256 << 20  # per deployment, after a warm-up: generous; a leak of KV would pass it


@pytest.fixture(scope="module")
def base_url(ray_session, serving_store):
    from ray import serve

    from serve.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port},
                logging_config={"log_level": "WARNING", "enable_access_log": False})
    args = {"store": {"uri": serving_store.uri}, "model": serving_store.model.model_dump(mode="json"),
            "router": {"max_chunks": MAX_CHUNKS}, "ingress": {"default_top_k": 2},
            "loader": {"max_nbytes": LRU_MAX_NBYTES},
            "loader_placement": "deployment",  # the CacheLoader deployment's LRU and memory are what this bounds
            # no device hot tier: it would hold the whole store after the warm-up, and the loader's LRU,
            # what this test bounds, would then see repeats only when two requests race for an entry
            "generator": {"engine": {"hot_tier_nbytes": 0}}}
    serve.run(build_app(args), name=APP_NAME, route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def test_bounded_load_has_no_errors_and_bounded_memory(base_url):
    # the first request of a new app: its replicas warm up on a busy 2-core box, past httpx's 5 s default
    modes = [Mode(m) for m in httpx.get(f"{base_url}/v1/store", timeout=120).json()["modes"]]
    assert set(modes) == set(Mode)
    asyncio.run(run_load(base_url, request_mix(16, list(DOCUMENTS), modes, seed=1), CONCURRENCY))  # warm-up
    before = replica_rss_nbytes(APP_NAME, "RssAnon")  # private heaps: shared object-store pages are bounded apart
    result = asyncio.run(run_load(base_url, request_mix(NUM_REQUESTS, list(DOCUMENTS), modes), CONCURRENCY))
    after = replica_rss_nbytes(APP_NAME, "RssAnon")
    cache = httpx.get(f"{base_url}/v1/store", timeout=60).json()["cache"]
    growth_mib = {name: round((after[name] - before[name]) / 2**20, 1) for name in DEPLOYMENTS}
    print(f"load: p50 {result.percentile_ms(50):.0f} ms, p99 {result.percentile_ms(99):.0f} ms, "
          f"{result.throughput_rps:.1f} req/s, {dict(result.statuses)}, LRU {cache}, private growth MiB {growth_mib}")
    assert result.statuses == {200: NUM_REQUESTS}, result.errors
    assert result.response_cache_hits > 0  # the mix repeats requests verbatim
    assert cache["max_nbytes"] == LRU_MAX_NBYTES and cache["nbytes"] <= LRU_MAX_NBYTES
    assert cache["evictions"] > 0 and cache["hits"] > 0
    assert all(before[name] > 0 for name in DEPLOYMENTS), before  # every replica's process was found
    assert all(after[name] - before[name] < PRIVATE_GROWTH_LIMIT_NBYTES for name in DEPLOYMENTS), growth_mib
