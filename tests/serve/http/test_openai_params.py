"""docs/OPENAI.md's parameter tables are the contract: each row's example is sent to the live app (in-process roles)
and the answer must match the row — supported and ignored: 200; refused: OpenAI's 400 naming the parameter. Every
field of a request model must have a row in its route's table (chat, legacy completions, embeddings), so a parameter
cannot be added (or dropped) without the table."""

from __future__ import annotations

import inspect
import json
import re

import openai
import pytest

from schemas.chat import ChatCompletionRequest
from schemas.completions import CompletionRequest
from schemas.embeddings import EmbeddingRequest
from schemas.responses import ResponseRequest
from tests.serve.http.test_api import app, call  # noqa: F401  (a fixture)
from tests.support.paths import REPO
from tests.support.store_factory import roles, serving_store  # noqa: F401  (fixtures)

TABLE = REPO / "docs" / "OPENAI.md"
ROW = re.compile(r"^\| `(\w+)` \| (supported|ignored|refused) \| `(.+?)` \|")
BASE = {"model": "qvpic", "messages": [{"role": "user", "content": "When does part XK-4471-B ship?"}],
        "max_tokens": 2, "temperature": 0, "qvpic": {"chunk_ids": ["manual#00000"]}}
# route -> (its section's heading in docs/OPENAI.md, its request model, a valid request the rows change one field of)
ROUTES = {
    "/v1/chat/completions": (None, ChatCompletionRequest, BASE),
    "/v1/completions": ("## `POST /v1/completions`", CompletionRequest,
                        {"model": "qvpic", "prompt": "When does part XK-4471-B ship?", "max_tokens": 2,
                         "temperature": 0, "qvpic": {"chunk_ids": ["manual#00000"]}}),
    "/v1/embeddings": ("## `POST /v1/embeddings`", EmbeddingRequest, {"model": "qvpic", "input": "part XK-4471-B"}),
    "/v1/responses": ("## `POST /v1/responses`", ResponseRequest,
                      {"model": "qvpic", "input": "When does part XK-4471-B ship?", "max_output_tokens": 2,
                       "temperature": 0, "qvpic": {"chunk_ids": ["manual#00000"]}}),
}
OBJECTS = {"/v1/chat/completions": "chat.completion", "/v1/completions": "text_completion", "/v1/embeddings": "list",
           "/v1/responses": "response"}


def section(route: str) -> list[str]:
    """The lines of `route`'s section: chat's table sits before the first `## ` heading."""
    lines, heading = TABLE.read_text().splitlines(), ROUTES[route][0]
    start = 0 if heading is None else next(i for i, line in enumerate(lines) if line.startswith(heading)) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def rows(route: str = "/v1/chat/completions") -> list[tuple[str, str, object]]:
    found = [(m[1], m[2], json.loads(m[3])) for line in section(route) if (m := ROW.match(line))]
    assert len(found) >= len(ROUTES[route][1].model_fields) - 1, "the table did not parse"
    return found


@pytest.mark.parametrize("route", ROUTES)
def test_every_request_field_has_a_row(route):
    assert set(ROUTES[route][1].model_fields) <= {name for name, _, _ in rows(route)}


CASES = [(route, *row) for route in ROUTES for row in rows(route)]


@pytest.mark.parametrize("route, name, status, example", CASES, ids=lambda v: v if isinstance(v, str) else None)
def test_the_server_answers_as_the_table_says(app, route, name, status, example):
    # an example that is an object naming its own parameter carries the fields it needs beside it
    base = ROUTES[route][2]
    body = {**base, **(example if isinstance(example, dict) and name in example else {name: example})}
    if name == "stream":
        body["stream"] = False
    response = call(app, "POST", route, json=body, headers={"Cache-Control": "no-cache"})
    if status == "refused":
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == name and error["type"] == "invalid_request_error", error
    else:
        assert response.status_code == 200, response.text
        assert response.json()["object"] == OBJECTS[route]


def test_the_routes_beside_chat_answer_in_openais_shape(app):
    assert call(app, "GET", "/v1/models/qvpic").json()["id"] == "qvpic"
    missing = call(app, "GET", "/v1/models/gpt-9")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    for path, body in (("/v1/completions", {"prompt": "Hi"}), ("/v1/embeddings", {"input": "Hi"})):
        response = call(app, "POST", path, json={"model": "gpt-9", **body})
        assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("route, name, status, example", CASES, ids=lambda v: v if isinstance(v, str) else None)
def test_the_openai_client_sends_every_row(app, route, name, status, example):
    """The same rows through the openai SDK itself (what users run; vLLM's extras in `extra_body`): every supported and
    ignored parameter answers, every refused one raises `openai.BadRequestError` whose `param` names it."""
    import httpx

    client = openai.OpenAI(api_key="none", base_url="http://localhost/v1", max_retries=0,
                           http_client=httpx.Client(transport=SyncASGI(app)))
    base = ROUTES[route][2]
    body = {**base, **(example if isinstance(example, dict) and name in example else {name: example})}
    body["stream"] = False
    if route == "/v1/embeddings":
        body.pop("stream")
    create = {"/v1/chat/completions": client.chat.completions.create, "/v1/completions": client.completions.create,
              "/v1/embeddings": client.embeddings.create, "/v1/responses": client.responses.create}[route]
    # what the SDK has no argument for (the `qvpic` extension, vLLM's sampling extras) goes in extra_body, as vLLM's
    # docs send its extras
    known = set(inspect.signature(create).parameters)
    extension = {key: body.pop(key) for key in list(body) if key not in known}
    call_it = lambda: create(**body, extra_body=extension or None, extra_headers={"Cache-Control": "no-cache"})  # noqa: E731
    if status == "refused":
        with pytest.raises(openai.BadRequestError) as raised:
            call_it()
        assert raised.value.param == name and raised.value.code is not None
    else:
        assert call_it().object == OBJECTS[route]


def test_the_openai_client_reads_the_refusal_as_bad_request(app):
    """`except openai.BadRequestError` catches what the server refuses, with its param."""
    import httpx

    client = openai.OpenAI(api_key="none", base_url="http://localhost/v1",
                           http_client=httpx.Client(transport=SyncASGI(app)))
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="qvpic", messages=BASE["messages"], reasoning_effort="low")
    assert raised.value.param == "reasoning_effort"


class SyncASGI:
    """A sync httpx transport over the ASGI app (httpx's ASGITransport is async only)."""

    def __init__(self, app):
        import httpx

        self.transport = httpx.ASGITransport(app=app)

    def handle_request(self, request):
        import asyncio

        import httpx

        async def go():
            response = await self.transport.handle_async_request(request)
            content = await response.aread()
            return httpx.Response(response.status_code, headers=response.headers, content=content)
        return asyncio.run(go())

    def close(self):
        pass
