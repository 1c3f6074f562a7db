"""The price of structured outputs and log-probabilities per token, side by side in one run (issue 36).

    python -m benchmarks.perf.structured            # bench-qwen bf16, 4 chunks, 48 new tokens; 1 and 16 clients
    python -m benchmarks.perf.structured --quick    # one request per client

The real Router, CacheLoader and Generator run in this process (serve/local.py `build_local`, as
benchmarks/perf/batching.py). At each concurrency level C, C clients send requests back to back, each its own chunk
order and question, under four decodings interleaved (the order rotates per round, so drift hits all alike):

- plain: greedy;
- json_schema: greedy, constrained to a JSON schema by llguidance (the token mask computed and applied per row
  per step, serve/engine/qvpic/sampler.py);
- tool call: greedy, constrained to a forced call of one function (schemas/tools.py `call_grammar`);
- logprobs: greedy with `top_logprobs=5` (a log-softmax and a top-k per row per step).

Reported: aggregate tokens/s, and per request the decode time per token after the first ((end − first text) /
(tokens − 1), median) — the per-token cost a schema adds, which does not depend on how long its answer is.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time

import torch

from benchmarks.tools import ttft_store
from pipeline.eval import markdown_table, write_section
from pipeline.runtime import resolve_device
from schemas.api import AnswerRequest
from schemas.config import DType, ModelSpec
from schemas.modes import Mode
from schemas.render import RenderSpec
from schemas.sampling import Sampling
from schemas.tools import FunctionDef, call_grammar, json_grammar
from serve import build_local
from serve.engine import Generator

TARGET_AT_16 = 1.15  # json_schema's decode time per token ≤ 1.15× plain's at 16 clients (issue 36)
SCHEMA = {"type": "object", "properties": {
    "part": {"type": "string", "maxLength": 24}, "ships": {"type": "boolean"},
    "notes": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 6}},
    "required": ["part", "ships", "notes"]}
TOOL = FunctionDef(name="ship_date", parameters={"type": "object", "properties": {
    "part": {"type": "string", "maxLength": 24}, "express": {"type": "boolean"}}, "required": ["part", "express"]})


def decodings(new_tokens: int) -> dict[str, Sampling]:
    return {"plain": Sampling(max_new_tokens=new_tokens),
            "json_schema": Sampling(max_new_tokens=new_tokens, grammar=json_grammar(json.dumps(SCHEMA))),
            "tool call": Sampling(max_new_tokens=new_tokens, grammar=call_grammar([TOOL], parallel=False),
                                  grammar_param="tools"),
            "logprobs top 5": Sampling(max_new_tokens=new_tokens, logprobs=5)}


async def run_level(generator: Generator, plans: list, concurrency: int, sampling: Sampling) -> dict:
    per_token_ms, tokens = [], 0

    async def client(mine: list[int]) -> None:
        nonlocal tokens
        for index in mine:
            first, count = None, 0
            async for event in generator.stream(plans[index], sampling):
                if isinstance(event, str):
                    first = time.perf_counter() if first is None else first
                    continue
                count = event.report.usage.completion_tokens
            tokens += count
            if first is not None and count > 1:
                per_token_ms.append((time.perf_counter() - first) * 1e3 / (count - 1))

    started = time.perf_counter()
    await asyncio.gather(*(client(list(range(i, len(plans), concurrency))) for i in range(concurrency)))
    return {"tokens_per_s": tokens / (time.perf_counter() - started), "per_token_ms": per_token_ms,
            "tokens": tokens / len(plans)}


def measure(uri: str, spec: ModelSpec, chunk_ids: list[str], query: str, args, rounds: int) -> str:
    stack = build_local({"store": uri, "model": spec.model_dump(), "router": {"max_chunks": 64},
                         "loader": {"max_nbytes": 4 << 30}})
    router, generator = stack.router, stack.generator
    variants = decodings(args.new_tokens)
    most = max(args.concurrency)

    def plan(i: int):
        ids = chunk_ids[i % len(chunk_ids):] + chunk_ids[:i % len(chunk_ids)]
        return asyncio.run(router.plan(AnswerRequest(query=f"{query} (request {i})", chunk_ids=ids, mode=Mode.QVPIC,
                                                     max_new_tokens=args.new_tokens)))

    plans = [plan(i) for i in range(most)]
    for sampling in variants.values():  # warm-up: compile every grammar path and the batch shapes once
        asyncio.run(run_level(generator, plans[:2], 2, sampling))
    results: dict[tuple[int, str], list[dict]] = {}
    names = list(variants)
    for concurrency in args.concurrency:
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                level = asyncio.run(run_level(generator, plans[:concurrency], concurrency, variants[name]))
                results.setdefault((concurrency, name), []).append(level)
                print(f"x{concurrency:<3} {name:>15} {level['tokens_per_s']:6.1f} tokens/s, "
                      f"{statistics.median(level['per_token_ms']):.1f} ms/token", flush=True)
    stack.close()
    return table(results, spec, args, rounds)


def table(results: dict, spec: ModelSpec, args, rounds: int) -> str:
    rows, verdict = [], ""
    for concurrency in args.concurrency:
        base = None
        for name in decodings(args.new_tokens):
            levels = results[(concurrency, name)]
            ms = statistics.median([m for lv in levels for m in lv["per_token_ms"]])
            tps = statistics.median([lv["tokens_per_s"] for lv in levels])
            base = ms if name == "plain" else base
            rows.append([concurrency, name, round(statistics.mean([lv["tokens"] for lv in levels]), 1),
                         round(tps, 1), round(ms, 1), f"{ms / base:.2f}×"])
            if concurrency == 16 and name == "json_schema":
                verdict = (f"\n\nTarget: json_schema ≤ {TARGET_AT_16}× plain's decode time per token at 16 clients — "
                           f"measured {ms / base:.2f}× ({'met' if ms / base <= TARGET_AT_16 else 'missed'}).")
    flags = sorted({f for f in open("/proc/cpuinfo").read().split() if f.startswith(("avx512", "amx", "avx2"))}) \
        if platform.system() == "Linux" else []
    return (f"{spec.path} {spec.dtype.value} on {spec.device} ({torch.get_num_threads()} torch threads; CPU flags "
            f"{' '.join(flags) or 'n/a'}), {args.chunks} chunks per request in qvpic mode, up to {args.new_tokens} "
            f"new tokens, greedy; {rounds} round(s) per level, the four decodings interleaved.\n\n"
            + markdown_table(["clients", "decoding", "tokens per answer", "tokens/s", "decode ms/token (p50)",
                              "vs plain"], rows) + verdict
            + "\n\nA constrained answer ends when its JSON does, so its tokens per answer differ; the per-token "
              "decode time is the comparable figure. The mask is llguidance's (computed on the engine thread per "
              "row per step, then applied to the row's logits).")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="qvpic bench structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one round per level")
    p.add_argument("--model", default="bench-qwen")
    p.add_argument("--dtype", type=DType, default=DType.BFLOAT16, choices=[d.value for d in DType])
    p.add_argument("--device", default="auto")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-write", action="store_true", help="do not update docs/BENCHMARKS.md")
    args = p.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    command = ("python -m benchmarks.perf.structured " + " ".join(argv)).strip()
    spec = ModelSpec(path=args.model, dtype=args.dtype, device=str(resolve_device(args.device)))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="qvpic-structured-") as workdir:
        bench = ttft_store.build(workdir, spec, RenderSpec(), 256, args.chunks)
        body = measure(bench.uri, spec, list(bench.chunk_ids), bench.query, args, rounds)
    body += f"\n\nWall time {time.perf_counter() - started:.0f} s."
    print(body, flush=True)
    if not args.no_write:
        write_section("structured", "Structured outputs and logprobs: the cost per token (issue 36)", command, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
