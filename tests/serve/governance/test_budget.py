"""Estimates, token budgets and per-tenant rate limits over the in-process app (no Ray), Redis real."""

from __future__ import annotations

import asyncio
import pickle
import random
import uuid

import pytest
from fastapi import FastAPI

from schemas.errors import BudgetExceededError, RateLimitedError
from serve.app import api_spec
from serve.config import AppConfig
from serve.governance import Governor
from serve.governance.budget import RateLimiter, TokenBucket
from serve.governance.config import Limit, RateLimitConfig, TenantPolicy
from serve.governance.shared_state import RedisConnection
from serve.http import make_api
from serve.local import InProcessBackend
from tests.serve.http.test_api import call
from tests.serve.http.test_chat_conversations import data_url
from tests.support.fixtures_redis import redis_url  # noqa: F401  (fixture)
from tests.support.store_factory import MAX_CHUNKS, roles, serving_store  # noqa: F401  (fixtures)

QUERY = "When does part XK-4471-B ship?"
BODY = {"query": QUERY, "doc_ids": ["invoices", "manual"], "tau": 1.0, "max_high_res": 4, "max_new_tokens": 4}
NO_CACHE = {"response_cache": {"levels": []}}


def governed_app(roles, serving_store, **governance) -> tuple[FastAPI, Governor]:
    """The HTTP app over the in-process roles with these GovernanceConfig fields."""
    args = AppConfig(store={"uri": serving_store.uri}, model=serving_store.model, router={"max_chunks": MAX_CHUNKS},
                     ingress={"default_top_k": 2, "governance": governance})
    settings = api_spec(args)
    governor = Governor(args.ingress.governance, settings.store)
    return make_api(InProcessBackend(roles.router, roles.loader, roles.generator), settings, governor), governor


@pytest.fixture(scope="module")
def app(roles, serving_store):
    return governed_app(roles, serving_store, **NO_CACHE)[0]


def estimate(app, body=BODY, **headers) -> dict:
    response = call(app, "POST", "/v1/estimate", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


def test_estimate_prices_the_plan_and_matches_the_answer(app):
    planned = estimate(app)
    response = call(app, "POST", "/v1/answer", json=BODY)
    assert response.status_code == 200
    usage = response.json()["usage"]
    assert {k: planned["usage"][k] for k in ("context_tokens", "context_vision_tokens", "context_text_tokens",
                                              "query_tokens")} == {k: usage[k] for k in planned["usage"] if k in usage}
    assert [c["tier"] for c in planned["chunks"]] == [c["tier"] for c in response.json()["chunks"]]
    assert planned["high_res_chunks"] == sum(c["tier"] == "high" for c in planned["chunks"]) > 0
    for headers in (response.headers, call(app, "POST", "/v1/answer", json={**BODY, "stream": True}).headers):
        assert headers["X-Vision-Tokens"] == str(usage["context_vision_tokens"])
        assert headers["X-Text-Tokens"] == str(usage["context_text_tokens"])
        assert headers["X-High-Res-Chunks"] == str(planned["high_res_chunks"])
    chat = call(app, "POST", "/v1/chat/completions", json={
        "model": "qvpic", "messages": [{"role": "user", "content": QUERY}], "max_tokens": 4, "temperature": 0,
        "qvpic": {k: BODY[k] for k in ("doc_ids", "tau", "max_high_res")}})
    assert chat.headers["X-Vision-Tokens"] == str(usage["context_vision_tokens"])


def needed(planned: dict) -> int:
    """What a request takes of its token budget: its whole prompt and its max_new_tokens (n = 1)."""
    usage = planned["usage"]
    return usage["context_tokens"] + usage["query_tokens"] + usage["max_new_tokens"]


def test_budget_keeps_chunks_low_that_do_not_fit(app):
    lowest = estimate(app, {**BODY, "tau": 0.0})
    low = needed(lowest)
    high = estimate(app)
    assert needed(high) > low and high["budget_tokens"] is None
    costs = sorted((h["num_tokens"] - lo["num_tokens"], h["chunk_id"])
                   for h, lo in zip(high["chunks"], lowest["chunks"]))
    for budget in (low, low + costs[0][0], needed(high) - 1):
        planned = estimate(app, **{"X-Max-Token-Budget": str(budget)})
        assert planned["within_budget"] and planned["budget_tokens"] == budget
        assert low <= needed(planned) <= budget
        assert 0 <= planned["high_res_chunks"] < high["high_res_chunks"]
    assert estimate(app, **{"X-Max-Token-Budget": str(low + costs[0][0])})["high_res_chunks"] >= 1
    answer = call(app, "POST", "/v1/answer", json=BODY, headers={"X-Max-Token-Budget": str(low)})
    assert answer.status_code == 200 and answer.json()["usage"]["context_tokens"] == lowest["usage"]["context_tokens"]
    assert {c["tier"] for c in answer.json()["chunks"]} == {"low"}


def test_over_budget_is_413_with_the_minimum(app):
    lowest = estimate(app, {**BODY, "tau": 0.0})
    low = needed(lowest)  # the prompt (its question included) and the 4 completion tokens, every chunk low
    over = estimate(app, **{"X-Max-Token-Budget": str(low - 1)})
    assert not over["within_budget"] and over["usage"]["context_tokens"] == lowest["usage"]["context_tokens"]
    response = call(app, "POST", "/v1/answer", json=BODY, headers={"X-Max-Token-Budget": str(low - 1)})
    assert response.status_code == 413
    assert response.json()["min_context_tokens"] == low and response.json()["budget_tokens"] == low - 1
    assert f"at least {low} tokens" in response.json()["detail"]
    chat = call(app, "POST", "/v1/chat/completions", headers={"X-Max-Token-Budget": str(low - 1)}, json={
        "model": "qvpic", "messages": [{"role": "user", "content": QUERY}], "max_tokens": 4,
        "qvpic": {"doc_ids": ["invoices", "manual"]}})
    assert chat.status_code == 413 and "at least" in chat.json()["error"]["message"]
    for bad in ("0", "-5", "lots"):
        invalid = call(app, "POST", "/v1/answer", json=BODY, headers={"X-Max-Token-Budget": bad})
        assert invalid.status_code == 400 and "X-Max-Token-Budget" in invalid.json()["detail"]


def test_the_budget_covers_the_users_own_text_and_images(app):
    """Issue 60: the token budget covers the whole prompt: the user's message and image as well as the chunks
    retrieved for it, and the n × max_tokens of the answer; the usage of an unbudgeted answer says what that is."""
    def body(image: bool, n: int = 1) -> dict:
        content = [{"type": "text", "text": QUERY + " Compare the photo, please, item by item." * 3}]
        content += [{"type": "image_url", "image_url": {"url": data_url()}}] if image else []
        return {"model": "qvpic", "messages": [{"role": "user", "content": content}], "max_tokens": 4, "n": n,
                "temperature": 0, "qvpic": {"doc_ids": ["manual"], "tau": 0.0}}

    def ask(budget: int | None, image: bool = True, n: int = 1):
        headers = {"Cache-Control": "no-cache", **({"X-Max-Token-Budget": str(budget)} if budget else {})}
        return call(app, "POST", "/v1/chat/completions", json=body(image, n), headers=headers)

    prompt = ask(None).json()["usage"]["prompt_tokens"]
    text_only = ask(None, image=False).json()["usage"]["prompt_tokens"]
    assert prompt > text_only  # the image's tokens
    assert ask(prompt + 4).status_code == 200
    over = ask(prompt + 3)  # one short: a budget of the chunks and the template alone passed this (mutation)
    assert over.status_code == 413 and f"at least {prompt + 4} tokens" in over.json()["error"]["message"]
    assert ask(text_only + 4).status_code == 413  # enough for the text alone: the image is charged too
    assert ask(prompt + 2 * 4 - 1, n=2).status_code == 413  # n choices: n × max_tokens
    assert ask(prompt + 2 * 4, n=2).status_code == 200


def test_an_estimate_is_charged_to_the_token_rate(roles, serving_store):
    """Issue 60: an estimate's routing reads the prompt's text and images: its tokens go to the tenant's token rate
    (a bucket of one token: the first estimate is admitted into debt, the next waits). Without the charge: 200."""
    limited, _ = governed_app(roles, serving_store, **NO_CACHE,
                              limits={"default": {"tokens_per_s": 0.001, "token_burst": 1}})
    assert estimate(limited, **{"X-Tenant": "acme"})["budget_tokens"] is None
    again = call(limited, "POST", "/v1/estimate", json=BODY, headers={"X-Tenant": "acme"})
    assert again.status_code == 429 and "tokens/s" in again.json()["detail"]
    assert estimate(limited, **{"X-Tenant": "globex"})  # a tenant's own bucket


def test_tenant_default_budget_caps_the_header(roles, serving_store, app):
    low = estimate(app, {**BODY, "tau": 0.0})["usage"]["context_tokens"]
    capped, _ = governed_app(roles, serving_store, **NO_CACHE,
                             limits={"tenants": {"small": {"token_budget": low}}})
    assert estimate(capped, **{"X-Tenant": "small", "X-Max-Token-Budget": "100000"})["budget_tokens"] == low
    assert estimate(capped, **{"X-Tenant": "small", "X-Max-Token-Budget": str(low - 3)})["budget_tokens"] == low - 3
    assert estimate(capped, **{"X-Tenant": "other"})["budget_tokens"] is None


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_request_rate_is_429_with_retry_after(roles, serving_store, redis_url, backend):
    limits = {"backend": backend, "default": {"requests_per_s": 0.5}, "tenants": {"gold": {}}}
    app, _ = governed_app(roles, serving_store, redis_url=redis_url, limits=limits,
                          response_cache={"levels": [], "backend": backend})
    tenant = f"t-{uuid.uuid4().hex[:8]}"  # a fresh bucket, even in the shared Redis
    assert call(app, "POST", "/v1/estimate", json=BODY, headers={"X-Tenant": tenant}).status_code == 200
    limited = call(app, "POST", "/v1/estimate", json=BODY, headers={"X-Tenant": tenant})
    assert limited.status_code == 429 and limited.headers["Retry-After"] == "2"
    assert "0.5 requests/s" in limited.json()["detail"]
    chat = call(app, "POST", "/v1/chat/completions", headers={"X-Tenant": tenant}, json={
        "model": "qvpic", "messages": [{"role": "user", "content": QUERY}]})
    assert chat.status_code == 429 and chat.headers["Retry-After"]
    assert chat.json()["error"]["code"] == "rate_limit_exceeded"
    for _ in range(3):  # unlimited tenant
        assert call(app, "POST", "/v1/estimate", json=BODY, headers={"X-Tenant": "gold"}).status_code == 200


def test_token_rate_is_429_but_cache_hits_are_free(roles, serving_store):
    unlimited, _ = governed_app(roles, serving_store, response_cache={"levels": []})
    usage = call(unlimited, "POST", "/v1/answer", json=BODY).json()["usage"]
    cost = usage["context_tokens"] + usage["query_tokens"] + BODY["max_new_tokens"]
    # a bucket that pays for one answer and half another; a tenant in debt is not even routed (test_routing_charge)
    app, _ = governed_app(roles, serving_store, limits={"default": {"tokens_per_s": 1, "token_burst": cost * 3 // 2}})
    first = call(app, "POST", "/v1/answer", json=BODY)
    assert first.status_code == 200
    limited = call(app, "POST", "/v1/answer", json={**BODY, "max_new_tokens": BODY["max_new_tokens"] + 1})
    assert limited.status_code == 429 and "1 tokens/s" in limited.json()["detail"]
    assert int(limited.headers["Retry-After"]) == pytest.approx(cost + 1 - cost // 2, abs=2.5)
    for _ in range(3):  # the l1 response cache answers: no tokens charged, however often
        again = call(app, "POST", "/v1/answer", json=BODY)
        assert again.status_code == 200 and again.json()["response_cache"]["level"] == "l1"


def test_redis_limits_are_shared_by_replicas(roles, serving_store, redis_url):
    governance = {"redis_url": redis_url, "limits": {"backend": "redis", "default": {"requests_per_s": 0.2}}}
    replica_a, _ = governed_app(roles, serving_store, **governance)
    replica_b, _ = governed_app(roles, serving_store, **governance)
    tenant = {"X-Tenant": f"shared-{uuid.uuid4().hex[:8]}"}
    assert call(replica_a, "POST", "/v1/estimate", json=BODY, headers=tenant).status_code == 200
    assert call(replica_b, "POST", "/v1/estimate", json=BODY, headers=tenant).status_code == 429


def test_token_bucket_never_admits_more_than_its_rate():
    rng = random.Random(7)
    for _ in range(50):
        rate_per_s, capacity = rng.uniform(1, 100), rng.uniform(1, 200)
        bucket, now_s, admitted = TokenBucket(rate_per_s, capacity, capacity, 0.0), 0.0, 0.0
        for _ in range(200):
            now_s += rng.expovariate(5.0)
            cost = rng.uniform(0.1, capacity)
            wait_s = bucket.take(cost, now_s)
            if wait_s == 0:
                admitted += cost
            else:
                assert bucket.take(cost, now_s + wait_s + 1e-9) == 0  # the promised wait is enough
                admitted += cost
                now_s += wait_s + 1e-9
            assert admitted <= capacity + rate_per_s * now_s + 1e-6


def test_a_request_dearer_than_the_burst_waits_for_a_full_bucket():
    limiter = RateLimiter(RateLimitConfig(default=TenantPolicy(tokens_per_s=100, token_burst=50)), None)
    asyncio.run(limiter.take("t", Limit.TOKENS, 500))  # full bucket: admitted, 450 tokens of debt
    with pytest.raises(RateLimitedError) as error:
        asyncio.run(limiter.take("t", Limit.TOKENS, 500))
    assert error.value.retry_after_s == pytest.approx(5.0, abs=0.05)  # refill to a full 50 from -450
    assert error.value.headers() == {"Retry-After": "5"}
    with pytest.raises(ValueError, match="need a redis_url"):
        RateLimiter(RateLimitConfig(backend="redis"), None)


def test_governance_errors_survive_pickling():  # as they would crossing a Ray deployment boundary
    budget = pickle.loads(pickle.dumps(BudgetExceededError("over", min_context_tokens=79, budget_tokens=50)))
    assert (str(budget), budget.body_fields()) == ("over", {"min_context_tokens": 79, "budget_tokens": 50})
    limited = pickle.loads(pickle.dumps(RateLimitedError("slow down", retry_after_s=0.2)))
    assert (str(limited), limited.headers()) == ("slow down", {"Retry-After": "1"})


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_work_done_is_charged_into_debt_and_a_check_refuses_debt(redis_url, backend):  # noqa: F811
    """`force`: the router's reading of a prompt it then refused, charged whatever the bucket holds; a cost of 0
    checks for debt (serve/governance/turn.py `routing`). Both in the replica's buckets and in Redis's script."""
    config = RateLimitConfig(backend=backend, default=TenantPolicy(tokens_per_s=100, token_burst=50))
    limiter = RateLimiter(config, RedisConnection(redis_url) if backend == "redis" else None)
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    asyncio.run(limiter.take(tenant, Limit.TOKENS, 0))  # a full bucket: no debt
    asyncio.run(limiter.take(tenant, Limit.TOKENS, 550, force=True))  # 500 tokens of debt, not refused
    with pytest.raises(RateLimitedError, match="in debt") as error:
        asyncio.run(limiter.take(tenant, Limit.TOKENS, 0))
    assert error.value.retry_after_s == pytest.approx(5.0, abs=0.1)  # 500 tokens at 100/s
    asyncio.run(limiter.take(tenant, Limit.TOKENS, 10, force=True))  # forced again: deeper
    with pytest.raises(RateLimitedError) as deeper:
        asyncio.run(limiter.take(tenant, Limit.TOKENS, 0))
    assert deeper.value.retry_after_s == pytest.approx(5.1, abs=0.1)
