"""vLLM's engine arguments for a generator's checkpoint and `EngineConfig`, and the CPU binding of its ranks."""

from __future__ import annotations

import os

from pipeline.runtime import VLM
from schemas.config import EngineConfig
from serve.engine.kv_budget import vllm_kv_cache_size

MAX_MODEL_LEN = 32768  # tokens: prompt and answer, capped by the checkpoint's own


def engine_args(vlm: VLM, config: EngineConfig) -> dict:
    """vLLM's engine arguments for this generator's checkpoint (its `EngineArgs` keywords)."""
    spec = vlm.spec
    return dict(model=str(vlm.path), dtype=spec.dtype.value, seed=0, enable_prefix_caching=True,
                max_num_seqs=config.max_batch_size, max_num_batched_tokens=max(config.max_prefill_tokens, 2048),
                max_model_len=min(MAX_MODEL_LEN, getattr(vlm.model.config, "max_position_embeddings", MAX_MODEL_LEN)),
                **vllm_kv_cache_size(config, vlm.device),
                enable_mm_embeds=True, limit_mm_per_prompt={"image": 64, "video": 0},
                mm_processor_kwargs={"min_pixels": spec.min_pixels, "max_pixels": spec.max_pixels},
                tensor_parallel_size=config.tensor_parallel_size,
                # one rank: in this process; more: vLLM's worker processes (its Ray executor refuses a CPU platform)
                distributed_executor_backend="uni" if config.tensor_parallel_size == 1 else "mp",
                structured_outputs_config={"backend": "guidance"},  # llguidance, as qvpic's engine: the same grammars
                kv_transfer_config={"kv_connector": "QvpicConnector", "kv_role": "kv_both",
                                    "kv_connector_module_path": "serve.engine.vllm.connector"})


def cpu_binding(ranks: int) -> str:
    """vLLM's `VLLM_CPU_OMP_THREADS_BIND` for `ranks` CPU ranks: this process's cores split evenly, one list a rank
    (vLLM's own "auto" binds a NUMA node a rank, and refuses more ranks than nodes)."""
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // ranks
    if share == 0:
        raise ValueError(f"engine.tensor_parallel_size {ranks} needs a core a rank; this replica has {len(cores)}")
    return "|".join(",".join(map(str, cores[r * share:(r + 1) * share])) for r in range(ranks))
