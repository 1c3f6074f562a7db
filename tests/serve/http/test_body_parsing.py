"""A large request body is parsed and validated on a worker, not the ingress's event loop (serve/http/parsing.py,
issue 60 item 1), and answered exactly as FastAPI answers it. Counted, not timed: which thread ran the work. The apps
run in this test's event loop (httpx's ASGI transport), so the loop's thread is the one that calls `asyncio.run`.
The reference for every answer is FastAPI's own route (`APIRoute`) on the same body."""

from __future__ import annotations

import asyncio
import json
import os
import threading

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, field_validator

import serve.http.body_shape
from serve.http.body_shape import BodyShapeLimit
from serve.http.parsing import INLINE_BODY_NBYTES, WorkerParsedRoute
from tests.serve.http.test_api import app, call  # noqa: F401  (a fixture)
from tests.support.store_factory import roles, serving_store  # noqa: F401  (fixtures)

VALIDATED_ON: list[int] = []  # the threads that ran Probe's field validator
NICENESS: list[int] = []  # and their niceness


class Probe(BaseModel):
    name: str
    items: list[int]

    @field_validator("items")
    @classmethod
    def _record(cls, items: list[int]) -> list[int]:
        VALIDATED_ON.append(threading.get_ident())
        NICENESS.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return items


def probe_app(route_class: type[APIRoute]) -> FastAPI:
    probe = FastAPI()
    probe.router.route_class = route_class

    @probe.post("/probe")
    async def answer(body: Probe) -> dict:
        return {"name": body.name, "count": len(body.items), "sum": sum(body.items)}

    return probe


def post(target: FastAPI, content: bytes, content_type: str | None = "application/json") -> httpx.Response:
    headers = {} if content_type is None else {"content-type": content_type}

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=target), base_url="http://x") as client:
            return await client.post("/probe", content=content, headers=headers)
    return asyncio.run(go())


LARGE = json.dumps({"name": "large", "items": list(range(20_000))}).encode()  # ~117 KB
SMALL = json.dumps({"name": "small", "items": [1, 2, 3]}).encode()


def test_a_large_body_is_validated_on_a_worker_and_a_small_one_inline():
    """FastAPI's route (the control, asserted too) validates every body on the loop's thread."""
    assert len(LARGE) > INLINE_BODY_NBYTES > len(SMALL)
    loop_thread = threading.get_ident()
    for route_class, large_on_loop in ((WorkerParsedRoute, False), (APIRoute, True)):
        for body, on_loop in ((LARGE, large_on_loop), (SMALL, True)):
            VALIDATED_ON.clear()
            response = post(probe_app(route_class), body)
            assert response.status_code == 200, response.text
            assert VALIDATED_ON and all((thread == loop_thread) is on_loop for thread in VALIDATED_ON), route_class


def test_a_large_body_is_validated_at_a_lower_cpu_priority():
    """A body a client made large is worked BULK_NICE below the ingress: the loop, `/healthz` and small requests get
    the cores first. A small body, inline, keeps the loop's priority."""
    from pipeline.priority import BULK_NICE

    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    for body, expected in ((LARGE, min(19, base + BULK_NICE)), (SMALL, base)):
        NICENESS.clear()
        assert post(probe_app(WorkerParsedRoute), body).status_code == 200
        assert NICENESS == [expected]


BODIES = {
    "valid": (LARGE, "application/json"),
    "a field's error deep in it": (LARGE.replace(b" 15000,", b' "x",'), "application/json"),
    "a field missing": (json.dumps({"items": list(range(20_000))}).encode(), "application/json"),
    "not JSON (cut short)": (LARGE[:-40], "application/json"),
    "not an object": (json.dumps(list(range(20_000))).encode(), "application/json"),
    "a +json type": (LARGE, "application/vnd.api+json; charset=utf-8"),
    "text/plain": (LARGE, "text/plain"),
    "no content type": (LARGE, None),
}


@pytest.mark.parametrize("case", BODIES)
def test_a_large_body_is_answered_as_fastapi_answers_it(case):
    """The same status and the same JSON, errors with their locations included. Mutation: `validated` with
    `loc=()` (field errors not under `body`) fails the error cases; its JSON error without the position fails
    'not JSON'."""
    body, content_type = BODIES[case]
    ours, fastapis = (post(probe_app(route_class), body, content_type) for route_class in (WorkerParsedRoute, APIRoute))
    assert (ours.status_code, ours.json()) == (fastapis.status_code, fastapis.json())


def api_routes(routes) -> list[APIRoute]:
    """Every APIRoute under `routes`, in included routers too (FastAPI keeps an included router whole, as
    `original_router`)."""
    found = []
    for route in routes:
        if isinstance(route, APIRoute):
            found.append(route)
        elif hasattr(route, "original_router"):
            found += api_routes(route.original_router.routes)
    return found


def test_every_body_route_of_the_ingress_parses_on_the_worker(app):
    """Each operation whose OpenAPI entry takes a request body (chat, completions, responses, embeddings, answer,
    estimate, tokenize, …) is a WorkerParsedRoute that takes the worker path. Mutation: `route_class=
    WorkerParsedRoute` dropped from one router (serve/http/openai/embeddings.py) → that route is named here."""
    with_body = {(path, method.upper()) for path, operations in app.openapi()["paths"].items()
                 for method, operation in operations.items() if "requestBody" in operation}
    assert {("/v1/chat/completions", "POST"), ("/v1/embeddings", "POST"), ("/tokenize", "POST")} <= with_body
    parsed = {(route.path, method) for route in api_routes(app.routes) for method in route.methods
              if isinstance(route, WorkerParsedRoute) and route.parses_one_json_body()}
    assert sorted(with_body - parsed) == []


def test_a_large_chat_request_is_parsed_off_the_loop_and_answered(app, monkeypatch):
    """Through the whole ingress: the JSON of a 256-message request is parsed on a worker, and the request answered.
    Control: the same request of a few messages is parsed on the loop (inline)."""
    parsed_on: dict[int, list[int]] = {}
    loads = json.loads

    def recording(text, *args, **kwargs):
        parsed_on.setdefault(len(text), []).append(threading.get_ident())
        return loads(text, *args, **kwargs)

    monkeypatch.setattr(json, "loads", recording)
    for turns in (256, 4):
        messages = [{"role": ("user", "assistant")[i % 2], "content": [{"type": "text", "text": "ab"}] * 10}
                    for i in range(turns - 1)] + [{"role": "user", "content": "When does part XK-4471-B ship?"}]
        body = json.dumps({"model": "qvpic-chat", "messages": messages, "max_tokens": 2}).encode()
        response = call(app, "POST", "/v1/chat/completions", content=body,
                        headers={"content-type": "application/json", "Cache-Control": "no-cache"})
        assert response.status_code in (200, 400), response.text  # 400: longer than the tiny model's context
        assert (threading.get_ident() in parsed_on[len(body)]) is (len(body) <= INLINE_BODY_NBYTES), turns


def test_a_large_body_s_shape_is_scanned_off_the_loop(monkeypatch):
    """The shape scan of BodyShapeLimit (nesting, containers) runs on the worker for a body over INLINE_BODY_NBYTES,
    inline for a smaller one; either way a body past the depth limit is the 400 naming it. Control: `body_shape(...)`
    called directly in BodyShapeLimit → the large bodies are scanned on the loop."""
    scanned_on: list[tuple[int, int]] = []
    scan = serve.http.body_shape.body_shape

    def recording(body: bytes, max_depth: int) -> object:
        scanned_on.append((len(body), threading.get_ident()))
        return scan(body, max_depth)

    monkeypatch.setattr(serve.http.body_shape, "body_shape", recording)
    target = probe_app(WorkerParsedRoute)
    statuses = []

    def refuse(request, status, detail):
        statuses.append(detail)
        return JSONResponse({"detail": detail}, status_code=status)

    target.add_middleware(BodyShapeLimit, respond=refuse, on_error=lambda request, status: None, max_depth=8)
    deep = b'{"name": "deep", "items": [], "x": ' + b"[" * 9 + b"]" * 9 + b"}"
    wide = json.dumps({"name": "wide", "items": [], "pad": [[1]] * 1_000, "text": "x" * INLINE_BODY_NBYTES}).encode()
    small = json.dumps({"name": "small", "items": [], "pad": [[1]] * 20}).encode()
    assert post(target, deep + b" " * INLINE_BODY_NBYTES).status_code == 400 and "8 levels" in statuses[-1]
    assert post(target, wide).status_code == 200
    assert post(target, small).status_code == 200
    loop_thread = threading.get_ident()
    on_loop = {nbytes: thread == loop_thread for nbytes, thread in scanned_on}
    assert on_loop == {len(deep) + INLINE_BODY_NBYTES: False, len(wide): False, len(small): True}
