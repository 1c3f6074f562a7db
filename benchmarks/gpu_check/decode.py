"""A 7B-shaped decode step (Qwen2.5-VL-7B's language model, random bf16 weights) at 1 and 16 rows over 4k and 16k
columns: the engine's forward run eagerly against a CUDA-graph capture of the same forward, kernels and host syncs
per step, and the weight-and-KV bandwidth bound. Targets (issue 59): eager ≤ 1.3× its capture, ≤ 2× the bound.

The forward is the engine's (pipeline/runtime/fused.py: `rms_norm`, `rotate`, `attend`, fused QKV and gate/up),
over a static KV buffer written by `index_copy_` so that it can be captured; where the engine's module does not
import (pydantic missing), the same functions copied below run instead, and the record says which."""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from benchmarks.gpu_check.basics import SEVEN_B, TINY, time_ms
from benchmarks.gpu_check.common import Context, Record

EAGER_OVER_GRAPH, OVER_BOUND = 1.3, 2.0  # the targets


def engine_functions():
    """(rms_norm, rotate, attend, source): the engine's own where its module imports, else copies of them."""
    try:
        from pipeline.runtime.fused import attend, rms_norm, rotate
        return rms_norm, rotate, attend, "pipeline.runtime.fused"
    except ImportError as error:
        source = f"standalone copy ({error.name or error} missing)"

    def rms_norm(x, norm):  # fused.rms_norm
        weight, eps = norm
        x32 = x.to(torch.float32)
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def rotate(x, cos, sin):  # fused.rotate
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def attend(q, keys, values, mask, scale):  # fused.attend, one new token: queries stacked per kv head
        rows, heads, new, dim = q.shape
        out = F.scaled_dot_product_attention(q.reshape(rows, keys.shape[1], heads // keys.shape[1] * new, dim),
                                             keys, values, attn_mask=mask, scale=scale)
        return out.view(rows, heads, new, dim)

    return rms_norm, rotate, attend, source


class Decoder:
    """Random weights of `shape` and one decode step over a static KV buffer `[layers, 2, rows, kv, cap, d]`."""

    def __init__(self, shape: dict, capacity: int, rows: int, device, dtype):
        self.rms_norm, self.rotate, self.attend, self.source = engine_functions()
        s = self.shape = shape
        q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]

        def w(*size):
            return torch.randn(*size, device=device, dtype=dtype) * 0.02

        ones = torch.ones(s["hidden"], device=device, dtype=dtype)
        self.layers = [dict(qkv=w(q + 2 * kv, s["hidden"]), qkv_bias=w(q + 2 * kv), o=w(s["hidden"], q),
                            gate_up=w(2 * s["intermediate"], s["hidden"]), down=w(s["hidden"], s["intermediate"]),
                            input_norm=(ones, 1e-6), post_norm=(ones, 1e-6)) for _ in range(s["layers"])]
        self.embed, self.lm_head, self.norm = w(s["vocab"], s["hidden"]), w(s["vocab"], s["hidden"]), (ones, 1e-6)
        self.weight_bytes = sum(t.numel() * t.element_size() for layer in self.layers for t in
                                (layer["qkv"], layer["o"], layer["gate_up"], layer["down"])) \
            + self.lm_head.numel() * self.lm_head.element_size()
        freqs = torch.arange(capacity + 1, dtype=torch.float32)[:, None] * (
            1e6 ** (-torch.arange(0, s["head_dim"], 2, dtype=torch.float32) / s["head_dim"]))[None]
        freqs = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = freqs.cos().to(device, dtype), freqs.sin().to(device, dtype)
        self.kv = torch.randn(s["layers"], 2, rows, s["kv_heads"], capacity, s["head_dim"], device=device,
                              dtype=dtype)

    def step(self, ids, positions, column, mask):
        """Logits `[rows, vocab]`: ids/positions `[rows, 1]`, column `[1]` (where the new K/V go), mask
        `[rows, 1, 1, width]` additive. No host reads: capturable."""
        s, rows, width = self.shape, ids.shape[0], mask.shape[-1]
        heads, kv_heads, dim = s["heads"], s["kv_heads"], s["head_dim"]
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        hidden = F.embedding(ids, self.embed)
        for i, layer in enumerate(self.layers):
            x = self.rms_norm(hidden, layer["input_norm"])
            q, k, v = F.linear(x, layer["qkv"], layer["qkv_bias"]).split(
                [heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
            q = self.rotate(q.view(rows, 1, heads, dim).transpose(1, 2), cos, sin)
            k = self.rotate(k.view(rows, 1, kv_heads, dim).transpose(1, 2), cos, sin)
            keys, values = self.kv[i, 0, :rows], self.kv[i, 1, :rows]
            keys.index_copy_(2, column, k)
            values.index_copy_(2, column, v.view(rows, 1, kv_heads, dim).transpose(1, 2))
            out = self.attend(q, keys[:, :, :width], values[:, :, :width], mask, dim ** -0.5)
            hidden = hidden + F.linear(out.transpose(1, 2).reshape(rows, 1, heads * dim), layer["o"])
            x = self.rms_norm(hidden, layer["post_norm"])
            gate, up = F.linear(x, layer["gate_up"]).chunk(2, dim=-1)
            hidden = hidden + F.linear(F.silu(gate) * up, layer["down"])
        return F.linear(self.rms_norm(hidden[:, -1], self.norm), self.lm_head)


def read_bandwidth(cuda: bool, device) -> float:
    """Bytes/s the device reads (a sum over 2 GiB; 8 MiB dry): the bound's denominator, measured, not the sheet's."""
    x = torch.ones((1 << 30) if cuda else (1 << 22), dtype=torch.bfloat16, device=device)
    ms = time_ms(lambda: x.sum(), cuda, repeats=5)
    return x.numel() * 2 / (ms / 1e3)


def kernels_per_step(function, cuda: bool) -> int:
    """Kernels one step launches (device events of the profiler); on CPU the aten ops it calls, its analogue."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        function()
        if cuda:
            torch.cuda.synchronize()
    if cuda:
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def syncs_per_step(function) -> int:
    """Host syncs one step makes, by torch's sync debug mode (a warning per synchronising call)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            function()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def captured(function):
    """`function` captured into a CUDA graph (after warm-up on a side stream, as torch's docs do) and its output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            function()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = function()
    return graph, output


@torch.inference_mode()
def decode(ctx: Context, out: Record) -> None:
    cuda, device = ctx.cuda, ctx.device
    shape, widths, all_rows = (TINY, (64, 256), (1, 4)) if ctx.dry else (SEVEN_B, (4096, 16384), (1, 16))
    dtype = torch.bfloat16 if cuda else torch.float32
    decoder = Decoder(shape, max(widths), max(all_rows), device, dtype)
    bandwidth = read_bandwidth(cuda, device)
    out.set("forward", decoder.source)
    out.set("weights_gib", round(decoder.weight_bytes / 2 ** 30, 2))
    out.set("read_gb_s", round(bandwidth / 1e9, 1))
    column_bytes = shape["layers"] * 2 * shape["kv_heads"] * shape["head_dim"] * decoder.kv.element_size()
    results = []
    for rows in all_rows:
        for width in widths:
            ids = torch.randint(0, shape["vocab"], (rows, 1), device=device)
            positions = torch.full((rows, 1), width - 1, device=device)
            column = torch.tensor([width - 1], device=device)
            mask = torch.zeros(rows, 1, 1, width, device=device, dtype=dtype)
            step = functools.partial(decoder.step, ids, positions, column, mask)

            eager_ms = time_ms(step, cuda, repeats=10 if cuda else 3)
            bound_ms = (decoder.weight_bytes + rows * width * column_bytes) / bandwidth * 1e3
            row = {"rows": rows, "width": width, "eager_ms": eager_ms, "bound_ms": round(bound_ms, 3),
                   "eager_over_bound": round(eager_ms / bound_ms, 2), "kernels": kernels_per_step(step, cuda)}
            if cuda:
                row["syncs"] = syncs_per_step(step)
                graph, static = captured(step)
                graph.replay()
                expected = step()
                gap = float((static.float() - expected.float()).abs().max())
                out.check(f"graph replay = eager ({rows}x{width})", gap <= 1e-2 * float(expected.abs().max()),
                          gap=gap)
                row["graph_ms"] = time_ms(graph.replay, cuda)
                row["eager_over_graph"] = round(eager_ms / row["graph_ms"], 2)
                row["targets_met"] = (row["eager_over_graph"] <= EAGER_OVER_GRAPH and
                                      row["eager_over_bound"] <= OVER_BOUND)
                del graph, static
            else:
                row["graph"] = "skipped: CUDA graphs need a CUDA device"
            results.append(row)
            out.set("results", results)
    head = results[-1]
    out.set("headline", f"{head['rows']}x{head['width']}: eager {head['eager_ms']} ms, "
                        f"graph {head.get('graph_ms', '-')} ms, bound {head['bound_ms']} ms ({decoder.source})")
