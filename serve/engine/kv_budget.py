"""The batch's KV cap when the config leaves it to the device (`generator.engine.max_kv_nbytes: null`): on a GPU a
share of the memory free once the weights are loaded, less the device tiers' bounds (the hot tier of chunk KV and
the prefix cache's device tier fill up later, as requests come); on a CPU the fixed default, host memory not being
the generator's alone. Measured once, when the engine starts, before it allocates anything.

vLLM's engine sizes its own KV cache from a share of the device (`gpu_memory_utilization`: its weights, its
activations' peak and CUDA graphs come out of that share first, measured by its own profiling run): `device_share`
gives it the same share of what is free, as a fraction of the device's total, which is what vLLM takes."""

from __future__ import annotations

from collections.abc import Callable

import torch

from schemas.config import CPU_MAX_KV_NBYTES, EngineConfig

# The rest of the free memory is for what a step allocates beside the slab (activations of a prefill of
# max_prefill_tokens, logits) and the caching allocator's fragmentation.
FREE_FRACTION = 0.8


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of `device` (CUDA)."""
    free, total = torch.cuda.mem_get_info(device)
    return free, total


def free_device_nbytes(device: torch.device) -> int:
    return device_memory(device)[0]


def kv_budget(config: EngineConfig, device: torch.device,
              free: Callable[[torch.device], int] = free_device_nbytes) -> int:
    """`config.max_kv_nbytes` when set; else what `device` leaves for the batch's KV (see the module)."""
    if config.max_kv_nbytes is not None:
        return config.max_kv_nbytes
    if device.type != "cuda":
        return CPU_MAX_KV_NBYTES
    free_nbytes = free(device)
    tiers = config.hot_tier_nbytes + config.prefix_cache.device_nbytes
    budget = int((free_nbytes - tiers) * FREE_FRACTION)
    if budget <= 0:
        raise RuntimeError(f"max_kv_nbytes: null leaves no device memory for the batch's KV: {free_nbytes} bytes free "
                           f"after the weights, the device tiers may take {tiers} (engine.hot_tier_nbytes + "
                           "engine.prefix_cache.device_nbytes): lower those, or set engine.max_kv_nbytes")
    return budget


def sized(config: EngineConfig, device: torch.device,
          free: Callable[[torch.device], int] = free_device_nbytes) -> EngineConfig:
    """`config` with its KV cap a number, what the engine is built with."""
    return config.model_copy(update={"max_kv_nbytes": kv_budget(config, device, free)})


def device_share(config: EngineConfig, device: torch.device,
                 memory: Callable[[torch.device], tuple[int, int]] = device_memory) -> float:
    """vLLM's `gpu_memory_utilization` for `max_kv_nbytes: null` on a GPU: the share `kv_budget` would give the
    batch, of the memory free after what this process holds on the device already (the template prefix's KV; the
    tiers' bounds are taken off), as a fraction of the device's total. vLLM refuses to start when less than it is
    free. qvpic's copy of the weights is not on the device under vLLM's engine (ModelSpec.weights: host, the
    generator's choice there), so it takes nothing from this share; set `weights: device` and it would."""
    free_nbytes, total_nbytes = memory(device)
    budget = kv_budget(config, device, lambda _device: free_nbytes)  # refuses tiers larger than what is free
    return round(budget / total_nbytes, 4)


def vllm_kv_cache_size(config: EngineConfig, device: torch.device,
                       memory: Callable[[torch.device], tuple[int, int]] = device_memory) -> dict:
    """vLLM's KV cache size argument: `max_kv_nbytes` split across the ranks (vLLM takes it per worker), as qvpic's
    engine takes it; left to the device (null): on a GPU the share of its memory vLLM may size itself in
    (`device_share`), on a CPU the fixed default (host memory is not the generator's alone)."""
    ranks = config.tensor_parallel_size
    if config.max_kv_nbytes is not None:
        return {"kv_cache_memory_bytes": config.max_kv_nbytes // ranks}
    if device.type != "cuda":
        return {"kv_cache_memory_bytes": CPU_MAX_KV_NBYTES // ranks}
    return {"gpu_memory_utilization": device_share(config, device, memory)}
