"""Issue 60, item 2: a request is charged by what it costs, before any work. `n` choices count n against the tenant's
in-flight cap; `n × max_tokens` must fit the token budget (a 400 naming the route's field, never a clamp); the
response's log-probability entries are bounded; an embeddings request's inputs are charged to the token rate before
they are embedded; a client's deadline never exceeds the operator's.

The backend is a stub (no model): routing waits on a gate, then refuses (404), and embedding counts its calls, so
a request refused before any work is one that never reached it."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from starlette.datastructures import Headers

from schemas.errors import UnknownIdsError
from serve.governance import Governor
from serve.governance.config import GovernanceConfig
from serve.http import make_api
from serve.http.checks import MAX_LOGPROB_ENTRIES
from serve.http.lifetime import request_timeout_s
from serve.plan import Embedded
from tests.serve.http.test_cost_limits import API, QUESTION, STORE


class Stub:
    """Counts what reached the serving roles; routing waits on `gate` (set: at once), then refuses (404)."""

    def __init__(self):
        self.routed = self.embedded = 0
        self.gate: asyncio.Event | None = None

    async def route(self, request, budget_tokens, collections, cache_salt=b""):
        self.routed += 1
        if self.gate is not None:
            await self.gate.wait()
        raise UnknownIdsError("routed")

    async def embed(self, texts):
        self.embedded += 1
        return Embedded(vectors=np.ones((len(texts), STORE.embedding_dim), np.float32) / 2, prompt_tokens=len(texts))


def served(governance: dict | None = None):
    backend = Stub()
    governor = Governor(GovernanceConfig.model_validate(governance or {}), STORE)
    return make_api(backend, API, governor), backend, governor


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                             base_url="http://localhost", timeout=60)


def post(app, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    async def go() -> httpx.Response:
        async with client(app) as http:
            return await http.post(path, json=body, headers=headers or {})
    return asyncio.run(go())


def chat(**fields) -> dict:
    return {"model": "qvpic", "messages": QUESTION, **fields}


def test_n_choices_hold_n_in_flight_slots():
    app, backend, governor = served({"limits": {"default": {"max_in_flight": 3}}})
    never = post(app, "/v1/chat/completions", chat(n=4))  # more choices than the cap: never admitted, so not a 429
    assert never.status_code == 400 and never.json()["error"]["param"] == "n" and backend.routed == 0, never.text

    async def scenario():
        backend.gate = asyncio.Event()
        async with client(app) as http:
            def ask(n: int, tenant: str = "acme"):
                return http.post("/v1/chat/completions", json=chat(n=n), headers={"X-Tenant": tenant})
            first = asyncio.create_task(ask(2))
            while backend.routed < 1:
                await asyncio.sleep(0.01)
            assert governor.in_flight["acme"] == 2  # one slot per choice (1 with the mutation)
            refused = await ask(2)  # 2 + 2 > 3
            assert refused.status_code == 429 and "max_in_flight" in refused.json()["error"]["message"]
            other = asyncio.create_task(ask(3, "globex"))  # its own slots
            while backend.routed < 2:
                await asyncio.sleep(0.01)
            backend.gate.set()
            assert (await first).status_code == 404 and (await other).status_code == 404
        assert not governor.in_flight  # every slot came back
    asyncio.run(scenario())


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", chat(max_tokens=600, n=2), "max_tokens"),
    ("/v1/completions", {"model": "qvpic", "prompt": "q", "max_tokens": 1200}, "max_tokens"),
    ("/v1/answer", {"query": "q", "top_k": 0, "max_new_tokens": 1200}, "max_new_tokens"),
])
def test_max_tokens_past_the_token_budget_is_a_400_before_any_work(path, body, param):
    app, backend, _ = served({"limits": {"default": {"token_budget": 1000}}})
    response = post(app, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"] if path != "/v1/answer" else {"message": response.json()["detail"]}
    assert "1200 completion tokens" in error["message"] and "1000" in error["message"]
    assert path == "/v1/answer" or error["param"] == param
    assert backend.routed == 0
    header = post(app, path, body, {"X-Max-Token-Budget": "2000"})  # the header is capped by the tenant's default
    assert header.status_code == 400 and backend.routed == 0
    smaller = post(served()[0], path, body, {"X-Max-Token-Budget": "1201"})  # control: room left for a prompt
    assert smaller.status_code == 404


def test_log_probability_entries_are_bounded_before_any_work():
    app, backend, _ = served()
    top = 20
    too_many = chat(n=8, max_tokens=4096, logprobs=True, top_logprobs=top)
    response = post(app, "/v1/chat/completions", too_many)
    assert 8 * 4096 * (1 + top) > MAX_LOGPROB_ENTRIES
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs", response.text
    assert str(MAX_LOGPROB_ENTRIES) in response.json()["error"]["message"]
    legacy = post(app, "/v1/completions", {"model": "qvpic", "prompt": "q", "n": 8, "max_tokens": 4096, "logprobs": 5})
    assert legacy.status_code == 400 and legacy.json()["error"]["param"] == "logprobs", legacy.text
    assert backend.routed == 0
    fits = chat(n=1, max_tokens=4096, logprobs=True, top_logprobs=15)  # 65,536 entries: exactly the limit
    assert post(app, "/v1/chat/completions", fits).status_code == 404 and backend.routed == 1
    assert post(app, "/v1/chat/completions", chat(n=8, max_tokens=4096)).status_code == 404  # no logprobs: no entries


def test_embeddings_inputs_are_charged_to_the_token_rate_before_they_are_embedded():
    app, backend, _ = served({"limits": {"default": {"tokens_per_s": 0.001, "token_burst": 100}}})
    body = {"model": "qvpic", "input": ["x" * 60, "y" * 60]}  # 124 tokens at most: past the burst of 100
    first = post(app, "/v1/embeddings", body, {"X-Tenant": "acme"})
    assert first.status_code == 200 and backend.embedded == 1  # a full bucket admits it, into debt
    second = post(app, "/v1/embeddings", {"model": "qvpic", "input": "hi"}, {"X-Tenant": "acme"})
    assert second.status_code == 429 and "tokens/s" in second.json()["error"]["message"], second.text
    assert backend.embedded == 1  # refused before the embedder ran
    assert post(app, "/v1/embeddings", body, {"X-Tenant": "globex"}).status_code == 200  # its own bucket


class Asked:
    """What `request_timeout_s` reads of a request: its headers (case-insensitive, as Starlette's)."""

    def __init__(self, headers: dict[str, str]):
        self.headers = Headers(headers)


def test_a_client_deadline_never_exceeds_the_operators():
    assert request_timeout_s(Asked({}), 3000.0, 300.0) == 300.0
    assert request_timeout_s(Asked({"X-Request-Timeout": "3000"}), None, 300.0) == 300.0
    assert request_timeout_s(Asked({"X-Request-Timeout": "5"}), None, 300.0) == 5.0  # less is the client's to ask
    assert request_timeout_s(Asked({}), 7.5, 300.0) == 7.5
    assert request_timeout_s(Asked({}), None, 300.0) == 300.0
