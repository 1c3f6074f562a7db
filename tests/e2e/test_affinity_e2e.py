"""Chunk-affinity dispatch through Serve: two generator replicas on one Ray node, requests for the same
chunk set land on the replica whose hot tier took it in (every entry a device hit after the first)."""

from __future__ import annotations

import asyncio
import time

import pytest

from schemas.api import AnswerRequest
from schemas.modes import Mode
from schemas.sampling import Sampling
from serve.app import generator_dispatch
from serve.config import AppConfig
from serve.engine import Generator
from serve.kv import CacheLoader, LoaderDeployment
from serve.routing import Router
from tests.support.ray_fixtures import ray_session  # noqa: F401  (fixture)
from tests.support.store_factory import serving_store  # noqa: F401  (fixture)

pytestmark = pytest.mark.e2e
CHUNKS = ["invoices#00000", "invoices#00001", "manual#00000"]
STATS_PERIOD_S = 0.2


def test_requests_for_one_chunk_set_land_on_one_replica(ray_session, serving_store, monkeypatch):  # noqa: F811
    from ray import serve

    from serve.dispatch import AffinityDispatcher

    # The handle (and its router) lives in this process. Serve probes the chosen replica's queue length with
    # a 0.1 s deadline and, when it misses, falls to the next rank: load balancing, which a loaded 2-core CI
    # machine can trigger. This test checks the affinity choice, so the probe gets time to answer.
    monkeypatch.setattr(AffinityDispatcher, "queue_len_response_deadline_s", 2.0)

    config = AppConfig.model_validate({
        "store": serving_store.uri, "model": serving_store.model.model_dump(mode="json"), "router": {}, "loader": {},
        "generator": {}, "dispatch": "affinity", "affinity": {"stats_period_s": STATS_PERIOD_S}})
    request = AnswerRequest(query="When does part XK-4471-B ship?", chunk_ids=CHUNKS, mode=Mode.UNIFORM,
                            max_new_tokens=1)
    plan = asyncio.run(Router(config.router).plan(request))
    loader = serve.deployment(CacheLoader, name="CacheLoader").options(
        ray_actor_options={"num_cpus": 0.1}).bind(config=config.loader)
    generator = serve.deployment(Generator, name="Generator").options(
        num_replicas=2, ray_actor_options={"num_cpus": 0.1}, **generator_dispatch(config)).bind(
        config=config.generator, source=LoaderDeployment(loader))
    serve.start(logging_config={"log_level": "WARNING", "enable_access_log": False})
    handle = serve.run(generator, name="affinity", route_prefix=None)
    try:
        first = handle.generate.remote(plan, Sampling.of(request)).result()
        assert first.report.cache.device_hits == 0  # cold: taken in by whichever replica got it
        time.sleep(10 * STATS_PERIOD_S)  # its hot tier's sketch reaches the handle's router
        hits = [handle.generate.remote(plan, Sampling.of(request)).result().report.cache.device_hits
                for _ in range(6)]
        # the other replica has nothing: one request sent there would show 0 device hits (by chance, under
        # power of two choices, 1 in 2 per request)
        assert hits == [len(CHUNKS)] * 6
    finally:
        # Serve itself too: a later module starts it on a port of its own, which a running Serve would ignore (with
        # tests in folders, the cluster module that used to shut it down in between now runs before this one)
        serve.shutdown()
