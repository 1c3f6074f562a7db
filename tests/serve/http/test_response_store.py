"""The stored `/v1/responses` answers' bounds (serve/http/openai/response_store.py): per tenant in count and bytes
(the oldest go first), in tenants (the least recently used go first), in time (a clock the test moves), and a
tenant's ids never found under another's."""

from __future__ import annotations

import json

from serve.config import ResponseStoreConfig
from serve.http.openai.response_store import ResponseStore


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def body(size: int = 0) -> dict:
    return {"text": "x" * size}


def test_a_tenants_ids_are_its_own():
    store = ResponseStore(ResponseStoreConfig())
    store.put("acme", "resp_1", body(), [])
    assert store.get("globex", "resp_1") is None and not store.delete("globex", "resp_1")
    assert store.get("acme", "resp_1").body == body()  # control: found under its own tenant, after their delete
    assert store.delete("acme", "resp_1") and store.get("acme", "resp_1") is None


def test_count_per_tenant_is_bounded_oldest_first():
    store = ResponseStore(ResponseStoreConfig(max_responses_per_tenant=3))
    for i in range(5):
        store.put("acme", f"resp_{i}", body(), [])
    store.put("globex", "resp_g", body(), [])
    assert [i for i in range(5) if store.get("acme", f"resp_{i}")] == [2, 3, 4]
    assert store.get("globex", "resp_g") is not None  # another tenant's count is its own


def test_bytes_per_tenant_are_bounded():
    one = len(json.dumps(body(400))) + len(json.dumps([]))
    store = ResponseStore(ResponseStoreConfig(max_bytes_per_tenant=1024))
    for i in range(4):
        assert store.put("acme", f"resp_{i}", body(400), [])
    kept = [i for i in range(4) if store.get("acme", f"resp_{i}")]
    assert kept == [2, 3] and store.tenants["acme"].nbytes == 2 * one <= 1024
    assert not store.put("acme", "huge", body(2000), [])  # alone over the bound: not kept, nothing evicted for it
    assert store.get("acme", "huge") is None and store.get("acme", "resp_3") is not None


def test_responses_expire():
    clock = Clock()
    store = ResponseStore(ResponseStoreConfig(ttl_s=60), clock)
    store.put("acme", "resp_1", body(), [])
    clock.now = 59.0
    assert store.get("acme", "resp_1") is not None
    clock.now = 60.0
    assert store.get("acme", "resp_1") is None and store.tenants["acme"].nbytes == 0


def test_tenants_are_bounded_least_recently_used_first():
    store = ResponseStore(ResponseStoreConfig(max_tenants=2))
    store.put("a", "resp_a", body(), [])
    store.put("b", "resp_b", body(), [])
    assert store.get("a", "resp_a") is not None  # a is now the more recently used
    store.put("c", "resp_c", body(), [])
    assert set(store.tenants) == {"a", "c"} and store.get("b", "resp_b") is None
