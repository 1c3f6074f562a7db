"""The first run on a GPU box (issue 59): is the engine correct and near its limits on CUDA, before anything else.

    python -m benchmarks.gpu_check                  # on the GPU box: ≤ 8 min, results in $OUT/gpu_check.jsonl
    python -m benchmarks.gpu_check --dry --out DIR  # every step on CPU at tiny shapes (CI: starts, gates, writes)

Each step runs in its own process under its own timeout (a hung CUDA call cannot be interrupted in-process) and
appends one JSON line the moment it ends: status ok / failed / skipped (with the missing module or the reason) /
error / timed_out, and what it measured. A step imports only what it needs: the box has PyTorch and transformers
and nothing else of ours is assumed (no Ray, no vLLM, no network, no pip). `--wheels DIR` unpacks the `.whl` files
there onto the steps' path (no pip), e.g. pydantic and Pillow for the steps that run the engine's own modules.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    name: str
    module: str  # benchmarks.gpu_check.<module>, whose function `name` runs the step
    timeout_s: int  # on the GPU; a dry run caps every step at DRY_TIMEOUT_S
    what: str


# In the order they run: the cheap checks that say whether the rest can mean anything first, the memory ceiling
# (which fills the device on purpose) last. The timeouts add up to less than the 8-minute budget.
STEPS = (
    Step("preflight", "basics", 25, "versions, device, SDPA backends available, which optional modules import"),
    Step("attention", "basics", 50, "SDPA at the engine's shapes: backend chosen, ms at widths 4k/16k/32k"),
    Step("exactness", "exactness", 90, "fused vs transformers, re-anchoring CUDA vs CPU, linked vs full, 3 families"),
    Step("decode", "decode", 120, "7B-shaped decode step: eager vs CUDA graph, kernels and syncs, bandwidth bound"),
    Step("device_paths", "device_paths", 40, "issue 59 item 1's CUDA-only paths: sampling, wire, grammar mask"),
    Step("engine", "engine", 60, "the engine end to end: 16 staggered linked requests, TTFT, ms/token, memory"),
    Step("memory", "basics", 60, "memory ceiling: KV columns that fit beside 7B weights, OOM caught and recovered"),
)
BUDGET_S = 480
DRY_TIMEOUT_S = 60
