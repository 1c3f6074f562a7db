"""The same requests before and after a change: identical answers, and TTFT within noise (issue 57 item 9; issue 21
measured its layout change this way).

    python -m benchmarks.tools.same_requests store --store DIR               # build the store both versions read
    python -m benchmarks.tools.same_requests run --store DIR --out A.json     # in each checkout, alternated
    python -m benchmarks.tools.same_requests compare OLD.json... --new NEW.json... [--write]   # the table

`run` serves a fixed set of requests through the serving roles in this process (`jobs/eval_serving.py`
`InProcessAnswerer`, which both sides of a restructuring have) and records every choice's text, completion tokens,
log-probabilities and the TTFT of each round: every serving mode over the same chunks, a three-turn conversation with
retrieval at each turn, n = 2 seeded sampled choices, a JSON-object answer, stop strings with log-probabilities. Each
round empties the device and host tiers and the prefix cache first (cold), then asks again (warm). It imports only what
both versions of the code define, so the same file runs in a checkout of the older code (copy it there).

`compare` reads the runs of each side (run them alternated, old/new/old/new, on a quiet machine): answers must be
identical (a greedy token that moved is a behaviour change, not noise); TTFT is compared as new/old medians per
request, beside each side's own spread between its runs (the noise floor on this machine).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

from schemas.api import AnswerRequest
from schemas.config import DType, ModelSpec
from schemas.modes import Mode
from schemas.render import RenderSpec
from schemas.sampling import Sampling

MODEL = "tiny-qwen"
NUM_CHUNKS = 4
MAX_NEW_TOKENS = 16
CHOICES = {"n=2 sampled": 2}  # n is a chat request's field: the native request's answers are one choice


def requests(chunk_ids: list[str], query: str) -> dict[str, AnswerRequest]:
    """The fixed set, by name."""
    named = {"chunk_ids": chunk_ids}
    out = {f"mode {m.value}": AnswerRequest(query=query, mode=m, max_new_tokens=MAX_NEW_TOKENS, **named)
           for m in Mode if m not in (Mode.QVPIC_PLAIN, Mode.QVPIC_DUMMY)}  # these two need an ablation store
    conversation = [{"role": "system", "content": "Answer from the pages."},
                    {"role": "user", "content": query},
                    {"role": "assistant", "content": "It is in the second chunk."},
                    {"role": "user", "content": "And what follows from that? " + query}]
    out["conversation"] = AnswerRequest(query=query, messages=conversation, top_k=2, max_new_tokens=MAX_NEW_TOKENS)
    out["n=2 sampled"] = AnswerRequest(query=query, temperature=0.8, top_p=0.95, seed=7,  # n: CHOICES
                                       max_new_tokens=MAX_NEW_TOKENS, **named)
    out["json object"] = AnswerRequest(query=query, response_format={"type": "json_object"},
                                       max_new_tokens=MAX_NEW_TOKENS, **named)
    out["stop + logprobs"] = AnswerRequest(query=query, stop=[".", "\n"], logprobs=True, top_logprobs=2,
                                           max_new_tokens=MAX_NEW_TOKENS, **named)
    return out


def answer_in_full(answerer, request: AnswerRequest, n: int):
    """Every choice of the answer (the generator's own call: `InProcessAnswerer` keeps only the first's text)."""
    plan = asyncio.run(answerer.router.plan(request))
    sampling = dataclasses.replace(Sampling.of(request), n=n)
    generate = answerer.generator.generate_blocking
    if "loader" in inspect.signature(generate).parameters:  # before issue 57: the loader was passed per call
        return generate(plan, sampling, loader=answerer.loader)
    return generate(plan, sampling)


def outputs(answer) -> list[dict]:
    """Each choice's text, tokens and log-probabilities (rounded: a printed float, not a bit pattern)."""
    def logprobs(choice) -> list | None:
        if choice.logprobs is None:
            return None
        return [[e.token, round(e.logprob, 4), [t.token for t in e.top_logprobs]] for e in choice.logprobs.content]
    return [{"text": c.text, "tokens": c.completion_tokens, "logprobs": logprobs(c)} for c in answer.every_choice]


def clear_everything(answerer) -> None:
    answerer.clear_caches()
    answerer.generator.clear_prefix_cache()


def run(args: argparse.Namespace) -> int:
    from jobs.eval_serving import InProcessAnswerer

    meta = json.loads((Path(args.store) / "same_requests.json").read_text())
    model = ModelSpec(path=meta["model"], dtype=DType(meta["dtype"]), device="cpu")
    answerer = InProcessAnswerer.open(args.store, model)
    named = requests(meta["chunk_ids"], meta["query"])
    record: dict = {"model": meta["model"], "dtype": meta["dtype"], "rounds": args.rounds, "requests": {}}
    for request in named.values():  # warm-up: first-call costs (grammar compiler, kernels) paid before timing
        clear_everything(answerer)
        answerer(request)
    for name, request in named.items():
        clear_everything(answerer)
        full = answer_in_full(answerer, request, CHOICES.get(name, 1))
        record["requests"][name] = {"outputs": outputs(full), "cold_ms": [], "warm_ms": []}
    for _ in range(args.rounds):
        for name, request in named.items():
            clear_everything(answerer)
            record["requests"][name]["cold_ms"].append(answerer(request).ttft_ms)
            record["requests"][name]["warm_ms"].append(answerer(request).ttft_ms)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}: {len(named)} requests × {args.rounds} rounds")
    return 0


def store(args: argparse.Namespace) -> int:
    from benchmarks.tools import ttft_store

    model = ModelSpec(path=args.model, dtype=DType(args.dtype), device="cpu")
    built = ttft_store.build(args.store, model, RenderSpec(), chunk_tokens=128, num_chunks=NUM_CHUNKS)
    (Path(args.store) / "same_requests.json").write_text(json.dumps(
        {"model": args.model, "dtype": args.dtype, "chunk_ids": list(built.chunk_ids), "query": built.query}))
    print(f"store at {args.store}: {len(built.chunk_ids)} chunks of {args.model} {args.dtype}")
    return 0


def compare(args: argparse.Namespace) -> int:
    old = [json.loads(Path(p).read_text()) for p in args.old]
    new = [json.loads(Path(p).read_text()) for p in args.new]
    names = list(old[0]["requests"])
    rows, differing = [], []
    for name in names:
        if any(r["requests"][name]["outputs"] != old[0]["requests"][name]["outputs"] for r in old + new):
            differing.append(name)
        row = [name, "yes" if name not in differing else "**no**"]
        for cache in ("cold_ms", "warm_ms"):
            a = statistics.median(v for r in old for v in r["requests"][name][cache])
            b = statistics.median(v for r in new for v in r["requests"][name][cache])
            spread = max(run_spread(old, name, cache), run_spread(new, name, cache))
            row += [f"{a:.1f}", f"{b:.1f}", f"{b / a:.2f}×", f"{spread:.2f}×"]
        rows.append(row)
    ratios = [float(r[4][:-1]) for r in rows] + [float(r[8][:-1]) for r in rows]
    from benchmarks.tools.machine import machine_line
    from pipeline.eval import markdown_table

    body = (f"Each side's runs: `python -m benchmarks.tools.same_requests run --store S --out F --rounds "
            f"{old[0]['rounds']}` in its own checkout (this file copied into the older one), over one store both read "
            f"(`same_requests store --store S --dtype {old[0]['dtype']}`), old and new alternated (old, new, new, old, "
            f"…). Machine: {machine_line()}.\n\n"
            f"{len(old)} runs of the old code and {len(new)} of the new, alternated, {old[0]['rounds']} rounds each, "
            f"{old[0]['model']} {old[0]['dtype']}, {NUM_CHUNKS} chunks. Answers identical: "
            f"{len(names) - len(differing)} of {len(names)} requests (every choice's text, tokens and "
            f"log-probabilities){'; differ: ' + ', '.join(differing) if differing else ''}. TTFT new/old, median "
            f"over the cells: {statistics.median(ratios):.2f}× (range {min(ratios):.2f}–{max(ratios):.2f}×); "
            "'spread' is the larger of the two sides' max/min between their own runs' medians: the noise floor.\n\n"
            + markdown_table(["request", "same answers", "cold old ms", "cold new ms", "cold new/old", "cold spread",
                              "warm old ms", "warm new ms", "warm new/old", "warm spread"], rows))
    print(body)
    if args.write:
        from pipeline.eval import write_section

        write_section(args.section, f"The structure change (issue 57): the same requests before and after, "
                      f"{old[0]['model']} {old[0]['dtype']}",
                      "python -m benchmarks.tools.same_requests compare " + " ".join(sys.argv[2:]), body)
    return 1 if differing else 0


def run_spread(runs: list[dict], name: str, cache: str) -> float:
    """max/min of one side's per-run medians for one request: how much the same code moves between runs."""
    medians = [statistics.median(r["requests"][name][cache]) for r in runs]
    return max(medians) / min(medians)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="same_requests", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("store", help="build the store both versions read")
    s.add_argument("--store", required=True)
    s.add_argument("--model", default=MODEL)
    s.add_argument("--dtype", default="float32", choices=[d.value for d in DType])
    r = sub.add_parser("run", help="serve the requests in this checkout, write their answers and TTFTs")
    r.add_argument("--store", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--rounds", type=int, default=5)
    c = sub.add_parser("compare", help="OLD runs, then --, then NEW runs")
    c.add_argument("old", nargs="+")
    c.add_argument("--new", nargs="+", required=True)
    c.add_argument("--write", action="store_true", help="write the section of docs/BENCHMARKS.md")
    c.add_argument("--section", default="same-requests", help="its name in docs/BENCHMARKS.md")
    args = p.parse_args(argv)
    started = time.perf_counter()
    code = {"store": store, "run": run, "compare": compare}[args.command](args)
    print(f"({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
