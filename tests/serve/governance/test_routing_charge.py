"""Routing is charged by what it reads (issue 60): a conversation the router refuses as longer than the context has
had its text tokenised and its template rendered (~45 ms for 256 messages) and cost its tenant nothing; now the
tokens the router counted are charged to the tenant's token rate, whatever it holds, and a tenant whose token rate
is in debt is refused (429) before the router reads anything more. Another tenant is served meanwhile. The
counted tokens come from the router's own error; the control is the same flow with the charge taken out."""

from __future__ import annotations

import pytest

from serve.governance import key_digest
from serve.governance.turn import Turn
from tests.serve.governance.test_budget import governed_app
from tests.serve.http.test_api import call
from tests.support.store_factory import MAX_CONTEXT_TOKENS, roles, serving_store  # noqa: F401  (fixtures)

KEYS = {"key-long-a": "a", "key-plain-b": "b"}
BURST_TOKENS = 800  # the token bucket: full, it admits a request of up to the context, then debt
TOO_LONG = [{"role": "user", "content": "Which part ships first, and when? " * 120},  # ~1,000 tokens of user text,
            {"role": "assistant", "content": "XK-4471-B, in March."},  # too few for the character floor to prove
            {"role": "user", "content": "And the warranty? " * 30}]  # it: the router lays it out and counts


def chat(messages: list[dict], key: str):
    return {"json": {"model": "qvpic", "messages": messages, "max_tokens": 2},
            "headers": {"Authorization": f"Bearer {key}", "Cache-Control": "no-cache"}}


@pytest.fixture
def app_and_routes(roles, serving_store, monkeypatch):  # noqa: F811
    app, _ = governed_app(roles, serving_store, auth={"api_key_sha256": {key_digest(k): t for k, t in KEYS.items()}},
                          limits={"default": {"tokens_per_s": 1.0, "token_burst": BURST_TOKENS}},
                          response_cache={"levels": []})
    routed: list[int] = []
    plan = roles.router.plan

    async def counted(request, *args, **kwargs):
        routed.append(len(request.messages or ()))
        return await plan(request, *args, **kwargs)

    monkeypatch.setattr(roles.router, "plan", counted)
    return app, routed


def test_a_history_refused_as_too_long_is_charged_what_the_router_counted(app_and_routes):
    app, routed = app_and_routes
    refused = call(app, "POST", "/v1/chat/completions", **chat(TOO_LONG, "key-long-a"))
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    assert routed == [3]  # the router read it: its layout counted more than the context
    counted = int(refused.json()["error"]["message"].split("request needs ")[1].split(" tokens")[0]) - 2
    assert counted > BURST_TOKENS  # so the charge leaves the tenant in debt
    again = call(app, "POST", "/v1/chat/completions", **chat(TOO_LONG, "key-long-a"))
    assert again.status_code == 429 and "in debt" in again.json()["error"]["message"]
    assert int(again.headers["Retry-After"]) >= counted - BURST_TOKENS  # 1 token/s: the debt's seconds
    assert routed == [3]  # the second was refused before the router read it
    plain = call(app, "POST", "/v1/chat/completions", **chat([{"role": "user", "content": "Which part ships?"}],
                                                              "key-plain-b"))
    assert plain.status_code == 200, plain.text  # b's own bucket: served meanwhile
    assert routed == [3, 1]


def test_the_control_without_the_charge_routes_the_next_one_again(app_and_routes, monkeypatch):
    async def free(self, counted_tokens: int) -> None:
        return None

    monkeypatch.setattr(Turn, "refused_too_long", free)
    app, routed = app_and_routes
    for _ in range(3):
        assert call(app, "POST", "/v1/chat/completions", **chat(TOO_LONG, "key-long-a")).status_code == 400
    assert routed == [3, 3, 3]  # uncharged, each one costs the router its layout again
