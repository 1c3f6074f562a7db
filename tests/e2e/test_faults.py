"""Faults injected for real: a compile actor killed mid-ingest, corrupted shards, a Serve replica
killed under load, Redis going away. Each ends in a complete store or a served request — or a clean
error response — never a hang, a silent gap or a wrong answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from PIL import Image, ImageDraw, ImageFont

from benchmarks.scale.load import LoadResult, ray_worker_pids, request_mix, run_load
from pipeline.ingest import IngestConfig, ingest
from pipeline.ingest.stages import compile_in_process
from pipeline.runtime.render import resolve_font
from pipeline.store import Store, publish_generation
from schemas.api import AnswerRequest
from schemas.corpus import Chunk
from schemas.modes import Mode
from schemas.store import StoreSpec
from serve.app import api_spec
from serve.config import AppConfig, GeneratorConfig, RouterConfig
from serve.engine import Generator
from serve.http import make_api
from serve.kv import store_row
from serve.local import InProcessBackend
from serve.routing import Router
from tests.e2e.test_ingest_e2e import assert_complete
from tests.serve.http.test_api import call, sse_events
from tests.serve.http.test_metrics import metric
from tests.support.fixtures_redis import start_redis
from tests.support.ray_fixtures import free_port, ray_session  # noqa: F401  (pytest fixture)
from tests.support.store_factory import MAX_CHUNKS, ServingStore, corrupt_entry, loader_of, roles, serving_store  # noqa: F401

APP_NAME = "qvpic-faults"
REQUEST_TIMEOUT_S = 120.0
QUERY = "When does part XK-4471-B ship?"
SCAN_TEXT = "Glacier order 5521 ships Friday."
LINKED_MODES = (Mode.QVPIC, Mode.UNIFORM_HIGH, Mode.IMAGE_PIC, Mode.TEXT_PIC)


# ---- a shard corrupted on disk ---------------------------------------------------------------------
def in_process_app(store_uri: str, serving: ServingStore, router: Router, generator: Generator):
    args = AppConfig(store={"uri": store_uri}, model=serving.model, router={"max_chunks": MAX_CHUNKS},
                     ingress={"default_top_k": 2})
    generator.contexts.hot.clear()  # cold, like the new loader: every entry is read from the store again
    return make_api(InProcessBackend(router, loader_of(store_uri), generator), api_spec(args))


def test_corrupt_entries_are_rebuilt_exactly_as_ingest_built_them(roles, serving_store, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(serving_store.uri, root)
    requests = {mode: AnswerRequest(query=QUERY, chunk_ids=["invoices#00000", "manual#00001"], mode=mode, tau=0.5,
                                    max_high_res=1, max_new_tokens=8) for mode in LINKED_MODES}
    plans = {mode: asyncio.run(roles.router.plan(request)) for mode, request in requests.items()}
    entries = {c.entry.key: (c, c.entry) for p in plans.values() for c in p.chunks}
    assert {e.variant.value + str(e.tier) for _, e in entries.values()} == {"templatelow", "templatehigh", "plainlow",
                                                                             "textNone"}
    clean = in_process_app(str(root), serving_store, roles.router, roles.generator)
    expected = {mode: call(clean, "POST", "/v1/answer", json=r.model_dump(mode="json")).json()
                for mode, r in requests.items()}
    clean_store = Store.open(serving_store.uri)
    for chunk, entry in entries.values():
        corrupt_entry(root, store_row(entry.row))
        # what ingest wrote, up to its batch's float rounding
        rebuilt = roles.generator.repairer.recompile(chunk, entry)
        original = clean_store.load_kv(store_row(entry.row))
        assert rebuilt.kv.dtype == original.dtype and rebuilt.kv.shape == original.shape
        assert float((rebuilt.kv - original).abs().max()) <= 1e-5  # ingest compiles in padded batches
        assert (rebuilt.num_tokens, rebuilt.position_span, rebuilt.compile_start) == (
            entry.num_tokens, entry.position_span, entry.row.compile_start)

    app = in_process_app(str(root), serving_store, roles.router, roles.generator)  # a cold loader: every read fails
    before = (metric(app, "qvpic_corrupt_shards_total"), metric(app, "qvpic_kv_recompiles_total", outcome="recompiled"))
    for mode, request in requests.items():
        reply = call(app, "POST", "/v1/answer", json=request.model_dump(mode="json"))
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["answer"] == expected[mode]["answer"] and answer["fallbacks"] == []
        assert [c["tier"] for c in answer["chunks"]] == [c["tier"] for c in expected[mode]["chunks"]]
    after = (metric(app, "qvpic_corrupt_shards_total"), metric(app, "qvpic_kv_recompiles_total", outcome="recompiled"))
    # each distinct entry is rebuilt once: the generator's hot tier keeps the rebuilt KV for the next request
    assert after[0] - before[0] >= len(entries) and after[1] - before[1] == len(entries)


def add_scanned_page(root: Path, serving: ServingStore, image_path: Path) -> str:
    """A page-image chunk compiled into the store at `root` by ingest's own stages; returns its chunk id."""
    page = Image.new("RGB", (900, 260), "white")
    ImageDraw.Draw(page).text((20, 40), SCAN_TEXT, fill="black",
                              font=ImageFont.truetype(str(resolve_font("DejaVuSans.ttf")), 40))
    page.save(image_path)
    store = Store.open(str(root))
    manifest = store.load_manifest_or_raise()
    chunk = Chunk.build("scan.png", 0, SCAN_TEXT, len(serving.vlm.adapter.encode(SCAN_TEXT)))
    assert not compile_in_process(store, manifest, serving.vlm, [(chunk.chunk_key, chunk.text, str(image_path))],
                                  images_root=str(image_path.parent))
    store.publish_chunks([dict(chunk.model_dump(), embedding=serving.embedder.embed([chunk.text])[0].tolist(),
                               source="scan.png", image_path=str(image_path))])
    publish_generation(store, "tests")  # as a job ends: serving switches to what it wrote
    return chunk.chunk_id


def test_unrebuildable_entries_take_their_backup_or_are_a_clean_503(serving_store, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(serving_store.uri, root)
    image_path = tmp_path / "scan.png"
    scan = add_scanned_page(root, serving_store, image_path)
    router = Router(RouterConfig(store=str(root), model=serving_store.model, max_chunks=MAX_CHUNKS))
    generator = Generator(GeneratorConfig(store=str(root), model=serving_store.model, images_root=str(tmp_path)))
    body = {"query": "When does the Glacier order ship?", "chunk_ids": [scan], "mode": "qvpic", "tau": 1.0,
            "max_new_tokens": 4}
    planned = asyncio.run(router.plan(AnswerRequest(**body)))
    high, low = planned.chunks[0].entry, planned.chunks[0].fallback
    assert (high.tier, low.tier) == ("high", "low")
    app = in_process_app(str(root), serving_store, router, generator)
    assert call(app, "POST", "/v1/answer", json=body).json()["chunks"][0]["tier"] == "high"

    image_path.unlink()  # the page image is gone from this replica: the entry cannot be rebuilt
    corrupt_entry(root, store_row(high.row))
    app = in_process_app(str(root), serving_store, router, generator)
    before = metric(app, "qvpic_kv_recompiles_total", outcome="backup")
    reply = call(app, "POST", "/v1/answer", json=body).json()
    assert reply["chunks"][0]["tier"] == "low"
    (fallback,) = reply["fallbacks"]
    assert (fallback["requested_tier"], fallback["served_tier"]) == ("high", "low")
    assert "checksum" in fallback["reason"] and "not readable" in fallback["reason"]
    assert metric(app, "qvpic_kv_recompiles_total", outcome="backup") - before == 1

    corrupt_entry(root, store_row(low.row))  # now nothing readable is left: refused, never a gap in the context
    app = in_process_app(str(root), serving_store, router, generator)
    before = metric(app, "qvpic_kv_recompiles_total", outcome="unservable")
    refused = call(app, "POST", "/v1/answer", json=body)
    assert refused.status_code == 503 and scan in refused.json()["detail"]
    streamed = call(app, "POST", "/v1/answer", json={**body, "stream": True})
    (event,) = [json.loads(e) for e in sse_events(streamed.text)]
    assert event["type"] == "error" and event["status_code"] == 503
    assert metric(app, "qvpic_kv_recompiles_total", outcome="unservable") - before == 2


# ---- a compile actor dies mid-ingest --------------------------------------------------------------
@pytest.mark.e2e
def test_compile_actor_killed_mid_ingest_job_completes(ray_session, tmp_path):
    corpus = tmp_path / "records.jsonl"
    texts = [f"Record {i}: lot {i * 7919 % 10007} passed inspection on day {i % 28 + 1} at bay {i % 9}."
             for i in range(40)]
    corpus.write_text("".join(json.dumps({"doc_id": f"r{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    store_dir = tmp_path / "store"
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["summary"] = ingest(IngestConfig(corpus=str(corpus), store=StoreSpec(uri=str(store_dir))))
        except BaseException as error:  # noqa: BLE001  re-raised on the test's thread below
            outcome["error"] = error

    job = threading.Thread(target=run)
    job.start()
    deadline = time.monotonic() + 240
    killed: list[int] = []
    while not killed:  # the first index row is published: compilation is under way
        assert job.is_alive() and time.monotonic() < deadline, f"ingest ended before the kill: {outcome}"
        parts = os.listdir(store_dir / "index") if (store_dir / "index").is_dir() else []
        workers = ray_worker_pids("MapBatches(CompileStage)")
        if parts and workers:
            parts_at_kill = len(parts)
            os.kill(workers[0], signal.SIGKILL)  # the actor's process, mid-batch
            killed.append(workers[0])
        time.sleep(0.05)
    job.join(timeout=300)
    assert not job.is_alive(), "ingest hung after its compile actor died"
    if "error" in outcome:
        raise outcome["error"]
    summary = outcome["summary"]
    assert parts_at_kill < len(texts), "the kill came after compilation had finished"
    assert summary.balanced and summary.indexed == len(texts) and not summary.quarantined
    assert_complete(Store.open(str(store_dir)))  # every entry of every chunk, each loadable


# ---- a Serve replica dies under load; Redis goes away -------------------------------------------------
@pytest.fixture(scope="module")
def served(ray_session, serving_store):
    """The whole Serve graph over `serving_store`, its response cache on a private Redis."""
    from ray import serve

    from serve.app import build_app

    redis = start_redis()
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port},
                logging_config={"log_level": "WARNING", "enable_access_log": False})
    args = {"store": {"uri": serving_store.uri}, "model": serving_store.model.model_dump(mode="json"),
            "router": {"max_chunks": MAX_CHUNKS},
            "loader_placement": "deployment",  # the CacheLoader deployment whose replica the test kills
            "ingress": {"default_top_k": 2,
                        "governance": {"redis_url": redis.url, "response_cache": {"backend": "redis"}}}}
    serve.run(build_app(args), name=APP_NAME, route_prefix="/")
    yield f"http://127.0.0.1:{port}", redis
    serve.shutdown()
    redis.stop()


def replica_actor_names(deployment: str) -> list[tuple[str, str]]:
    """(name, namespace) of this app's live replicas of `deployment` (Serve names its replica actors)."""
    import ray

    return sorted((a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("SERVE_REPLICA::") and f"{APP_NAME}#{deployment}#" in a["name"])


def kill_replica(deployment: str) -> str:
    import ray

    (name, namespace), = replica_actor_names(deployment)
    ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)  # Serve's controller starts a new one
    return name


@pytest.mark.e2e
def test_replicas_killed_under_load_fail_cleanly_then_recover(served):
    """The generator, then the loader, die mid-run: every request ends 200 or as a clean, retryable 503
    (a JSON body, or an error event once a stream has started); none hangs; Serve replaces both."""
    base_url, _ = served
    bodies = request_mix(48, ["invoices", "manual", "recipes"], list(LINKED_MODES) + [Mode.FULL_TEXT],
                         repeat_share=0.0, seed=3, max_new_tokens=24, stream_share=0.5)
    result = LoadResult(num_requests=len(bodies), concurrency=4, wall_s=0.0, latencies_ms=[])
    kills: list[tuple[str, int]] = []  # (replica killed, requests answered by then)

    async def scenario() -> None:
        load = asyncio.create_task(run_load(base_url, bodies, 4, timeout_s=REQUEST_TIMEOUT_S, into=result))
        for deployment, answered in (("Generator", 4), ("CacheLoader", 24)):
            while len(result.latencies_ms) < answered:  # under way: some answered, more in flight
                assert not load.done(), result.errors
                await asyncio.sleep(0.02)
            kills.append((await asyncio.to_thread(kill_replica, deployment), len(result.latencies_ms)))
        await load

    asyncio.run(scenario())
    assert kills[-1][1] < len(bodies), "the load was over before the last kill"
    assert result.statuses[0] == 0, result.errors  # nothing hung past the client's timeout
    assert set(result.statuses) <= {200, 503}, result.errors
    for status, text in result.errors:  # requests in flight on a dead replica
        assert status == 503 and "retry" in json.loads(text)["detail"]
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    for (killed, _), deployment in zip(kills, ("Generator", "CacheLoader")):
        while [name for name, _ in replica_actor_names(deployment)] in ([], [killed]):
            assert time.monotonic() < deadline, f"Serve did not replace the killed {deployment} replica"
            time.sleep(0.2)
    after = httpx.post(f"{base_url}/v1/answer", json={"query": "When does invoice 4472 ship?", "top_k": 2,
                                                      "max_new_tokens": 4}, timeout=REQUEST_TIMEOUT_S)
    assert after.status_code == 200, after.text
    print(f"replica kills {kills}: outcomes {dict(result.statuses)} over {len(bodies)} requests")


@pytest.mark.e2e
def test_redis_going_away_degrades_the_response_cache_to_misses(served):
    base_url, redis = served
    body = {"query": f"When does part XK-4471-B ship? {time.time_ns()}", "chunk_ids": ["invoices#00000"],
            "max_new_tokens": 4}
    with httpx.Client(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as http:
        first, second = (http.post("/v1/answer", json=body).json() for _ in range(2))
        assert (first["response_cache"]["level"], second["response_cache"]["level"]) == (None, "l1")
        redis.stop()
        replies = [http.post("/v1/answer", json=body) for _ in range(3)]
        fresh = http.post("/v1/answer", json={**body, "query": "Who signed for invoice 4472?"})
    assert [r.status_code for r in replies] == [200, 200, 200] and fresh.status_code == 200
    assert [r.json()["response_cache"]["level"] for r in replies] == [None] * 3  # misses, answered by the model
    assert {r.json()["answer"] for r in replies} == {first["answer"]}
