"""`generator.engine.max_kv_nbytes: null` (serve/engine/kv_budget.py): on a GPU the batch's KV cap is 80% of the
device memory free after the weights, less the device tiers' bounds; on a CPU the fixed 4 GiB; a number is kept.
vLLM's engine is given the same share, as the fraction of the device it sizes itself in; qvpic's copy of the weights
is in host memory there (ModelSpec.weights), so it takes none of it.
The GPU's free memory is a stand-in function here (CI has no GPU): what it would report after the weights."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from schemas.config import EngineConfig, ModelSpec, PrefixCacheSpec, WeightsPlacement
from serve.config import GeneratorConfig
from serve.engine import generator as generator_module
from serve.engine.generator import load_model
from serve.engine.kv_budget import kv_budget, sized, vllm_kv_cache_size
from serve.engine.qvpic import QvpicEngine
from serve.engine.qvpic import engine as engine_module

GiB = 1 << 30
CUDA = torch.device("cuda")
AUTO = EngineConfig(max_kv_nbytes=None, hot_tier_nbytes=2 * GiB, prefix_cache=PrefixCacheSpec(device_nbytes=GiB))


def free_40_gib(device: torch.device) -> int:
    assert device == CUDA
    return 40 * GiB


def test_a_number_is_kept_and_a_cpu_gets_4_gib():
    assert kv_budget(EngineConfig(max_kv_nbytes=123), CUDA, free_40_gib) == 123
    assert kv_budget(AUTO, torch.device("cpu"), free_40_gib) == 4 * GiB  # the default before it could be null
    assert EngineConfig().max_kv_nbytes == 4 * GiB


def test_on_a_gpu_it_is_a_share_of_the_free_memory_after_the_tiers():
    # 40 GiB free after the weights; the hot tier may take 2 and the prefix cache's device tier 1: 80% of 37 GiB
    assert kv_budget(AUTO, CUDA, free_40_gib) == int(37 * GiB * 0.8)
    assert sized(AUTO, CUDA, free_40_gib).max_kv_nbytes == int(37 * GiB * 0.8)


def test_tiers_larger_than_the_free_memory_refuse_to_start():
    with pytest.raises(RuntimeError, match="hot_tier_nbytes.*prefix_cache.device_nbytes.*max_kv_nbytes"):
        kv_budget(AUTO, CUDA, lambda device: 3 * GiB)


def test_vllms_engine_sizes_itself_in_the_same_share_of_a_gpu():
    """vLLM takes a fraction of the device's total (`gpu_memory_utilization`), its weights, activations and graphs
    coming out of it: the same 80% of the 37 GiB left after the tiers, of an 80 GiB device (40 GiB free once
    qvpic's own model is loaded). A number stays a number of bytes per rank; a CPU gets the fixed 4 GiB."""
    GeneratorConfig(store={"uri": "/nowhere"}, model=ModelSpec(), engine=EngineConfig(kind="vllm", max_kv_nbytes=None))
    h100 = lambda device: (40 * GiB, 80 * GiB)  # noqa: E731
    vllm_auto = AUTO.model_copy(update={"kind": "vllm"})
    assert vllm_kv_cache_size(vllm_auto, CUDA, h100) == {"gpu_memory_utilization": round(37 * 0.8 / 80, 4)}
    assert vllm_kv_cache_size(vllm_auto, torch.device("cpu"), h100) == {"kv_cache_memory_bytes": 4 * GiB}
    two_ranks = EngineConfig(kind="vllm", max_kv_nbytes=6 * GiB, tensor_parallel_size=2)
    assert vllm_kv_cache_size(two_ranks, CUDA, h100) == {"kv_cache_memory_bytes": 3 * GiB}
    with pytest.raises(RuntimeError, match="hot_tier_nbytes"):  # tiers past what is free refuse here too
        vllm_kv_cache_size(vllm_auto, CUDA, lambda device: (3 * GiB, 80 * GiB))


@pytest.mark.parametrize("vlm", ["tiny-qwen"], indirect=True)
def test_the_engine_caps_its_batch_with_the_measured_budget(vlm, monkeypatch):
    cpu = QvpicEngine(vlm, AUTO, start=False)
    assert cpu.config.max_kv_nbytes == cpu.scheduler.config.max_kv_nbytes == 4 * GiB
    # as on a GPU: the budget the device's free memory gives is what the scheduler holds the batch to
    monkeypatch.setattr(engine_module, "sized", lambda config, device: sized(config, CUDA, free_40_gib))
    gpu = QvpicEngine(vlm, AUTO, start=False)
    assert gpu.scheduler.config.max_kv_nbytes == int(37 * GiB * 0.8)
    assert QvpicEngine(vlm, EngineConfig(max_kv_nbytes=5 * GiB), start=False).scheduler.config.max_kv_nbytes == 5 * GiB


@pytest.mark.parametrize(("weights", "share"), [(None, 0.8), (WeightsPlacement.DEVICE, 0.4)])
def test_vllms_share_counts_no_qvpic_weights_when_they_are_in_host_memory(weights, share):
    """On a (simulated) GPU twice the size of the model, free is what qvpic's VLM leaves on it: with its weights in
    host memory (vLLM's engine's default: `weights` unset) vLLM is given 80% of the whole device; with them on it
    (`weights: device`, as before issue 58), 80% of the half the model leaves."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        vlm = load_model(GeneratorConfig(store={"uri": "/nowhere"}, engine=EngineConfig(kind="vllm"),
                                         model=ModelSpec(path="tiny-qwen", device="cuda:0", weights=weights)))
    model_nbytes = sum(p.nbytes for p in vlm.model.parameters())
    total = 2 * model_nbytes

    def memory(device: torch.device) -> tuple[int, int]:
        return total - sum(p.nbytes for p in vlm.model.parameters() if p.device == device), total

    no_tiers = EngineConfig(kind="vllm", max_kv_nbytes=None, hot_tier_nbytes=0,
                            prefix_cache=PrefixCacheSpec(device_nbytes=0))
    assert vllm_kv_cache_size(no_tiers, vlm.device, memory) == {"gpu_memory_utilization": share}


def test_the_generator_keeps_its_weights_on_the_host_under_vllms_engine_only(monkeypatch):
    loaded: list[ModelSpec] = []
    monkeypatch.setattr(generator_module, "VLM", loaded.append)

    def config(kind: str, **model) -> GeneratorConfig:
        return GeneratorConfig(store={"uri": "/nowhere"}, model=ModelSpec(**model), engine=EngineConfig(kind=kind))

    for generator in (config("vllm"), config("qvpic"), config("vllm", weights="device")):
        load_model(generator)
    assert [spec.weights for spec in loaded] == [WeightsPlacement.HOST, WeightsPlacement.DEVICE,
                                                 WeightsPlacement.DEVICE]
    assert ModelSpec().weights is None  # compile jobs and the router: the device, as before (VLM's default)
    with pytest.raises(ValueError, match="model.weights: host serves vLLM's engine only"):
        config("qvpic", weights="host")
