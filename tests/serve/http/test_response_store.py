"""The stored `/v1/responses` answers' bounds, on both stores (serve/http/openai/response_store.py and
response_store_redis.py, the latter on a real redis-server): per tenant in count and bytes (the oldest go first),
in tenants (the least recently used go first), in time, and a tenant's ids never found under another's.

Each Redis test writes under its own key prefix, so the session's shared server holds no other test's keys."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest
from pydantic import ValidationError

from serve.config import IngressConfig, ResponseStoreConfig
from serve.governance.config import StateBackend
from serve.governance.shared_state import RedisConnection
from serve.http.openai.response_store import MemoryResponseStore
from serve.http.openai.response_store_redis import RedisResponseStore
from tests.support.fixtures_redis import redis_url  # noqa: F401  (fixture)

BACKENDS = ["memory", "redis"]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def body(size: int = 0) -> dict:
    return {"text": "x" * size}


def run(awaitable):
    return asyncio.run(awaitable)


@pytest.fixture(params=BACKENDS)
def make(request, redis_url):
    """`make(**config)`: a store of the test's backend."""
    connections = []

    def store(clock=None, **config):
        config = ResponseStoreConfig(**config)
        if request.param == "memory":
            return MemoryResponseStore(config, *([clock] if clock else []))
        connections.append(RedisConnection(redis_url))
        return RedisResponseStore(config, connections[-1], prefix=f"test:rs:{uuid.uuid4().hex}")

    yield store
    for connection in connections:
        connection.close()


def kept(store, tenant: str, ids) -> list:
    return [i for i in ids if run(store.get(tenant, f"resp_{i}")) is not None]


def test_a_tenants_ids_are_its_own(make):
    store = make()
    run(store.put("acme", "resp_1", body(), []))
    assert run(store.get("globex", "resp_1")) is None and not run(store.delete("globex", "resp_1"))
    assert run(store.get("acme", "resp_1")).body == body()  # control: found under its own tenant, after their delete
    assert run(store.delete("acme", "resp_1")) and run(store.get("acme", "resp_1")) is None
    assert not run(store.delete("acme", "resp_1"))  # gone: a second delete finds nothing


def test_count_per_tenant_is_bounded_oldest_first(make):
    store = make(max_responses_per_tenant=3)
    for i in range(5):
        run(store.put("acme", f"resp_{i}", body(), [{"role": "user", "content": str(i)}]))
    run(store.put("globex", "resp_g", body(), []))
    assert kept(store, "acme", range(5)) == [2, 3, 4]
    assert run(store.get("acme", "resp_4")).history == [{"role": "user", "content": "4"}]
    assert run(store.get("globex", "resp_g")) is not None  # another tenant's count is its own


def test_bytes_per_tenant_are_bounded(make):
    one = len(json.dumps(body(400))) + len(json.dumps([]))
    store = make(max_bytes_per_tenant=1024)
    for i in range(4):
        assert run(store.put("acme", f"resp_{i}", body(400), []))
    assert kept(store, "acme", range(4)) == [2, 3] and 2 * one <= 1024 < 3 * one
    if isinstance(store, MemoryResponseStore):
        assert store.tenants["acme"].nbytes == 2 * one
    assert not run(store.put("acme", "huge", body(2000), []))  # alone over the bound: not kept, nothing evicted for it
    assert run(store.get("acme", "huge")) is None and run(store.get("acme", "resp_3")) is not None


def test_responses_expire(make):
    clock = Clock()
    store = make(clock=clock, ttl_s=0.5)
    run(store.put("acme", "resp_1", body(), []))
    if isinstance(store, MemoryResponseStore):
        clock.now = 0.45
    assert run(store.get("acme", "resp_1")) is not None  # control: still there before its TTL
    if isinstance(store, MemoryResponseStore):
        clock.now = 0.5
    else:
        time.sleep(0.6)  # Redis's own clock (PX)
    assert run(store.get("acme", "resp_1")) is None
    if isinstance(store, MemoryResponseStore):
        assert store.tenants["acme"].nbytes == 0


def test_tenants_are_bounded_least_recently_used_first(make):
    store = make(max_tenants=2)
    run(store.put("a", "resp_a", body(), []))
    time.sleep(0.002)  # Redis orders tenants by its clock in milliseconds
    run(store.put("b", "resp_b", body(), []))
    time.sleep(0.002)
    assert run(store.get("a", "resp_a")) is not None  # a is now the more recently used
    time.sleep(0.002)
    run(store.put("c", "resp_c", body(), []))
    assert run(store.get("b", "resp_b")) is None
    assert run(store.get("a", "resp_a")) is not None and run(store.get("c", "resp_c")) is not None


def test_a_redis_store_needs_the_governances_redis_url():
    with pytest.raises(ValidationError, match="governance.redis_url is not set"):
        IngressConfig(responses={"backend": "redis"})
    shared = IngressConfig(responses={"backend": "redis"}, governance={"redis_url": "redis://127.0.0.1:1/0"})
    assert shared.responses.backend is StateBackend.REDIS and IngressConfig().responses.backend is StateBackend.MEMORY
