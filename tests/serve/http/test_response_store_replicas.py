"""`/v1/responses`' stored responses across ingress replicas (issue 61): two apps, each with its own Governor and
Redis connection (two replicas), sharing one real redis-server with `responses.backend: redis`. A response stored
through one is continued (`previous_response_id`), read and deleted through the other; under another tenant it is
a 404; it expires, and the tenant's count and byte bounds hold. The control of each: the same calls on two
memory-store replicas, which do not share."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from fastapi import FastAPI

from serve.app import api_spec
from serve.config import AppConfig
from serve.governance import Governor, key_digest
from serve.http import make_api
from serve.local import InProcessBackend
from tests.serve.http.test_api import call, sse_events
from tests.support.fixtures_redis import redis_url, start_redis  # noqa: F401  (fixture)
from tests.support.store_factory import MAX_CHUNKS, roles, serving_store  # noqa: F401  (fixtures)

KEYS = {"acme": "key-acme-1", "globex": "key-globex-1"}
QUESTION = "When does part XK-4471-B ship?"
BOUND = 6000  # bytes: a plain response is well under it, one with 8 KB of metadata over it


def replica(roles, serving_store, redis_url: str, **responses) -> tuple[FastAPI, Governor]:
    """One ingress replica's app: its own Governor (so its own Redis connection) and response store."""
    governance = {"redis_url": redis_url, "response_cache": {"levels": []},
                  "auth": {"api_key_sha256": {key_digest(k): t for t, k in KEYS.items()}}}
    args = AppConfig(store={"uri": serving_store.uri}, model=serving_store.model, router={"max_chunks": MAX_CHUNKS},
                     ingress={"default_top_k": 2, "governance": governance, "responses": responses})
    settings = api_spec(args)
    governor = Governor(args.ingress.governance, settings.store)
    backend = InProcessBackend(roles.router, roles.loader, roles.generator)
    return make_api(backend, settings, governor, args.ingress), governor


def replicas(roles, serving_store, redis_url: str, backend: str, **responses) -> list[FastAPI]:
    return [replica(roles, serving_store, redis_url, backend=backend, **responses)[0] for _ in range(2)]


def send(app, method: str, path: str, tenant: str = "acme", **kwargs) -> httpx.Response:
    return call(app, method, path, headers={"Authorization": f"Bearer {KEYS[tenant]}"}, **kwargs)


def create(app, tenant: str = "acme", **fields) -> httpx.Response:
    body = {"model": "qvpic", "input": QUESTION, "max_output_tokens": 4, "temperature": 0,
            "qvpic": {"chunk_ids": ["manual#00000"]}, **fields}
    return send(app, "POST", "/v1/responses", tenant, json=body)


def created(app, tenant: str = "acme", **fields) -> dict:
    response = create(app, tenant, **fields)
    assert response.status_code == 200, response.text
    return response.json()


def text(response: dict) -> str:
    return response["output"][0]["content"][0]["text"]


def chat_prompt_tokens(app, messages: list[dict]) -> int:
    """The prompt of the same conversation sent as chat messages, which the chat route renders."""
    body = {"model": "qvpic", "messages": messages, "max_tokens": 1, "qvpic": {"chunk_ids": ["manual#00000"]}}
    response = send(app, "POST", "/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens"]


def found(app, response_id: str, tenant: str = "acme") -> int:
    return send(app, "GET", f"/v1/responses/{response_id}", tenant).status_code


@pytest.mark.parametrize("backend", ["redis", "memory"])
def test_a_response_stored_on_one_replica_is_continued_read_and_deleted_on_another(roles, serving_store, redis_url,
                                                                                  backend):
    one, two = replicas(roles, serving_store, redis_url, backend)
    first = created(one)
    streamed = create(one, stream=True)
    final = json.loads(sse_events(streamed.text)[-1])
    assert final["type"] in ("response.completed", "response.incomplete")  # incomplete: max_output_tokens
    if backend == "memory":  # control: each replica's own memory; the other has never heard of it
        assert found(two, first["id"]) == found(two, final["response"]["id"]) == 404
        assert create(two, previous_response_id=first["id"], input="And the invoice?").status_code == 404
        assert found(one, first["id"]) == 200
        return
    follow = created(two, previous_response_id=first["id"], input="And the invoice?")
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": text(first)},
                {"role": "user", "content": "And the invoice?"}]
    assert follow["previous_response_id"] == first["id"]
    assert follow["usage"]["input_tokens"] == chat_prompt_tokens(one, messages)  # the first turn and its answer read
    got = send(two, "GET", f"/v1/responses/{first['id']}")
    assert got.status_code == 200 and got.json()["output"] == first["output"] and got.json()["id"] == first["id"]
    assert send(two, "GET", f"/v1/responses/{final['response']['id']}").json()["output"] == final["response"]["output"]
    assert found(one, follow["id"]) == 200  # and back: what the second stored, the first reads
    assert send(two, "DELETE", f"/v1/responses/{first['id']}").json()["deleted"] is True
    assert found(one, first["id"]) == found(two, first["id"]) == 404  # deleted for every replica
    assert create(one, previous_response_id=first["id"]).status_code == 404


def test_another_tenants_id_is_a_404_like_an_unknown_one(roles, serving_store, redis_url):
    one, two = replicas(roles, serving_store, redis_url, "redis")
    mine = created(one)["id"]
    theirs = [send(two, method, f"/v1/responses/{mine}", "globex") for method in ("GET", "DELETE")]
    theirs.append(create(two, "globex", previous_response_id=mine))
    unknown = send(two, "GET", "/v1/responses/resp_0000", "globex")
    assert [r.status_code for r in theirs] == [404] * 3
    assert theirs[0].json()["error"]["message"].replace(mine, "X") == unknown.json()["error"]["message"].replace(
        "resp_0000", "X")  # the same words as an id that never existed
    assert found(two, mine) == 200  # control: its own tenant reads it, their DELETE removed nothing


def test_stored_responses_expire_on_every_replica(roles, serving_store, redis_url):
    import time

    one, two = replicas(roles, serving_store, redis_url, "redis", ttl_s=1.0)
    stored = created(one)["id"]
    assert found(two, stored) == 200  # control: there before its TTL
    time.sleep(1.2)
    assert found(two, stored) == found(one, stored) == 404


def test_the_count_bound_trims_the_oldest_across_replicas(roles, serving_store, redis_url):
    one, two = replicas(roles, serving_store, redis_url, "redis", max_responses_per_tenant=2)
    ids = [created(app)["id"] for app in (one, two, one)]  # the replicas take turns storing
    assert [found(two, i) for i in ids] == [404, 200, 200]
    assert found(one, created(two, "globex")["id"], "globex") == 200 and found(one, ids[2]) == 200  # its own count


def test_a_response_over_the_byte_bound_is_answered_not_stored(roles, serving_store, redis_url, caplog):
    one, two = replicas(roles, serving_store, redis_url, "redis", max_bytes_per_tenant=BOUND)
    small = created(one)
    assert len(json.dumps(send(two, "GET", f"/v1/responses/{small['id']}").json())) < BOUND / 2
    with caplog.at_level(logging.WARNING, logger="serve.http.openai.response_store"):
        large = created(one, metadata={f"k{i}": "x" * 500 for i in range(16)})  # its body alone is over BOUND
    assert large["output"] and found(two, large["id"]) == 404
    assert "over max_bytes_per_tenant" in caplog.text and large["id"] in caplog.text
    assert found(two, small["id"]) == 200  # control: one under the bound is kept, and the large one evicted nothing


def test_redis_down_still_answers_and_later_lookups_are_not_500s(roles, serving_store, caplog):
    server = start_redis()
    try:
        app, governor = replica(roles, serving_store, server.url, backend="redis")
        governor.redis.retry_after_s = 0.2  # the breaker's pause, short so that the test sees Redis come back
        before = created(app)["id"]
        assert found(app, before) == 200  # control: stored while Redis is up
    finally:
        server.stop()
    with caplog.at_level(logging.WARNING, logger="serve.http.openai.response_store_redis"):
        during = created(app)
    assert text(during)  # the answer, whole
    assert "not stored: redis unavailable" in caplog.text and during["id"] in caplog.text
    for lookup in (send(app, "GET", f"/v1/responses/{before}"), create(app, previous_response_id=before)):
        assert lookup.status_code == 503 and "Retry-After" in lookup.headers, lookup.text  # unknown, not gone
    server = start_redis(server.port)  # back, empty (nothing persisted)
    try:
        import time

        time.sleep(0.3)  # past the breaker's pause
        lookup = create(app, previous_response_id=during["id"])
        assert lookup.status_code == 404 and during["id"] in lookup.json()["error"]["message"]
        assert created(app)["id"]  # and storing works again
    finally:
        server.stop()
        governor.close()
