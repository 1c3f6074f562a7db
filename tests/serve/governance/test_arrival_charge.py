"""The request rate is charged when a request arrives, before its body is read (issue 60): a tenant past its rate
gets its 429 without the ingress reading, parsing or validating a byte of its body — a loop of 50 KB schema bombs
used to cost ~1.5 ms of the ingress loop each before its 429. Each request is charged once: the route's own charge is
the arrival's (a burst of 2 admits exactly 2), and a completions request of several prompts still pays per prompt.
The raw ASGI calls below record whether the app ever asked for the body."""

from __future__ import annotations

import asyncio
import json

import pytest

from serve.config import AppConfig
from serve.governance import key_digest
from tests.serve.governance.test_budget import governed_app
from tests.support.store_factory import roles, serving_store  # noqa: F401  (fixtures)

KEY = "key-arrival-1"


def nested_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


# a schema the route refuses (80 levels of nesting, past MAX_SCHEMA_DEPTH), in a body whose ~90 objects cost one
# request (a body's objects past 1,024 are charged as more requests: tests/serve/http/test_body_shape.py)
SCHEMA_BOMB = json.dumps({"model": "qvpic", "max_tokens": 2, "messages": [{"role": "user", "content": "pick"}],
                          "response_format": {"type": "json_schema", "json_schema": {
                              "name": "bomb", "schema": nested_schema(40)}}}).encode()
EMBED = json.dumps({"model": "qvpic", "input": ["hi"] * 64}).encode()


def asgi(app, method: str, path: str, body: bytes = b"", key: str | None = KEY) -> tuple[int, bool, dict]:
    return asyncio.run(asgi_call(app, method, path, body, key))


async def asgi_call(app, method: str, path: str, body: bytes = b"", key: str | None = KEY) -> tuple[int, bool, dict]:
    """`app` called as a server would call it: (status, whether the body was read, headers)."""
    read, sent = [], []

    async def receive() -> dict:
        if read:  # the body was sent: a connection that stays open (the next message would be a disconnect)
            await asyncio.Event().wait()
        read.append(True)
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    headers = [(b"host", b"localhost"), (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "query_string": b"", "headers": headers, "client": ("127.0.0.1", 5000),
             "server": ("localhost", 80), "scheme": "http", "root_path": ""}
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], bool(read), {k.decode().lower(): v.decode() for k, v in start["headers"]}


def limited_app(roles, serving_store, burst: int):  # noqa: F811
    return governed_app(roles, serving_store, auth={"api_key_sha256": {key_digest(KEY): "acme"}},
                        limits={"tenants": {"acme": {"requests_per_s": 0.01, "request_burst": burst}}},
                        response_cache={"levels": []})


@pytest.mark.parametrize("method,path,body", [
    ("POST", "/v1/chat/completions", SCHEMA_BOMB),
    ("POST", "/v1/embeddings", EMBED),
    ("POST", "/v1/answer", SCHEMA_BOMB),
    ("GET", "/v1/responses/resp_0123", b""),
])
def test_past_its_rate_a_tenant_is_refused_before_its_body_is_read(roles, serving_store, method, path,  # noqa: F811
                                                                     body):
    app, _ = limited_app(roles, serving_store, burst=2)
    answers = [asgi(app, method, path, body) for _ in range(4)]
    assert [status for status, _, _ in answers[2:]] == [429, 429]
    assert all(status != 429 for status, _, _ in answers[:2])  # a burst of 2 admits 2: no request charged twice
    assert [read for _, read, _ in answers[2:]] == [False, False]  # the 429s never asked for the body
    assert answers[2][2]["retry-after"].isdigit()


def test_a_body_the_route_refuses_is_charged_and_the_key_checked_first(roles, serving_store):  # noqa: F811
    app, _ = limited_app(roles, serving_store, burst=1)
    assert asgi(app, "POST", "/v1/chat/completions", SCHEMA_BOMB, key=None)[:2] == (401, False)  # no key: no charge
    assert asgi(app, "POST", "/v1/chat/completions", SCHEMA_BOMB)[:2] == (400, True)  # the bomb, read and refused
    assert asgi(app, "POST", "/v1/chat/completions", SCHEMA_BOMB)[:2] == (429, False)  # and it was charged


def test_each_prompt_after_the_first_is_charged_by_its_route(roles, serving_store):  # noqa: F811
    app, _ = limited_app(roles, serving_store, burst=3)
    two = json.dumps({"model": "qvpic", "prompt": ["When does part XK-4471-B ship?", "Which part ships?"],
                      "max_tokens": 2, "qvpic": {"chunk_ids": ["invoices#00000"]}}).encode()
    assert asgi(app, "POST", "/v1/completions", two)[0] == 200  # 2 of the burst of 3
    assert asgi(app, "POST", "/v1/completions", two)[0] == 429  # 1 left: the second prompt's charge is refused
    assert asgi(app, "POST", "/v1/embeddings", EMBED)[:2] == (429, False)


def test_a_tenant_in_token_debt_is_refused_before_its_body_is_read(roles, serving_store):  # noqa: F811
    """A full token bucket admits one request dearer than itself, the rest debt (64 inputs of 2 characters: 256
    tokens charged against a bucket of 100); until the debt is paid nothing the tenant asks could be paid for, so
    its next requests are refused on arrival, their bodies unread. Its request rate is not what refuses them."""
    app, _ = governed_app(roles, serving_store, auth={"api_key_sha256": {key_digest(KEY): "acme"}},
                          limits={"tenants": {"acme": {"tokens_per_s": 1.0, "token_burst": 100}}},
                          response_cache={"levels": []})
    assert asgi(app, "POST", "/v1/embeddings", EMBED)[:2] == (200, True)
    status, read, headers = asgi(app, "POST", "/v1/chat/completions", SCHEMA_BOMB)
    assert (status, read) == (429, False) and int(headers["retry-after"]) >= 256 - 100
    assert asgi(app, "POST", "/v1/embeddings", EMBED)[:2] == (429, False)
    assert asgi(app, "GET", "/v1/responses/resp_0123")[0] == 404  # spends no tokens: not refused for them


def test_refusals_are_held_for_their_wait_and_only_so_many_at_once(roles, serving_store):  # noqa: F811
    """A client that ignores Retry-After would loop its 429s as fast as the server answers them (each still a body
    the server receives); a refusal is held for its wait, at most `refusal_hold_s`, and at most
    `max_held_refusals` of a tenant's at once (beyond, answered at once: held refusals take bounded room). The
    hold is recorded, not timed: the governor's sleep is replaced by one that waits for the test."""
    app, governor = governed_app(roles, serving_store, auth={"api_key_sha256": {key_digest(KEY): "acme"}},
                                 limits={"tenants": {"acme": {"requests_per_s": 0.01, "request_burst": 1}},
                                         "refusal_hold_s": 0.5, "max_held_refusals": 1},
                                 response_cache={"levels": []})
    path = "/v1/responses/resp_0123"
    held: list[float] = []

    async def scenario() -> tuple[int, int, int]:
        release = asyncio.Event()

        async def sleep(seconds: float) -> None:
            held.append(seconds)
            await release.wait()

        governor.sleep = sleep
        admitted = (await asgi_call(app, "GET", path))[0]  # the burst of 1
        first = asyncio.create_task(asgi_call(app, "GET", path))
        while not held:
            await asyncio.sleep(0.01)
        second = await asyncio.wait_for(asgi_call(app, "GET", path), 10)  # one is held already: at once
        assert not first.done()  # still held
        release.set()
        return admitted, (await first)[0], second[0]

    assert asyncio.run(scenario()) == (404, 429, 429)
    assert held == [0.5]  # min(the wait of ~100 s, refusal_hold_s); the second was not held
    assert governor.held == {}


def test_every_tenant_s_held_refusals_together_take_at_most_max_held_refusals_total(roles, serving_store):  # noqa: F811
    """Held refusals take ingress slots (16 by default): many keys each holding its own `max_held_refusals` would
    fill a replica. Three tenants past their rates, two refusals each, `max_held_refusals` 2 and
    `max_held_refusals_total` 3: three are held, the other three answered at once. Mutation: the total not checked in
    `Governor._hold` → all six held."""
    keys = {f"key-held-{i}": f"tenant{i}" for i in range(3)}
    digests = {key_digest(key): tenant for key, tenant in keys.items()}
    app, governor = governed_app(roles, serving_store, auth={"api_key_sha256": digests},
                                 limits={"default": {"requests_per_s": 0.01, "request_burst": 1},
                                         "refusal_hold_s": 0.5, "max_held_refusals": 2,
                                         "max_held_refusals_total": 3},
                                 response_cache={"levels": []})
    path = "/v1/responses/resp_0123"
    held: list[float] = []

    async def scenario() -> list[int]:
        release = asyncio.Event()

        async def sleep(seconds: float) -> None:
            held.append(seconds)
            await release.wait()

        governor.sleep = sleep
        for key in keys:  # each tenant's burst of 1
            assert (await asgi_call(app, "GET", path, key=key))[0] == 404
        refused = [asyncio.create_task(asgi_call(app, "GET", path, key=key)) for key in keys for _ in range(2)]
        await asyncio.sleep(0.2)
        answered_at_once = sum(task.done() for task in refused)
        release.set()
        assert {(await task)[0] for task in refused} == {429}
        return [answered_at_once, len(held)]

    assert asyncio.run(scenario()) == [3, 3]
    assert governor.held == {}


def test_held_refusals_must_leave_the_ingress_a_slot():
    """`max_held_refusals_total` at or above the ingress's `max_ongoing_requests` is refused where the config is
    read, naming both."""
    def app_config(total: int) -> AppConfig:
        return AppConfig(store={"uri": "/nonexistent/store"},
                         ingress={"governance": {"limits": {"max_held_refusals_total": total}}})

    with pytest.raises(ValueError, match="max_held_refusals_total 16 must be below ingress_deployment.max_ongoing"):
        app_config(16)
    assert app_config(15).ingress_deployment.max_ongoing_requests == 16
