"""Readiness without Ray: what a pending deployment waits for, and the gate that answers 503 at once
while one is pending (the HTTP surface in-process, readiness from a stand-in for the Serve controller).
The same on a real local Ray, with a deployment that cannot be placed: tests/e2e/test_serve_lifecycle.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import yaml
from ray.serve._private.common import DeploymentStatus, ReplicaState
from ray.serve.schema import ApplicationStatus

from schemas.health import Readiness
from serve.app import api_spec
from serve.config import AppConfig
from serve.deployment import DeploymentConfig
from serve.http import make_api
from serve.http.health import (
    INGRESS_ONLY_PATHS,
    ReadinessProbe,
    all_healthy,
    app_readiness,
    fits,
    holding_back,
    install_readiness,
)
from serve.local import InProcessBackend
from tests.serve.http.test_api import QUERY, call
from tests.support.paths import REPO
from tests.support.store_factory import MAX_CHUNKS, roles, serving_store  # noqa: F401  (pytest fixtures)

CPU_NODE = {"CPU": 4.0, "memory": 8e9}
ANSWER = {"query": QUERY, "top_k": 1, "max_new_tokens": 2}
CHAT = {"model": "qvpic", "messages": [{"role": "user", "content": QUERY}], "max_tokens": 2}


def deployment(name: str, states: list[ReplicaState], demand: dict, status=DeploymentStatus.UPDATING, target=1,
               message=""):
    """The fields of Serve's DeploymentDetails that readiness reads."""
    return SimpleNamespace(name=name, status=status, message=message, target_num_replicas=target,
                           required_resources=demand, replicas=[SimpleNamespace(state=s) for s in states])


def application(*deployments, status=ApplicationStatus.DEPLOYING, message=""):
    return SimpleNamespace(status=status, message=message, deployments={d.name: d for d in deployments})


RUNNING = [ReplicaState.RUNNING]


def test_a_gpu_deployment_on_a_cpu_cluster_is_named_unplaceable():
    app = application(deployment("Router", RUNNING, {"CPU": 0.1}, DeploymentStatus.HEALTHY),
                      deployment("Generator", [ReplicaState.STARTING], {"CPU": 1, "GPU": 1}))
    report = app_readiness("qvpic", app, [CPU_NODE, CPU_NODE], {"CPU": 6.0})
    assert not report.ready and report.pending == ["Generator"]
    (generator,) = [d for d in report.deployments if not d.ready]
    assert generator.unplaceable and generator.running_replicas == 0 and generator.replica_states == {"STARTING": 1}
    assert "needs CPU 1, GPU 1 on one node and no node has that (the cluster has CPU 8, GPU 0)" in generator.reason
    assert report.detail.startswith("Generator: ") and "Router" not in report.detail


def test_resources_split_across_nodes_do_not_place_a_replica():
    """Two nodes of one GPU each hold two GPUs, but not a replica that needs two on one node."""
    app = application(deployment("Generator", [ReplicaState.STARTING], {"GPU": 2}))
    report = app_readiness("qvpic", app, [{"GPU": 1.0}, {"GPU": 1.0}], {"GPU": 2.0})
    assert report.deployments[0].unplaceable and "(the cluster has GPU 2)" in report.deployments[0].reason


@pytest.mark.parametrize("free, fragment", [({"CPU": 0.5}, "other work holds it (free: CPU 0.5)"),
                                             ({"CPU": 4.0}, "replicas starting (1 starting)")])
def test_a_placeable_pending_deployment_says_what_it_waits_for(free, fragment):
    app = application(deployment("Generator", [ReplicaState.STARTING], {"CPU": 1}, message="slow __init__"))
    (generator,) = app_readiness("qvpic", app, [CPU_NODE], free).deployments
    assert not generator.ready and not generator.unplaceable
    assert fragment in generator.reason and generator.reason.endswith("[Serve: slow __init__]")


def test_ready_when_every_deployment_runs_and_not_while_deleting():
    deployments = [deployment("Router", RUNNING, {"CPU": 0.1}, DeploymentStatus.HEALTHY),
                   deployment("Generator", RUNNING + [ReplicaState.STARTING], {"CPU": 1}, DeploymentStatus.UPSCALING),
                   deployment("Idle", [], {"CPU": 1}, DeploymentStatus.HEALTHY, target=0)]  # scaled to zero
    running = app_readiness("qvpic", application(*deployments, status=ApplicationStatus.RUNNING), [CPU_NODE], {})
    assert running.ready and running.pending == [] and running.detail is None
    deleting = app_readiness("qvpic", application(*deployments, status=ApplicationStatus.DELETING), [CPU_NODE], {})
    assert not deleting.ready and "being deleted" in deleting.detail
    absent = app_readiness("qvpic", None, [CPU_NODE], {})
    assert not absent.ready and absent.detail == "application 'qvpic' is not deployed"


def overview(app_status, *statuses):
    """The fields of Serve's StatusOverview that the gate's cheap check reads."""
    return SimpleNamespace(app_status=SimpleNamespace(status=app_status), deployment_statuses=[
        SimpleNamespace(name=f"d{i}", status=s) for i, s in enumerate(statuses)])


@pytest.mark.parametrize("app_status", list(ApplicationStatus))
@pytest.mark.parametrize("statuses", [
    (DeploymentStatus.HEALTHY,) * 2, (DeploymentStatus.HEALTHY, DeploymentStatus.UPSCALING),
    (DeploymentStatus.DOWNSCALING,), (DeploymentStatus.UPDATING,), (DeploymentStatus.UNHEALTHY,),
    (DeploymentStatus.DEPLOY_FAILED,), ()])
def test_the_gates_cheap_check_calls_ready_only_what_the_full_report_calls_ready(app_status, statuses):
    """The gate reads Serve's status overview and fetches the full details only when it is not all healthy: a
    deployment scaling up from zero (UPSCALING, nothing running) or still starting must not pass as ready. The
    expected verdicts are written out here: ready only for a RUNNING application whose deployments are all HEALTHY."""
    assert all_healthy(overview(app_status, *statuses)) == (
        app_status == ApplicationStatus.RUNNING and bool(statuses)
        and all(s == DeploymentStatus.HEALTHY for s in statuses))
    if all_healthy(overview(app_status, *statuses)):  # and the full report agrees for every replica count a
        for target in (0, 1, 3):                      # HEALTHY deployment can have (running == target)
            deployments = [deployment(f"d{i}", RUNNING * target, {"CPU": 1}, s, target=target)
                           for i, s in enumerate(statuses)]
            assert app_readiness("qvpic", application(*deployments, status=app_status), [CPU_NODE], {}).ready


def test_a_failed_deployment_reports_serves_message():
    app = application(deployment("Generator", [], {"CPU": 1}, DeploymentStatus.DEPLOY_FAILED,
                                 message="replica constructor raised OSError"), status=ApplicationStatus.DEPLOY_FAILED)
    report = app_readiness("qvpic", app, [CPU_NODE], {"CPU": 4.0})
    assert not report.ready and "Generator: deploy failed [Serve: replica constructor raised OSError]" in report.detail


# ---- the gate: 503 at once while a deployment is pending, in each route's error shape ----------------
class FakeController:
    """Stands in for the Serve controller: readiness flips with `ready`, and every fetch is counted."""

    def __init__(self):
        self.ready, self.fetches, self.fail = False, 0, False

    def __call__(self, app_name: str) -> Readiness:
        self.fetches += 1
        if self.fail:
            raise ConnectionError("controller unreachable")
        app = application(deployment("Router", RUNNING, {"CPU": 0.1}, DeploymentStatus.HEALTHY),
                          deployment("Generator", RUNNING if self.ready else [ReplicaState.STARTING], {"GPU": 1}),
                          status=ApplicationStatus.RUNNING if self.ready else ApplicationStatus.DEPLOYING)
        return app_readiness(app_name, app, [CPU_NODE], {"CPU": 4.0})


@pytest.fixture
def gated(roles, serving_store):
    args = AppConfig(store={"uri": serving_store.uri}, model=serving_store.model, router={"max_chunks": MAX_CHUNKS},
                     ingress={"default_top_k": 2})
    app = make_api(InProcessBackend(roles.router, roles.loader, roles.generator), api_spec(args))
    controller, rejected = FakeController(), []
    install_readiness(app, ReadinessProbe("qvpic", controller, refresh_s=0.0),
                      lambda request, status: rejected.append((request.url.path, status)))
    return SimpleNamespace(app=app, controller=controller, rejected=rejected)


def test_requests_fail_fast_with_503_while_a_deployment_is_pending(gated):
    app = gated.app
    readyz = call(app, "GET", "/readyz")
    assert readyz.status_code == 503 and readyz.json()["pending"] == ["Generator"]
    assert [d.name for d in Readiness.model_validate(readyz.json()).deployments if d.unplaceable] == ["Generator"]
    for path, body in (("/v1/answer", ANSWER), ("/v1/estimate", ANSWER), ("/v1/chat/completions", CHAT)):
        response = call(app, "POST", path, json=body)
        assert response.status_code == 503 and response.headers["retry-after"] == "5", (path, response.text)
        message = response.json()["error"]["message"] if path.startswith("/v1/chat/") else response.json()["detail"]
        assert message.startswith("not ready: Generator: one replica needs GPU 1 on one node"), message
    assert call(app, "GET", "/v1/store").status_code == 503  # the loader's cache statistics
    for path in ("/healthz", "/v1/models", "/openapi.json", "/metrics"):  # the ingress answers these alone
        assert path in INGRESS_ONLY_PATHS and call(app, "GET", path).status_code == 200, path
    assert ("/v1/answer", 503) in gated.rejected

    gated.controller.ready = True
    readyz = call(app, "GET", "/readyz")
    assert readyz.status_code == 200 and readyz.json()["ready"] and readyz.json()["pending"] == []
    assert call(app, "POST", "/v1/answer", json=ANSWER).status_code == 200
    assert call(app, "POST", "/v1/chat/completions", json=CHAT).status_code == 200


def test_readiness_detail_goes_only_to_a_key_when_keys_are_configured(roles, serving_store):
    """With keys, `/readyz` stays open (a probe has no key) but tells a keyless caller only ready or not; the gate's
    503 (which answers before the key check) names no deployment either. A valid key reads everything."""
    from serve.governance import key_digest
    from tests.serve.governance.test_budget import governed_app

    app, governor = governed_app(roles, serving_store, auth={"api_key_sha256": {key_digest("key-acme-1"): "acme"}})
    install_readiness(app, ReadinessProbe("qvpic", FakeController(), refresh_s=0.0), governor.rejected,
                      auth=governor.auth)
    internals = ("Generator", "GPU", "CPU", "replica")
    for headers in ({}, {"Authorization": "Bearer wrong-key"}):
        readyz = call(app, "GET", "/readyz", headers=headers)
        assert readyz.status_code == 503 and readyz.json()["ready"] is False
        assert readyz.json()["pending"] == [] and readyz.json()["deployments"] == []
        assert not any(word in readyz.text for word in internals), readyz.text
        gate = call(app, "POST", "/v1/answer", json=ANSWER, headers=headers)
        assert gate.status_code == 503 and not any(word in gate.text for word in internals), gate.text
    key = {"Authorization": "Bearer key-acme-1"}
    readyz = call(app, "GET", "/readyz", headers=key)
    assert readyz.status_code == 503 and readyz.json()["pending"] == ["Generator"]
    assert "one replica needs GPU 1" in readyz.json()["detail"]
    gate = call(app, "POST", "/v1/answer", json=ANSWER, headers=key)
    assert gate.status_code == 503 and "Generator: one replica needs GPU 1" in gate.json()["detail"]


def test_an_unreachable_controller_fails_readiness_but_not_traffic(gated):
    gated.controller.fail = True
    readyz = call(gated.app, "GET", "/readyz")
    assert readyz.status_code == 503 and "ConnectionError: controller unreachable" in readyz.json()["detail"]
    assert call(gated.app, "POST", "/v1/answer", json=ANSWER).status_code == 200


def test_readiness_is_fetched_at_most_once_per_refresh_interval():
    controller = FakeController()
    probe = ReadinessProbe("qvpic", controller, refresh_s=3600.0)

    async def many() -> list[Readiness]:
        return await asyncio.gather(*(probe.get() for _ in range(20)))

    reports = asyncio.run(many())
    assert controller.fetches == 1 and all(r is reports[0] for r in reports)


def test_a_stale_ready_report_answers_at_once_while_it_is_refreshed():
    controller = FakeController()
    controller.ready = True
    probe = ReadinessProbe("qvpic", controller, refresh_s=0.0)

    async def scenario() -> tuple[Readiness, Readiness, Readiness]:
        first = await probe.get()  # nothing cached: fetched
        controller.ready = False
        stale = await probe.get()  # said ready, now stale: returned at once, refreshed behind it
        await probe._background
        return first, stale, await probe.get()  # said not ready: refreshed before it is returned

    first, stale, after = asyncio.run(scenario())
    assert first.ready and stale is first and not after.ready and after.pending == ["Generator"]
    assert controller.fetches == 3


# ---- the shipped Serve configs -----------------------------------------------------------------------

def config_args(name: str) -> dict:
    return yaml.safe_load((REPO / "serve" / name).read_text())["applications"][0]["args"]


def first_replicas_demand(args: dict) -> tuple[dict[str, float], list[dict[str, float]]]:
    """What the first replica of every deployment asks for, summed, and each deployment's per-replica demand."""
    app = AppConfig.model_validate(args)
    total: dict[str, float] = {}
    per_replica = []
    for deployment_args in (v for v in app.__dict__.values() if isinstance(v, DeploymentConfig)):
        options = deployment_args.options()
        replicas = (options["autoscaling_config"]["min_replicas"] if "autoscaling_config" in options
                    else options["num_replicas"])
        demand = {"CPU": options["ray_actor_options"]["num_cpus"], "GPU": options["ray_actor_options"]["num_gpus"]}
        per_replica.append(demand)
        for name, amount in demand.items():
            total[name] = total.get(name, 0.0) + replicas * amount
    return total, per_replica


def test_serve_config_runs_on_one_cpu_only_node_and_the_gpu_variant_differs_only_in_placement():
    """... and in three defaults made for a GPU: bfloat16, the batch's KV cap sized from the GPU's free memory (null)
    where the CPU config fixes 4 GiB (issue 59), and vLLM's engine (issue 58; qvpic's is the CPU config's)."""
    cpu, gpu = config_args("config.yaml"), config_args("config-gpu.yaml")
    assert (cpu["model"]["dtype"], gpu["model"]["dtype"]) == ("float32", "bfloat16")
    assert (cpu["generator"]["engine"]["max_kv_nbytes"], gpu["generator"]["engine"]["max_kv_nbytes"]) == (4 << 30, None)
    assert ("kind" not in cpu["generator"]["engine"], gpu["generator"]["engine"].pop("kind")) == (True, "vllm")
    gpu["model"]["dtype"] = cpu["model"]["dtype"]
    gpu["generator"]["engine"]["max_kv_nbytes"] = cpu["generator"]["engine"]["max_kv_nbytes"]
    total, per_replica = first_replicas_demand(cpu)
    assert fits(total, {"CPU": 2.0}) and total["GPU"] == 0, total  # `ray start --head` on a 2-core machine
    assert all(fits(demand, {"CPU": 2.0}) for demand in per_replica)
    assert gpu["generator_deployment"]["num_gpus"] == 1 and first_replicas_demand(gpu)[0]["GPU"] == 1
    gpu["generator_deployment"]["num_gpus"] = cpu["generator_deployment"]["num_gpus"]
    # on GPU nodes the host LRU sits in each generator (docs/BENCHMARKS.md `affinity`); one node has one anyway
    assert (cpu["loader_placement"], gpu.pop("loader_placement")) == ("deployment", "in_generator")
    cpu.pop("loader_placement")
    assert gpu == cpu  # nothing else may drift between the two


def test_a_request_waits_only_for_the_deployments_its_route_uses():
    """A node lost with the only Inspector replica must not take answers down (issue 38: 540 × 503 while a
    generator was serving), nor a generator still starting the inspector page. Control: each route is held
    back by its own deployment."""
    def report(inspector, generator, status=ApplicationStatus.DEPLOYING):
        app = application(deployment("Router", RUNNING, {"CPU": 0.1}, DeploymentStatus.HEALTHY),
                          deployment("Generator", generator, {"CPU": 1}, target=2),
                          deployment("Inspector", inspector, {"CPU": 0.1}), status=status)
        return app_readiness("qvpic", app, [CPU_NODE], {"CPU": 0.0})

    starting = [ReplicaState.STARTING]
    no_inspector = report(starting, [ReplicaState.RUNNING, ReplicaState.STARTING])  # one of two generators up
    assert not no_inspector.ready and no_inspector.pending == ["Inspector"]
    for path in ("/v1/chat/completions", "/v1/answer", "/v1/store"):
        assert holding_back(no_inspector, path) is None, path
    assert holding_back(no_inspector, "/ui/api/page").startswith("Inspector: ")
    no_generator = report(RUNNING, starting)
    assert holding_back(no_generator, "/ui/api/page") is None and holding_back(no_generator, "/ui") is None
    assert holding_back(no_generator, "/v1/chat/completions").startswith("Generator: ")
    assert holding_back(no_generator, "/uix") is not None  # not an inspector route
    deleting = report(RUNNING, RUNNING, status=ApplicationStatus.DELETING)
    assert holding_back(deleting, "/v1/answer") and holding_back(deleting, "/ui/api/page")
