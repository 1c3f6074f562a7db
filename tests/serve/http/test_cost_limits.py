"""Issue 60: a request's JSON Schemas are checked after it is authenticated and charged, on a worker thread, within
stated limits (schemas/schema_checks.py): a schema bomb is a quick 400 naming the field and the limit, never a
500, and never stalls the event loop (`/healthz` answers while one is being checked).

The backend is a stub whose routing refuses every request (404): a request that got past the checks is one that
reaches it. No model is loaded."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

import schemas.schema_checks as schema_checks
from schemas.errors import UnknownIdsError
from schemas.service import StoreInfo
from serve.config import ApiSpec
from serve.governance import Governor
from serve.governance.config import GovernanceConfig
from serve.http import make_api

QUESTION = [{"role": "user", "content": "When does part XK-4471-B ship?"}]
STORE = StoreInfo(fingerprint="f", model_id="m", tiers={"low": 72}, variants=[], embedder="e", embedding_dim=4,
                  num_chunks=0, num_documents=0, num_entries=0, modes=[])
API = ApiSpec(served_model_name="qvpic", default_top_k=1, store=STORE, created=0)


class Refusing:
    """Counts the requests that reached routing, and refuses each (404)."""

    def __init__(self):
        self.routed = 0

    async def route(self, request, budget_tokens, collections, cache_salt=b""):
        self.routed += 1
        raise UnknownIdsError("routed")


def served(governance: dict | None = None):
    backend = Refusing()
    governor = Governor(GovernanceConfig.model_validate(governance or {}), STORE)
    return make_api(backend, API, governor), backend, governor


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def empties(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {} for i in range(n)}}


def nested(depth: int) -> dict:
    schema: dict = {}
    for _ in range(depth - 1):
        schema = {"items": schema}
    return schema


def post(app, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=60) as client:
            return await client.post(path, json=body, headers=headers or {})
    return asyncio.run(go())


@pytest.fixture
def metaschema_checks(monkeypatch) -> list[int]:
    """How many schemas were checked against the metaschema (each check builds one validator)."""
    made, capped = [], schema_checks._CappedMeta
    monkeypatch.setattr(schema_checks, "_CappedMeta", lambda *a, **k: made.append(1) or capped(*a, **k))
    return made


@pytest.mark.parametrize(("fields", "param", "limit"), [
    # 3 tools of 600 empty subschemas: past MAX_SUBSCHEMAS at the second (the issue's bomb, 8 tools of 4,000 each,
    # is now past the body's MAX_BODY_CONTAINERS, refused before it is parsed: tests/serve/http/test_body_shape.py)
    ({"tools": [tool(f"f{i}", empties(600)) for i in range(3)]}, "tools[1].function.parameters",
     str(schema_checks.MAX_SUBSCHEMAS)),
    ({"tools": [tool("f", nested(200))]}, "tools[0].function.parameters", str(schema_checks.MAX_SCHEMA_DEPTH)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": empties(2_000)}}},
     "response_format.json_schema.schema", str(schema_checks.MAX_SUBSCHEMAS)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "type": "object", "description": "x" * 70_000}}}}, "response_format.json_schema.schema",
     str(schema_checks.MAX_SCHEMA_CHARS)),
])
def test_a_schema_past_a_limit_is_a_quick_400_naming_the_field_and_the_limit(fields, param, limit,
                                                                          metaschema_checks):
    app, backend, _ = served()
    started = time.perf_counter()
    response = post(app, "/v1/chat/completions", {"model": "qvpic", "messages": QUESTION, **fields})
    assert time.perf_counter() - started < 1.0  # the issue's own limit: the count refuses it, before any check
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and limit in error["message"], error
    assert backend.routed == 0 and metaschema_checks == []


def test_the_native_route_names_its_own_path():
    app, backend, _ = served()
    body = {"query": "q", "top_k": 0, "messages": QUESTION, "tools": {"tools": [tool("f", nested(200))]}}
    response = post(app, "/v1/answer", body)
    assert response.status_code == 400, response.text
    assert response.json()["detail"].startswith("tools.tools[0].function.parameters: ")
    assert backend.routed == 0


def test_schemas_within_the_limits_are_checked_against_the_metaschema(metaschema_checks):
    app, backend, _ = served()
    bad = post(app, "/v1/chat/completions", {"model": "qvpic", "messages": QUESTION,
                                             "tools": [tool("f", {"type": "object"}), tool("g", {"type": 5})]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools[1].function.parameters", bad.text
    assert "not a valid JSON Schema" in bad.json()["error"]["message"]
    good = post(app, "/v1/chat/completions", {"model": "qvpic", "messages": QUESTION,
                                              "tools": [tool("f", empties(500))]})
    assert good.status_code == 404 and backend.routed == 1  # control: a valid one gets through to routing
    assert len(metaschema_checks) == 3  # f and g, then f again (response_format's is llguidance's to judge)


def test_the_rate_is_charged_before_a_schema_is_checked(metaschema_checks):
    """A tenant whose request rate is spent gets its 429, not a free schema check (nor a 400 that tells it the
    check's outcome)."""
    app, backend, _ = served({"limits": {"default": {"requests_per_s": 0.001, "request_burst": 1}}})
    tenant = {"X-Tenant": "acme"}
    first = post(app, "/v1/chat/completions", {"model": "qvpic", "messages": QUESTION}, tenant)
    assert first.status_code == 404  # the burst's one request, charged
    checks_before = len(metaschema_checks)
    spent = post(app, "/v1/chat/completions", {"model": "qvpic", "messages": QUESTION,
                                               "tools": [tool("f", {"type": 5})]}, tenant)
    assert spent.status_code == 429, spent.text
    assert len(metaschema_checks) == checks_before


def test_healthz_answers_while_a_schema_is_being_checked():
    """A schema within the limits whose check takes a while (1,000 subschemas: ~0.7 s idle) runs on a worker:
    /healthz is answered again and again meanwhile. Before, it ran on the event loop and none was."""
    app, _, governor = served()
    body = {"model": "qvpic", "messages": QUESTION, "tools": [tool("f", empties(1_000))]}

    async def scenario() -> tuple[int, int]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=60) as client:
            bomb = asyncio.create_task(client.post("/v1/chat/completions", json=body, headers={"X-Tenant": "evil"}))
            while governor.in_flight["evil"] < 1 and not bomb.done():  # its turn is open: it is being checked
                await asyncio.sleep(0.001)
            answered = 0
            while not bomb.done():
                health = await client.get("/healthz")
                answered += health.status_code == 200 and not bomb.done()
                await asyncio.sleep(0.01)  # the in-process transport never yields: let the bomb's task run too
            return answered, (await bomb).status_code

    answered, status = asyncio.run(scenario())
    assert status in (404, 400)  # routed (checked within its time), or past SCHEMA_CHECK_S on a loaded machine
    assert answered >= 3
