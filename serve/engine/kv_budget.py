"""The batch's KV cap when the config leaves it to the device (`generator.engine.max_kv_nbytes: null`): on a GPU a
share of the memory free once the weights are loaded, less the device tiers' bounds (the hot tier of chunk KV and
the prefix cache's device tier fill up later, as requests come); on a CPU the fixed default, host memory not being
the generator's alone. Measured once, when the engine starts, before it allocates anything."""

from __future__ import annotations

from collections.abc import Callable

import torch

from schemas.config import CPU_MAX_KV_NBYTES, EngineConfig

# The rest of the free memory is for what a step allocates beside the slab (activations of a prefill of
# max_prefill_tokens, logits) and the caching allocator's fragmentation.
FREE_FRACTION = 0.8


def free_device_nbytes(device: torch.device) -> int:
    free, _total = torch.cuda.mem_get_info(device)
    return free


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
