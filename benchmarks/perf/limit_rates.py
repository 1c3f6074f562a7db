"""The machine's own limits, measured for benchmarks/perf/limits.py: memory bandwidth, matrix-product rates at a
decoder layer's shapes, the bytes a one-token forward reads, and the timer they share (synchronising a GPU)."""

from __future__ import annotations

import statistics
import time

import torch

from pipeline.runtime.fused import Projection, language_model
from schemas.config import DType, ForwardSpec

GIB = 1 << 30
ROWS = (1, 2, 4, 8, 16, 21, 32, 64, 512)  # product rows measured; 512: the long turn's


DEVICE = torch.device("cpu")  # set by main (--device)


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def median_s(fn, repeats: int) -> float:
    fn()  # warm-up: first-call allocations, oneDNN primitive creation
    times = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def bandwidth(repeats: int) -> dict[str, float]:
    """GB/s of a copy (bytes read + written) and of a read (bytes read) of a 1 GiB float32 array. The read is
    the faster of a sum and a one-row product with the array as a `[16384, 16384]` matrix (what a one-token
    forward does to its weights): on this CPU the product streams ~20% faster than the sum."""
    src = torch.ones(GIB // 4, device=DEVICE)
    dst = torch.empty_like(src)
    copy_s = median_s(lambda: dst.copy_(src), repeats)
    matrix, row = src.view(16384, 16384), torch.ones(1, 16384, device=DEVICE)
    read_s = min(median_s(lambda: src.sum(), repeats), median_s(lambda: torch.nn.functional.linear(row, matrix),
                                                                 repeats))
    return {"copy": 2 * GIB / copy_s / 1e9, "read": GIB / read_s / 1e9}


def layer_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's products as the fused forward runs them: QKV, O, gate/up, down."""
    config = language_model(model).config
    hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = hidden // heads
    return [(hidden + 2 * kv_heads * head_dim, hidden), (hidden, hidden), (2 * config.intermediate_size, hidden),
            (hidden, config.intermediate_size)]


def product_rates(shapes: list[tuple[int, int]], repeats: int) -> dict[str, dict[int, float]]:
    """GFLOP/s of one layer's products at each row count, per kernel."""
    weights = [torch.randn(out, inp, device=DEVICE) * 0.02 for out, inp in shapes]
    kernels = {"fp32 aten": ForwardSpec(prepack=False), "fp32 prepacked": ForwardSpec(),
               "bf16 prepacked": ForwardSpec(matmul_dtype=DType.BFLOAT16)}
    rates: dict[str, dict[int, float]] = {}
    for name, spec in kernels.items():
        projections = [Projection(w, None, spec) for w in weights]
        if name == "fp32 prepacked" and projections[0].packed is not None:  # the packed path at one row too, to show
            for p in projections:  # why it is not taken there
                p.weight = None
        rates[name] = {}
        for rows in ROWS:
            xs = [torch.randn(rows, inp, device=DEVICE) for _, inp in shapes]
            seconds = median_s(lambda ps=projections, xs=xs: [p(x) for p, x in zip(ps, xs)], repeats)
            rates[name][rows] = 2 * rows * sum(o * i for o, i in shapes) / seconds / 1e9
    return rates


def weight_bytes(model: torch.nn.Module, element_size: int) -> int:
    """Bytes a one-token forward reads: the decoder's weights and the output projection (not the embedding
    table, of which it reads one row)."""
    text = language_model(model)
    params = sum(p.numel() for p in text.layers.parameters()) + model.get_output_embeddings().weight.numel()
    return params * element_size


def interleaved_ms(paths: dict, rounds: int) -> dict[str, float]:
    """Median ms of each path, run in turn round after round so that the machine's noise hits them alike."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    for round_ in range(rounds + 1):
        for name, fn in paths.items():
            sync()
            started = time.perf_counter()
            fn()
            sync()
            if round_:  # the first round warms every path up (and builds the native kernel)
                times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}
