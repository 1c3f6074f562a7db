"""Metrics over HTTP: the ingress's `GET /metrics` (in-process, no Ray), and one Serve run scraped at
both the ingress and Ray's metrics export port, whose request log is written on shutdown."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time

import httpx
import pyarrow.parquet as pq
import pytest
from prometheus_client.parser import text_string_to_metric_families

from schemas.api import AnswerRequest
from serve.app import api_spec
from serve.config import AppConfig
from serve.governance import Governor
from serve.http import make_api
from serve.kv import CacheLoader, store_row
from serve.local import InProcessBackend
from serve.metrics import Counter, Gauge, serve_metrics
from tests.serve.http.test_api import call
from tests.support.paths import REPO
from tests.support.ray_fixtures import free_port, ray_session  # noqa: F401  (fixture)
from tests.support.store_factory import MAX_CHUNKS, MAX_CONTEXT_TOKENS, corrupt_entry, loader_of, roles, serving_store  # noqa: F401

QUERY = "When does part XK-4471-B ship?"
RAY_EXPORT_WAIT_S = 45.0  # Ray's metrics agent publishes about every 10 s


def samples(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels` (0 when none)."""
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and labels.items() <= s.labels.items())


def metric(app, name: str, **labels: str) -> float:
    response = call(app, "GET", "/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return samples(response.text, name, **labels)


def app_over(roles, serving_store, loader: CacheLoader | None = None, **governance):
    args = AppConfig(store={"uri": serving_store.uri}, model=serving_store.model, router={"max_chunks": MAX_CHUNKS},
                     ingress={"default_top_k": 2, "governance": governance})
    settings = api_spec(args)
    backend = InProcessBackend(roles.router, loader or roles.loader, roles.generator)
    return make_api(backend, settings, Governor(args.ingress.governance, settings.store))


def test_requests_are_counted_by_mode_tier_and_outcome(roles, serving_store):
    app = app_over(roles, serving_store, limits={"tenants": {"slow": {"requests_per_s": 0.01}}})
    names = {"requests": ("qvpic_requests_total", {"route": "answer", "mode": "qvpic"}),
             "ttft": ("qvpic_ttft_ms_count", {"mode": "qvpic", "cache": "miss"}),
             "latency": ("qvpic_latency_ms_count", {"mode": "qvpic", "cache": "miss"}),
             "context": ("qvpic_context_tokens_sum", {"mode": "qvpic"}),
             "high": ("qvpic_chunks_total", {"mode": "qvpic", "tier": "high"}),
             "promotions": ("qvpic_promotions_total", {}),
             "kv_hits": ("qvpic_kv_cache_lookups_total", {"outcome": "hit"}),
             "kv_misses": ("qvpic_kv_cache_lookups_total", {"outcome": "miss"}),
             "kv_bytes": ("qvpic_kv_loaded_bytes_total", {}), "l1": ("qvpic_response_cache_total", {"result": "l1"}),
             "e404": ("qvpic_errors_total", {"route": "answer", "status": "404"}),
             "e422": ("qvpic_errors_total", {"route": "answer", "status": "422"}),
             "e413": ("qvpic_errors_total", {"route": "answer", "status": "413"}),
             "budget": ("qvpic_budget_rejections_total", {}),
             "limited": ("qvpic_rate_limit_rejections_total", {"limit": "requests"})}

    def snapshot() -> dict[str, float]:
        text = call(app, "GET", "/metrics").text
        return {key: samples(text, name, **labels) for key, (name, labels) in names.items()}

    before = snapshot()
    body = {"query": f"{QUERY} {time.time_ns()}", "doc_ids": ["invoices"], "tau": 1.0, "max_high_res": 1,
            "max_new_tokens": 3}
    reply = call(app, "POST", "/v1/answer", json=body).json()
    assert call(app, "POST", "/v1/answer", json=body).json()["response_cache"]["level"] == "l1"
    assert call(app, "POST", "/v1/answer", json={**body, "doc_ids": ["ghost"]}).status_code == 404
    assert call(app, "POST", "/v1/answer", json={**body, "mode": "fastest"}).status_code == 422
    # 4 tokens: the 3 completion tokens set aside leave 1 for the prompt
    assert call(app, "POST", "/v1/answer", json=body, headers={"X-Max-Token-Budget": "4"}).status_code == 413
    assert [call(app, "POST", "/v1/estimate", json=body, headers={"X-Tenant": "slow"}).status_code
            for _ in range(2)] == [200, 429]
    delta = {key: value - before[key] for key, value in snapshot().items()}
    num_high = sum(c["tier"] == "high" for c in reply["chunks"])
    assert num_high == 1 and reply["response_cache"]["level"] is None
    assert delta == {
        "requests": 4, "ttft": 1, "latency": 1, "context": reply["usage"]["context_tokens"], "high": num_high,
        "promotions": num_high, "kv_hits": reply["cache"]["hits"], "kv_misses": reply["cache"]["misses"],
        "kv_bytes": reply["cache"]["nbytes_from_store"], "l1": 1, "e404": 1, "e422": 1, "e413": 1, "budget": 1,
        "limited": 1}


def test_corrupt_shards_and_online_recompiles_are_counted(roles, serving_store, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(serving_store.uri, root)
    body = {"query": f"{QUERY} {time.time_ns()}", "chunk_ids": ["recipes#00000"], "tau": 1.0, "max_new_tokens": 2}
    estimate = call(app_over(roles, serving_store), "POST", "/v1/estimate", json=body).json()
    assert estimate["chunks"][0]["tier"] == "high"
    plan = asyncio.run(roles.router.plan(AnswerRequest(**body)))
    corrupt_entry(root, store_row(plan.chunks[0].entry.row))  # the high-tier entry; its low tier stays readable
    app = app_over(roles, serving_store, loader=loader_of(str(root)))

    def counts() -> tuple[float, ...]:
        return (metric(app, "qvpic_corrupt_shards_total"), metric(app, "qvpic_tier_fallbacks_total"),
                metric(app, "qvpic_kv_recompiles_total", outcome="recompiled"))

    before = counts()
    reply = call(app, "POST", "/v1/answer", json=body).json()  # the generator rebuilds the high-tier entry
    assert reply["chunks"][0]["tier"] == "high" and reply["fallbacks"] == []
    assert tuple(a - b for a, b in zip(counts(), before)) == (1, 0, 1)


def test_crashes_are_counted_as_500(roles, serving_store):
    class Crashing(InProcessBackend):
        async def generate(self, plan, loaded, sampling):
            raise RuntimeError("generator crashed")

    args = AppConfig(store={"uri": serving_store.uri}, model=serving_store.model, router={"max_chunks": MAX_CHUNKS},
                     ingress={"default_top_k": 2})
    settings = api_spec(args)
    app = make_api(Crashing(roles.router, roles.loader, roles.generator), settings,
                   Governor(args.ingress.governance, settings.store))

    async def crash() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            return await client.post("/v1/answer",
                                     json={"query": f"{QUERY} {time.time_ns()}", "chunk_ids": ["manual#00000"]})

    before = metric(app, "qvpic_errors_total", route="answer", status="500")
    assert asyncio.run(crash()).status_code == 500
    assert metric(app, "qvpic_errors_total", route="answer", status="500") - before == 1


def test_the_dashboard_reads_every_metric_and_only_those():
    dashboard = json.loads((REPO / "docs" / "grafana-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for panel in dashboard["panels"] for t in panel["targets"])
    used = set(re.findall(r"ray_(qvpic_[a-z_]+)", exprs))
    suffixes = {Counter: ("_total",), Gauge: ("",)}  # else a histogram's
    exported = {family.name: {family.name + suffix
                              for suffix in suffixes.get(type(family), ("_bucket", "_sum", "_count"))}
                for family in serve_metrics().families()}
    assert used <= set().union(*exported.values()), used - set().union(*exported.values())
    assert [name for name, series in exported.items() if not series & used] == []  # every metric has a panel


def test_no_metric_takes_a_tag_ray_serve_reserves():
    """Inside a replica Ray Serve adds these tags itself and refuses a metric that declares one: the replica
    (the ingress, for qvpic_replica_retries with a `deployment` label) then fails to start. Outside a replica,
    as here, nothing checks it."""
    from ray.serve.metrics import APPLICATION_TAG, DEPLOYMENT_TAG, REPLICA_TAG

    reserved = {APPLICATION_TAG, DEPLOYMENT_TAG, REPLICA_TAG}
    assert {family.name: set(family.labels) & reserved for family in serve_metrics().families()
            if set(family.labels) & reserved} == {}


@pytest.mark.e2e
def test_serve_exports_metrics_and_flushes_the_request_log(ray_session, serving_store, tmp_path):
    from ray import serve

    from serve.app import build_app

    port, log_dir = free_port(), tmp_path / "requests"
    serve.start(http_options={"host": "127.0.0.1", "port": port},
                logging_config={"log_level": "WARNING", "enable_access_log": False})
    args = {"store": {"uri": serving_store.uri}, "model": serving_store.model.model_dump(mode="json"),
            "router": {"max_chunks": MAX_CHUNKS, "max_context_tokens": MAX_CONTEXT_TOKENS},
            "ingress": {"default_top_k": 2,
                        "governance": {"request_log": {"location": {"uri": str(log_dir)}, "batch_rows": 1000}}}}
    try:
        serve.run(build_app(args), name="qvpic-governance", route_prefix="/")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            body = {"query": QUERY, "chunk_ids": ["invoices#00000"], "max_new_tokens": 3}
            headers = {"X-Tenant": "acme", "X-Task-Type": "qa"}
            first = client.post("/v1/answer", json=body, headers=headers)
            assert first.status_code == 200 and first.headers["X-Vision-Tokens"] == str(
                first.json()["usage"]["context_vision_tokens"])
            assert client.post("/v1/answer", json=body, headers=headers).json()["response_cache"]["level"] == "l1"
            assert client.post("/v1/answer", json={**body, "chunk_ids": ["nope"]}, headers=headers).status_code == 404
            ingress = client.get("/metrics").text
        assert samples(ingress, "qvpic_requests_total", route="answer") == 3
        assert samples(ingress, "qvpic_response_cache_total", result="l1") == 1
        assert samples(ingress, "qvpic_errors_total", status="404") == 1
        exporter = f"http://127.0.0.1:{ray_session.nodes()[0]['MetricsExportPort']}/metrics"
        deadline = time.monotonic() + RAY_EXPORT_WAIT_S
        while (exported := samples(httpx.get(exporter, timeout=10).text, "ray_qvpic_requests_total",
                                   route="answer", application="qvpic-governance")) < 3 and time.monotonic() < deadline:
            time.sleep(1.0)
        assert exported == 3
    finally:
        serve.delete("qvpic-governance")  # graceful: Ingress.__del__ writes the buffered log
        serve.shutdown()
    rows = pq.read_table(log_dir).to_pylist()
    assert sorted(r["status"] for r in rows) == [200, 200, 404]
    assert {(r["tenant"], r["task_type"], r["route"]) for r in rows} == {("acme", "qa", "answer")}
    assert sorted(str(r["cache_level"]) for r in rows) == ["None", "None", "l1"]


def test_a_process_without_ray_keeps_the_prometheus_sink():
    """An engine run bare (the device check's engine step: the GPU box has no Ray) records its metrics all the same.
    Control: serve.metrics importing ray.serve unconditionally fails this at import."""
    import subprocess
    import sys

    script = ("import sys; sys.modules['ray'] = None\n"
              "from serve.metrics import serve_metrics\n"
              "m = serve_metrics(); m.requests.inc(route='chat', mode='qvpic'); m.requests.inc(2, route='chat', "
              "mode='qvpic')\n"
              "print(m.exposition().decode())")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert 'qvpic_requests_total{mode="qvpic",route="chat"} 3.0' in done.stdout
