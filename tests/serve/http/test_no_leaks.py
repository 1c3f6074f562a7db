"""No leaks in answers: an internal failure reaches the client as "internal error" plus a request id (the
detail — paths, secrets, a traceback — only in the server log under that id), plainly and mid-stream on both
surfaces; a validation error names the field and its limit and never echoes the input."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import httpx
import pytest

from serve.app import api_spec
from serve.config import AppConfig
from serve.governance import Governor
from serve.http import make_api
from serve.local import InProcessBackend
from tests.support.store_factory import MAX_CHUNKS, roles, serving_store  # noqa: F401  (fixtures)

SECRET = "/srv/qvpic/store/gen-7/shard-0003.safetensors redis://:hunter2@redis.internal:6379/0"
INTERNAL = re.compile(r"internal error \(request id ([0-9a-f]{32}): the server log has the detail\)")
QUESTION = {"query": "When does part XK-4471-B ship?", "chunk_ids": ["manual#00000"]}


@pytest.fixture(scope="module")
def app(roles, serving_store):
    class Crashing(InProcessBackend):  # a bug deep in a deployment, its message full of internals
        async def generate(self, plan, loaded, sampling):
            raise RuntimeError(SECRET)

        async def stream(self, plan, sampling, timeout_s=None):
            raise RuntimeError(SECRET)
            yield  # an async generator

    args = AppConfig(store={"uri": serving_store.uri}, model=serving_store.model, router={"max_chunks": MAX_CHUNKS},
                     ingress={"default_top_k": 2})
    settings = api_spec(args)
    return make_api(Crashing(roles.router, roles.loader, roles.generator), settings,
                    Governor(args.ingress.governance, settings.store))


def post(app, path: str, body: dict) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            return await client.post(path, json=body)
    return asyncio.run(go())


def logged_with(caplog, request_id: str) -> str:
    """Everything the server logged on the line naming `request_id`, its traceback included."""
    lines = [r for r in caplog.records if request_id in r.getMessage()]
    assert lines, f"no log line names request id {request_id}"
    return "\n".join(r.getMessage() + (logging.Formatter().formatException(r.exc_info) if r.exc_info else "")
                     for r in lines)


@pytest.mark.parametrize("path, body", [
    ("/v1/answer", QUESTION),
    ("/v1/chat/completions", {"model": "qvpic", "messages": [{"role": "user", "content": QUESTION["query"]}],
                              "qvpic": {"chunk_ids": QUESTION["chunk_ids"]}}),
])
def test_an_internal_error_says_internal_error_and_a_request_id(app, path, body, caplog):
    caplog.set_level(logging.ERROR)
    response = post(app, path, body)
    assert response.status_code == 500
    assert "hunter2" not in response.text and "/srv/qvpic" not in response.text
    request_id = INTERNAL.search(response.text).group(1)
    assert response.headers["X-Request-Id"] == request_id  # the same id as the request log's record
    assert "hunter2" in logged_with(caplog, request_id)  # the operator still has the detail


@pytest.mark.parametrize("path, body", [
    ("/v1/answer", {**QUESTION, "stream": True}),
    ("/v1/chat/completions", {"model": "qvpic", "messages": [{"role": "user", "content": QUESTION["query"]}],
                              "qvpic": {"chunk_ids": QUESTION["chunk_ids"]}, "stream": True}),
])
def test_a_stream_error_event_says_internal_error_and_the_streams_request_id(app, path, body, caplog):
    caplog.set_level(logging.ERROR)
    response = post(app, path, body)
    assert response.status_code == 200
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    parsed = [json.loads(e) for e in events if e != "[DONE]"]
    errors = [e for e in parsed if "error" in e or e.get("type") == "error"]
    assert errors, response.text
    assert "hunter2" not in response.text and "/srv/qvpic" not in response.text
    request_id = INTERNAL.search(json.dumps(errors)).group(1)
    assert response.headers["X-Request-Id"] == request_id
    assert "hunter2" in logged_with(caplog, request_id)


def test_a_validation_error_names_the_field_and_limit_without_echoing_the_input(app):
    marker = "ECHO-ME-" * 12_500  # 100,000 characters, over the query's limit
    response = post(app, "/v1/answer", {"query": marker})
    assert response.status_code == 422
    assert "ECHO-ME" not in response.text and len(response.content) < 1_000
    (error,) = response.json()["detail"]
    assert error["loc"] == ["body", "query"] and "at most" in error["msg"] and error["ctx"]["max_length"] > 0
    openai = post(app, "/v1/chat/completions", {"model": "qvpic", "messages": [{"role": "user", "content": marker}],
                                                "temperature": marker})
    assert openai.status_code == 400 and "ECHO-ME" not in openai.text and len(openai.content) < 1_000
