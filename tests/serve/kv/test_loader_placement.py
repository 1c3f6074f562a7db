"""`loader_placement`: the host KV tier as its own deployment (shared by the generator replicas) or one in
each generator replica's process (docs/BENCHMARKS.md `affinity` measures both)."""

from __future__ import annotations

import asyncio

import pytest

from schemas.api import AnswerRequest
from schemas.modes import Mode
from schemas.sampling import Sampling
from serve.app import build_app
from serve.config import AppConfig, LoaderPlacement
from serve.engine import Generator
from serve.http.backend import HandleBackend
from serve.kv import CacheLoader, GivenKV, LoaderDeployment, LocalLoader
from tests.support.ray_fixtures import ray_session  # noqa: F401  (fixture)
from tests.support.store_factory import roles, serving_store  # noqa: F401  (fixtures)

CHUNKS = ["invoices#00000", "manual#00000"]
QUERY = "When does part XK-4471-B ship?"


def app_args(serving_store, placement: str) -> dict:  # noqa: F811
    return {"store": serving_store.uri, "model": serving_store.model.model_dump(mode="json"), "router": {},
            "loader": {"max_nbytes": 1 << 20}, "generator": {}, "loader_placement": placement}


def bound(app) -> dict:
    """A bound deployment's name and init kwargs, and those of the applications bound into it, by name."""
    deployment = app._bound_deployment
    found = {deployment.name: deployment.init_kwargs}
    for value in deployment.init_kwargs.values():
        if hasattr(value, "_bound_deployment"):
            found |= bound(value)
    return found


def test_the_placement_is_an_enum_and_a_bad_one_names_the_choices(serving_store):  # noqa: F811
    assert AppConfig.model_validate(app_args(serving_store, "in_generator")).loader_placement \
        is LoaderPlacement.IN_GENERATOR
    with pytest.raises(ValueError, match="deployment.*in_generator"):
        AppConfig.model_validate(app_args(serving_store, "per_node"))


def test_in_generator_binds_no_loader_deployment_and_hands_each_generator_its_config(serving_store):  # noqa: F811
    graph = bound(build_app(app_args(serving_store, "in_generator")))
    assert "CacheLoader" not in graph
    source = graph["Generator"]["source"]
    assert isinstance(source, LocalLoader) and source.config.max_nbytes == 1 << 20  # built in the replica, not here
    assert graph["Ingress"]["loader"] is None
    # negative control: the default binds one CacheLoader deployment into both the generator and the ingress
    shared = bound(build_app(app_args(serving_store, "deployment")))
    assert "CacheLoader" in shared and isinstance(shared["Generator"]["source"], LoaderDeployment)


def test_a_generator_with_its_own_loader_reads_its_misses_and_answers_as_given_kv(roles, serving_store,  # noqa: F811
                                                                                   monkeypatch):
    config = AppConfig.model_validate(app_args(serving_store, "in_generator"))
    generator = Generator(config.generator, LocalLoader(config.loader))
    assert isinstance(generator.source.loader, CacheLoader)
    request = AnswerRequest(query=QUERY, chunk_ids=CHUNKS, mode=Mode.UNIFORM, max_new_tokens=6)
    plan = asyncio.run(roles.router.plan(request))
    cold = generator.generate_blocking(plan, Sampling.of(request))
    warm = generator.generate_blocking(plan, Sampling.of(request))
    assert (cold.report.cache.misses, warm.report.cache.device_hits) == (len(CHUNKS), len(CHUNKS))
    assert generator.loader_stats().misses == len(CHUNKS)  # its own LRU read them; the hot tier kept them
    # the text the same plan decodes from the KV the shared loader reads (served as given: no device hit)
    roles.generator.clear_hot_tier()
    assert cold.text == warm.text == roles.generator.generate_blocking(plan, Sampling.of(request),
                                                                       source=GivenKV(roles.loader.load(plan))).text
    monkeypatch.setattr(generator, "source", LoaderDeployment(handle=None))  # the loader deployment's handle
    with pytest.raises(RuntimeError, match="no loader of its own"):
        generator.loader_stats()


@pytest.mark.e2e
def test_through_serve_the_store_statistics_come_from_a_generator_replica(ray_session, roles, serving_store):  # noqa: F811
    from ray import serve

    config = AppConfig.model_validate(app_args(serving_store, "in_generator"))
    generator = serve.deployment(Generator, name="Generator").options(ray_actor_options={"num_cpus": 0.1}).bind(
        config=config.generator, source=LocalLoader(config.loader))
    serve.start(logging_config={"log_level": "WARNING", "enable_access_log": False})
    handle = serve.run(generator, name="in-generator", route_prefix=None)
    try:
        request = AnswerRequest(query=QUERY, chunk_ids=CHUNKS, mode=Mode.UNIFORM, max_new_tokens=2)
        plan = asyncio.run(roles.router.plan(request))
        answer = handle.generate.remote(plan, Sampling.of(request)).result()
        assert answer.report.cache.misses == len(CHUNKS)
        stats = asyncio.run(HandleBackend(router=None, loader=None, generator=handle).cache_stats())
        assert (stats.misses, stats.entries) == (len(CHUNKS), len(CHUNKS))
    finally:
        serve.shutdown()  # later modules start Serve with HTTP options of their own, which a running one ignores
