"""A hostile tenant beside a victim (issue 60 item 5), CI-sized: tenant a loops every probe of
benchmarks/scale/hostile_probes.py (schema bombs, a 256-turn history, a 16 MP image, `n=8` endless streams, a
10,000-level body) from a process of its own while tenant b asks questions, over real HTTP (uvicorn on loopback), one
rate-limit policy for both (public config keys only). Nothing is timed but a hang: b gets no error, a gets a 4xx for
every probe (no 5xx, no hang past 30 s), `/healthz` answers 200 within 10 s throughout (a hang detector: the roles
share this process's GIL with the ingress). The 2,048-input embedding is charged before it runs, so after one the
tenant is in debt: its own test, outside the loop. The timing targets (b's TTFT, `/healthz` within 100 ms) are the
benchmark's: `python -m benchmarks.scale.fairness` (docs/RELIABILITY.md)."""

from __future__ import annotations

import asyncio
import concurrent.futures

import httpx
import pytest

from benchmarks.scale.hostile_probes import PROBES, embeddings_2048
from benchmarks.scale.tenants import KEY_BULK, Health, Hostile, Victim, governance, questions, serving
from tests.serve.governance.test_budget import governed_app
from tests.support.store_factory import roles, serving_store  # noqa: F401  (fixtures)

QUESTIONS = 4  # b's questions at least; b asks on until every probe of a was answered once
HEALTH_BOUND_MS = 10_000.0  # a hang detector, not the 100 ms target (measured here: up to 5 s, load 15-20)
pytestmark = pytest.mark.e2e  # minutes on a loaded 2-core box: the probes cost the server what they cost
UNCHARGED = "2,048 embedding inputs"  # its own test below, outside the loop (it would be in debt after one)


@pytest.fixture(scope="module")
def base_url(roles, serving_store):  # noqa: F811  (fixture names)
    app, governor = governed_app(roles, serving_store, **governance())
    try:
        with serving(app) as url:
            yield url
    finally:
        governor.close()


MIN_HEALTH_POLLS = 10  # the run lasts until /healthz was polled this often too: refusals now end it sooner


@pytest.fixture(scope="module")
def hostile_run(base_url) -> tuple[Victim, Health, Hostile]:
    """One run of a's loop (every probe but UNCHARGED) beside b's questions, read by each test below."""
    victim, health = Victim(), Health()
    hostile_tenant = Hostile(base_url, concurrency=3, skip=(UNCHARGED,), nice=0)  # as hostile as it can be here
    with hostile_tenant.running():
        asyncio.run(questions(base_url, victim, health, QUESTIONS, 0,
                              until=lambda: hostile_tenant.answered.value >= len(PROBES) - 1
                              and len(health.latency_ms) > MIN_HEALTH_POLLS))
    print({name: dict(counts) for name, counts in hostile_tenant.statuses.items()}, victim, health.failures,
          max(health.latency_ms))
    return victim, health, hostile_tenant


@pytest.mark.parametrize("probe", [name for name in PROBES if name != UNCHARGED])
def test_every_probe_of_the_hostile_tenant_is_refused_never_a_5xx_or_a_hang(hostile_run, probe):
    counts = hostile_run[2].statuses[probe]
    assert counts, f"{probe} was never sent"
    assert all(isinstance(status, int) and 400 <= status < 500 for status in counts), counts  # no 5xx, no hang


def test_healthz_answers_throughout(hostile_run):
    """A hang detector: the roles share this process (and its GIL) with the ingress here, so its tail is seconds on a
    loaded 2-core box; the 100 ms target is the benchmark's (a deployed ingress is a process of its own)."""
    _, health, _ = hostile_run
    assert health.failures == [] and len(health.latency_ms) > MIN_HEALTH_POLLS
    assert max(health.latency_ms) < HEALTH_BOUND_MS


def test_the_victim_gets_every_answer(hostile_run):
    victim, _, _ = hostile_run
    assert victim.errors == [] and len(victim.ttft_ms) >= QUESTIONS


def test_two_thousand_embedding_inputs_are_charged_before_they_are_embedded(base_url, hostile_run):
    """Two 2,048-input requests at once, from tenant c (a's token bucket is in debt after its probes): each is
    charged its ~950k tokens before anything is embedded, so a full token bucket admits one (more than a bucket is
    admitted when full, the rest is debt) and the other is a 429 with a Retry-After of the debt (tens of seconds at
    20,000 tokens/s); b's question asked meanwhile is answered (the router's embedder takes b's query before the
    admitted request's next batch). Control: no charge → two admitted."""
    probe = embeddings_2048()

    def send(_: int) -> httpx.Response | None:
        try:
            return httpx.post(base_url + probe.path, content=probe.body, timeout=8, headers={
                "Content-Type": "application/json", "Authorization": f"Bearer {KEY_BULK}"})
        except httpx.TimeoutException:  # admitted and still embedding: the client leaves, the server stops
            return None

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        sent = list(pool.map(send, range(2)))
        victim, health = Victim(), Health()
        asyncio.run(questions(base_url, victim, health, 1, 0))
    refused = [r for r in sent if r is not None and r.status_code == 429]
    assert len(refused) == 1, [r.status_code if r is not None else "timed out" for r in sent]
    assert float(refused[0].headers["Retry-After"]) >= 10
    assert victim.errors == [] and len(victim.ttft_ms) == 1
