"""`qvpic demo`: the whole product on one machine, on embedded defaults.

Ingest the bundled corpus into a local store (Ray Data), start the Serve application on loopback, ask
the bundled questions over HTTP in qvpic mode, time one question in every mode side by side, and shut
down. The default model is the offline tiny Qwen2.5-VL with random weights, so answers are noise:
the demo shows the machinery (routing, tiers, tokens, TTFT); point `--model` at a real checkpoint for
real answers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from jobs.cluster import init_ray
from jobs.ingest import print_summary
from pipeline.ingest import IngestConfig, ingest
from schemas.config import Mode, ModelSpec
from schemas.store import StoreSpec

DATA = Path(__file__).resolve().parent / "data"


def ask(client: httpx.Client, body: dict) -> dict:
    response = client.post("/v1/answer", json=body)
    if response.status_code != 200:
        raise RuntimeError(f"/v1/answer answered {response.status_code}: {response.text}")
    return response.json()


def questions_table(client: httpx.Client, questions: list[dict], top_k: int) -> Table:
    table = Table(title=f"qvpic mode: top-{top_k} retrieval, relevance-routed tiers, query-only prefill")
    for column in ("question", "gold doc retrieved", "high/low", "context tokens", "TTFT ms", "answer (tiny model)"):
        table.add_column(column, no_wrap=column != "question", max_width=48 if column == "question" else 24,
                         overflow="ellipsis")
    for q in questions:
        r = ask(client, {"query": q["question"], "top_k": top_k, "max_new_tokens": 8})
        tiers = [c["tier"] for c in r["chunks"]]
        retrieved = {c["doc_id"] for c in r["chunks"]}
        gold = "yes" if retrieved & set(q["doc_ids"]) else "no"
        table.add_row(q["question"], gold, f"{tiers.count('high')}/{tiers.count('low')}",
                      str(r["usage"]["context_tokens"]), f"{r['timings']['prefill_ms']:.1f}", repr(r["answer"]))
    return table


def modes_table(client: httpx.Client, question: dict, repeats: int) -> Table:
    table = Table(title=f"every mode, same request, median of {repeats}: {question['question']!r}")
    for column in ("mode", "context tokens", "cached tokens", "TTFT ms", "× qvpic"):
        table.add_column(column)
    rows = {}
    for mode in Mode:
        runs = [ask(client, {"query": question["question"], "doc_ids": question["doc_ids"], "mode": mode.value,
                             "max_new_tokens": 1}) for _ in range(repeats)]
        rows[mode] = (runs[-1]["usage"], statistics.median(r["timings"]["prefill_ms"] for r in runs))
    base = rows[Mode.QVPIC][1]
    for mode, (usage, ttft_ms) in rows.items():
        table.add_row(mode.value, str(usage["context_tokens"]), str(usage["cached_tokens"]), f"{ttft_ms:.1f}",
                      f"{ttft_ms / base:.2f}")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qvpic demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default=".qvpic/demo-store", help="local store directory (reused if present)")
    parser.add_argument("--model", default="tiny-qwen")
    parser.add_argument("--port", type=int, default=20080)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top-k", type=int, default=6, help="chunks retrieved per question")
    args = parser.parse_args(argv)
    console = Console(width=max(Console().width, 120))
    questions = [json.loads(line) for line in (DATA / "questions.jsonl").read_text().splitlines() if line.strip()]

    init_ray()
    console.rule("1. ingest the bundled corpus (Ray Data)")
    summary = ingest(IngestConfig(corpus=str(DATA / "sample_corpus.jsonl"), store=StoreSpec(uri=args.store),
                                  model=ModelSpec(path=args.model)))
    print_summary(summary, as_json=False)

    import ray
    from ray import serve

    from serve.app import AppArgs, build_app

    console.rule("2. start the Serve application")
    started = time.perf_counter()
    serve.start(http_options={"host": "127.0.0.1", "port": args.port},
                logging_config={"log_level": "WARNING", "enable_access_log": False})
    serve.run(build_app(AppArgs(store=StoreSpec(uri=args.store), model=ModelSpec(path=args.model))),
              name="qvpic", route_prefix="/")
    console.print(f"serving at http://127.0.0.1:{args.port} (OpenAPI at /docs) after {time.perf_counter() - started:.1f} s")
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=300) as client:
            console.rule("3. ask over HTTP")
            console.print(questions_table(client, questions, args.top_k))
            console.rule("4. what qvpic buys: the same request in every mode")
            console.print(modes_table(client, questions[0], args.repeats))
    finally:
        console.rule("5. shut down")
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
