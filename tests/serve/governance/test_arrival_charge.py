"""The request rate is charged when a request arrives, before its body is read (issue 60): a tenant past its rate
gets its 429 without the ingress reading, parsing or validating a byte of its body — a loop of 50 KB schema bombs
used to cost ~1.5 ms of the ingress loop each before its 429. Each request is charged once: the route's own charge is
the arrival's (a burst of 2 admits exactly 2), and a completions request of several prompts still pays per prompt.
The raw ASGI calls below record whether the app ever asked for the body."""

from __future__ import annotations

import asyncio
import json

import pytest

from serve.governance import key_digest
from tests.serve.governance.test_budget import governed_app
from tests.support.store_factory import roles, serving_store  # noqa: F401  (fixtures)

KEY = "key-arrival-1"
SCHEMA_BOMB = json.dumps({"model": "qvpic", "max_tokens": 2, "messages": [{"role": "user", "content": "pick"}],
                          "response_format": {"type": "json_schema", "json_schema": {
                              "name": "bomb", "schema": {"anyOf": [{"const": i} for i in range(3_000)]}}}}).encode()
EMBED = json.dumps({"model": "qvpic", "input": ["hi"] * 64}).encode()


def asgi(app, method: str, path: str, body: bytes = b"", key: str | None = KEY) -> tuple[int, bool, dict]:
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
    asyncio.run(app(scope, receive, send))
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
