"""One topology, whatever the entry point (issue 38): `qvpic serve` with only flags, `qvpic serve --config` of either
shipped config, and the KubeRay RayService place every deployment as serve/config-gpu.yaml does — the CPU
deployments on the head, the host LRU in each generator, HTTP on the head only. A run of `qvpic serve` without
`--config` once left the only router on a worker: its loss answered 203 requests 503 for 14.7 s."""

from __future__ import annotations

import warnings

import pytest
import yaml

from jobs.run_server import app_args, parser, proxy_location
from serve.config import AppConfig, Dispatch, LoaderPlacement
from serve.deployment import Placement
from tests.support.paths import REPO

ROOT = REPO
CPU_DEPLOYMENTS = ("ingress_deployment", "inspector_deployment", "router_deployment", "loader_deployment")


def placement(config: AppConfig) -> dict[str, object]:
    """Where each deployment's replicas may run, and where the host LRU lives."""
    return {"loader_placement": config.loader_placement,
            **{name: getattr(config, name).placement for name in (*CPU_DEPLOYMENTS, "generator_deployment")}}


def served(*flags: str) -> tuple[AppConfig, str]:
    ns = parser().parse_args(["--store", "/tmp/store", *flags])
    return app_args(ns), proxy_location(ns)


def shipped() -> tuple[dict, str]:
    config = yaml.safe_load((ROOT / "serve" / "config-gpu.yaml").read_text())
    return placement(AppConfig.model_validate(config["applications"][0]["args"])), config["proxy_location"]


def test_the_shipped_topology_is_head_and_in_generator():
    expected, proxy = shipped()  # a hand-written expectation, not the code's defaults read back
    assert expected == {"loader_placement": LoaderPlacement.IN_GENERATOR, "generator_deployment": Placement.ANY,
                        **{name: Placement.HEAD for name in CPU_DEPLOYMENTS}}
    assert proxy == "HeadOnly"


@pytest.mark.parametrize("flags", [(), ("--generator-gpus", "1", "--generator-replicas", "2"),
                                   ("--config", str(ROOT / "serve" / "config-gpu.yaml")),
                                   ("--config", str(ROOT / "serve" / "config.yaml"))])
def test_qvpic_serve_places_as_the_shipped_gpu_config_with_or_without_a_config(flags):
    config, proxy = served(*flags)
    expected, expected_proxy = shipped()
    if "config.yaml" in " ".join(flags) and "gpu" not in " ".join(flags):
        expected["loader_placement"] = LoaderPlacement.DEPLOYMENT  # the one-node CPU config's documented choice
    assert placement(config) == expected and proxy == expected_proxy


def test_the_rayservice_places_as_the_shipped_gpu_config():
    (manifest,) = [d for d in yaml.safe_load_all((ROOT / "serve" / "rayservice.yaml").read_text())
                   if d and d["kind"] == "RayService"]
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    config = AppConfig.model_validate(serve_config["applications"][0]["args"])
    assert (placement(config), serve_config["proxy_location"]) == shipped()


def test_a_config_written_before_the_rename_still_dispatches_with_a_warning():
    """`routing: …` (how configs said `dispatch: …` until issue 57) is read as `dispatch`, with a deprecation
    warning naming the new key; the shipped configs use the new key and warn nothing."""
    args = yaml.safe_load((ROOT / "serve" / "config-gpu.yaml").read_text())["applications"][0]["args"]
    assert args["dispatch"] == "affinity" and "routing" not in args
    old = {key: value for key, value in args.items() if key != "dispatch"} | {"routing": "default"}
    with pytest.warns(DeprecationWarning, match="`routing` is now `dispatch`"):
        assert AppConfig.model_validate(old).dispatch is Dispatch.DEFAULT
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert AppConfig.model_validate(args).dispatch is Dispatch.AFFINITY


def test_the_engine_kind_decides_whether_history_turns_retrieve():
    """vLLM's engine takes one group of chunks (its connector supplies a prompt prefix): on it a conversation's
    earlier user messages retrieve nothing, whatever the request says; qvpic's engine keeps them. `qvpic serve
    --engine vllm` sets it; the router section cannot."""
    from types import SimpleNamespace

    from schemas.api import AnswerRequest
    from serve.routing.router import Router

    def derived(*flags: str) -> AppConfig:
        return app_args(parser().parse_args(["--store", "/tmp/s", "--model", "tiny-qwen", *flags]))

    assert derived().router.history_chunks and derived("--engine", "qvpic").router.history_chunks
    vllm = derived("--engine", "vllm")
    assert vllm.generator.engine.kind.value == "vllm" and not vllm.router.history_chunks
    with pytest.raises(ValueError, match="history_chunks"):
        AppConfig.model_validate({"store": "/tmp/s", "model": {"path": "tiny-qwen"},
                                  "router": {"history_chunks": False}})
    messages = [{"role": "user", "content": "Which invoice?"}, {"role": "assistant", "content": "4471."},
                {"role": "user", "content": "When does it ship?"}]
    request = AnswerRequest(query="When does it ship?", messages=messages, top_k=2)
    groups = [Router.group_queries(SimpleNamespace(config=config.router), request) for config in (derived(), vllm)]
    assert groups == [["Which invoice?", "When does it ship?"], ["When does it ship?"]]


def test_tensor_parallel_ranks_are_vllms_and_have_the_replicas_gpus():
    """`engine.tensor_parallel_size`: refused on qvpic's engine and where the replica's GPUs are not one a rank, both
    naming the field (tests/serve/engine/vllm/test_vllm_tp.py runs two ranks)."""

    def config(engine: dict, gpus: float = 0.0) -> AppConfig:
        return AppConfig.model_validate({"store": "/tmp/s", "model": {"path": "tiny-qwen"},
                                         "generator": {"engine": engine},
                                         "generator_deployment": {"num_gpus": gpus}})

    assert config({"kind": "vllm", "tensor_parallel_size": 2}, gpus=2).generator.engine.tensor_parallel_size == 2
    assert config({"kind": "vllm", "tensor_parallel_size": 2}).generator_deployment.num_gpus == 0  # CPU ranks
    with pytest.raises(ValueError, match="engine.tensor_parallel_size"):
        config({"tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="num_gpus 1 must be generator.engine.tensor_parallel_size 2"):
        config({"kind": "vllm", "tensor_parallel_size": 2}, gpus=1)
