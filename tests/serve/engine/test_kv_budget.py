"""`generator.engine.max_kv_nbytes: null` (serve/engine/kv_budget.py): on a GPU the batch's KV cap is 80% of the
device memory free after the weights, less the device tiers' bounds; on a CPU the fixed 4 GiB; a number is kept.
The GPU's free memory is a stand-in function here (CI has no GPU): what it would report after the weights."""

from __future__ import annotations

import pytest
import torch

from schemas.config import EngineConfig, ModelSpec, PrefixCacheSpec
from serve.config import GeneratorConfig
from serve.engine.kv_budget import kv_budget, sized
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


def test_vllms_engine_needs_a_number():
    with pytest.raises(ValueError, match="max_kv_nbytes: null"):
        GeneratorConfig(store={"uri": "/nowhere"}, model=ModelSpec(),
                        engine=EngineConfig(kind="vllm", max_kv_nbytes=None))
    GeneratorConfig(store={"uri": "/nowhere"}, model=ModelSpec(), engine=EngineConfig(max_kv_nbytes=None))


@pytest.mark.parametrize("vlm", ["tiny-qwen"], indirect=True)
def test_the_engine_caps_its_batch_with_the_measured_budget(vlm, monkeypatch):
    cpu = QvpicEngine(vlm, AUTO, start=False)
    assert cpu.config.max_kv_nbytes == cpu.scheduler.config.max_kv_nbytes == 4 * GiB
    # as on a GPU: the budget the device's free memory gives is what the scheduler holds the batch to
    monkeypatch.setattr(engine_module, "sized", lambda config, device: sized(config, CUDA, free_40_gib))
    gpu = QvpicEngine(vlm, AUTO, start=False)
    assert gpu.scheduler.config.max_kv_nbytes == int(37 * GiB * 0.8)
    assert QvpicEngine(vlm, EngineConfig(max_kv_nbytes=5 * GiB), start=False).scheduler.config.max_kv_nbytes == 5 * GiB
