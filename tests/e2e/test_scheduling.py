"""Jobs that share a cluster cannot deadlock: with most CPUs held by other actors (a Serve app's replicas
stand-in), a recompile sizes its requests into what is free and completes; with too little free it fails
within seconds, naming what it needs and who holds the rest, instead of waiting forever."""

from __future__ import annotations

import shutil
import time

import pytest

from pipeline.ingest import CompileResources, RecompileConfig, ResourceError, recompile
from pipeline.store import Store
from schemas.render import RenderSpec
from schemas.store import StoreSpec
from tests.e2e.test_ingest_e2e import assert_complete
from tests.support.ray_fixtures import ray_session  # noqa: F401  (pytest fixture)
from tests.support.store_factory import serving_store  # noqa: F401  (pytest fixture)

pytestmark = pytest.mark.e2e


class Placeholders:
    """Actors that hold `cpus` logical CPUs of the session's cluster until closed."""

    def __init__(self, ray, cpus: float):
        @ray.remote
        class Placeholder:
            def ping(self) -> bool:
                return True

        whole, rest = int(cpus), cpus - int(cpus)
        self.ray = ray
        self.actors = [Placeholder.options(num_cpus=1).remote() for _ in range(whole)]
        if rest:
            self.actors.append(Placeholder.options(num_cpus=rest).remote())
        ray.get([a.ping.remote() for a in self.actors], timeout=120)  # placed once earlier jobs' actors are gone

    def close(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor)


@pytest.fixture
def store_copy(serving_store, tmp_path) -> StoreSpec:
    shutil.copytree(serving_store.uri, tmp_path / "store")
    return StoreSpec(uri=str(tmp_path / "store"))


def total_cpus(ray) -> float:
    return ray.cluster_resources().get("CPU", 0.0)


def free_cpus(ray) -> float:
    return ray.available_resources().get("CPU", 0.0)


def test_recompile_progresses_on_the_cpus_left_free(ray_session, store_copy):
    # leaves 1.4 CPUs: one for Ray Data's shuffle tasks, the rest for the stage actors
    placeholders = Placeholders(ray_session, total_cpus(ray_session) - 1.4)
    try:
        assert free_cpus(ray_session) < 1.5
        summary = recompile(RecompileConfig(store=store_copy, render=RenderSpec(font_size_pt=10.0), orphan_grace_s=0,
                                            resources=CompileResources(batch_size=4), resource_wait_s=10,
                                            stall_timeout_s=300))
    finally:
        placeholders.close()
    assert summary.num_failed == 0 and summary.num_compiled == summary.num_chunk_texts == 5
    assert_complete(Store.open(store_copy))


def test_recompile_fails_fast_naming_what_it_waits_for(ray_session, store_copy):
    placeholders = Placeholders(ray_session, total_cpus(ray_session) - 0.5)
    try:
        started = time.monotonic()
        with pytest.raises(ResourceError) as refused:
            recompile(RecompileConfig(store=store_copy, render=RenderSpec(font_size_pt=10.0), resource_wait_s=2))
        waited_s = time.monotonic() - started
    finally:
        placeholders.close()
    message = str(refused.value)
    assert waited_s < 30, waited_s
    assert "needs at least 1.02 CPU" in message and "0.5 of 4 CPUs" in message and "Placeholder" in message, message
    before = Store.open(store_copy).load_manifest_or_raise()
    assert before.render.font_size_pt == 9.0  # refused before touching the store
