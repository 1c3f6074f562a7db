"""`qvpic demo`: the whole product on one machine, on embedded defaults.

Ingest the bundled corpus into a local store (Ray Data), start the Serve application on loopback, ask
the bundled questions over HTTP in qvpic mode, time the same request in every mode side by side, and
shut down. The default model is the offline tiny Qwen2.5-VL with random weights, so answers are noise:
the demo shows the machinery (routing, tiers, tokens, TTFT); point `--model` at a real checkpoint for
real answers. Every timed request bypasses the response cache (`Cache-Control: no-cache`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path

from jobs import logs
from jobs.help import HelpFormatter

DATA = Path(__file__).resolve().parent / "data"
CORPUS = DATA / "sample_corpus.jsonl"
QUESTIONS = DATA / "questions.jsonl"
APP_NAME = "qvpic-demo"
NO_CACHE = {"Cache-Control": "no-cache"}  # every request computes its answer: timings are model work
# queue_ms: waiting for a row of the generator's batch (about 0 here: the demo asks one request at a time)
TTFT_PHASES = ("route_ms", "load_ms", "render_ms", "queue_ms", "reanchor_ms", "prefill_ms")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qvpic demo", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--store", default=".qvpic/demo-store", help="local store directory (reused when present)")
    p.add_argument("--model", default="tiny-qwen",
                   help="checkpoint directory, or a built-in random-weight model: tiny-qwen, tiny-glm")
    p.add_argument("--port", type=int, default=20080, help="HTTP port on 127.0.0.1 (another free one if taken)")
    p.add_argument("--repeats", type=int, default=10, help="timed requests per mode (medians), after one warm-up each")
    p.add_argument("--top-k", type=int, default=6, help="chunks retrieved per question")
    logs.add_verbose_flag(p)
    return p


def command_name() -> str:
    """How this `qvpic` was invoked (e.g. `.venv/bin/qvpic` when the venv is not activated)."""
    script, on_path = Path(sys.argv[0]), shutil.which("qvpic")
    if script.name != "qvpic" or (on_path is not None and Path(on_path).resolve() == script.resolve()):
        return "qvpic"
    relative = os.path.relpath(script)
    return relative if not relative.startswith("..") else str(script)


def free_port(preferred: int) -> int:
    """`preferred` when nothing listens on it on loopback, else a free port the OS picks."""
    for port in (preferred, 0):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return probe.getsockname()[1]
    raise OSError("no free port on 127.0.0.1")


def ask(client, body: dict) -> dict:
    response = client.post("/v1/answer", json=body)
    if response.status_code != 200:
        raise RuntimeError(f"/v1/answer answered {response.status_code}: {response.text}")
    return response.json()


def ttft_ms(reply: dict) -> float:
    """Server-timed time to first token of a computed answer: route, KV load, page render, queue, re-anchor,
    prefill."""
    if reply.get("cache_hit"):
        raise RuntimeError("a response-cache hit reached a timing table; requests must send Cache-Control: no-cache")
    return sum(reply["timings"][phase] for phase in TTFT_PHASES)


def questions_table(client, questions: list[dict], top_k: int):
    from rich.table import Table

    table = Table(title=f"qvpic mode: top-{top_k} retrieval, relevance-routed tiers, query-only prefill",
                  caption="high/low: chunks served from high- / low-resolution KV. TTFT: route + KV load + "
                          "re-anchor + query prefill, as the server timed it. The tiny model has random "
                          "weights: its answers are noise.")
    for column in ("question", "gold doc retrieved", "high/low", "context tokens", "TTFT ms", "answer (tiny model)"):
        table.add_column(column, no_wrap=column != "question", max_width=48 if column == "question" else 24,
                         overflow="ellipsis")
    for q in questions:
        r = ask(client, {"query": q["question"], "top_k": top_k, "max_new_tokens": 8})
        tiers = [c["tier"] for c in r["chunks"]]
        retrieved = {c["doc_id"] for c in r["chunks"]}
        gold = "yes" if retrieved & set(q["doc_ids"]) else "no"
        table.add_row(q["question"], gold, f"{tiers.count('high')}/{tiers.count('low')}",
                      str(r["usage"]["context_tokens"]), f"{ttft_ms(r):.1f}", repr(r["answer"]))
    return table


def modes_table(client, question: dict, modes: list[str], repeats: int, lowest_tier: str | None = None,
                clear_prefix_cache=lambda: None):
    """The same request in every mode: one warm-up round, then `repeats` rounds, modes interleaved in each
    round so that drift of a busy machine hits them alike; medians. Each request meets an empty prefix cache
    (`clear_prefix_cache` before it): a repeat would otherwise find its whole prompt cached in every mode, and the
    table would show what the prefix cache buys, not what reusing the store's chunk KV buys."""
    from rich.table import Table

    body = {"query": question["question"], "doc_ids": question["doc_ids"], "max_new_tokens": 1}
    # `uniform` defaults to the highest tier, where it equals `uniform_high`: shown at the lowest instead
    requests = {("uniform · " + lowest_tier if mode == "uniform" and lowest_tier else mode):
                {**body, "mode": mode, **({"tier": lowest_tier} if mode == "uniform" and lowest_tier else {})}
                for mode in modes}
    replies: dict[str, list[dict]] = {label: [] for label in requests}
    for round_index in range(repeats + 1):
        for label, request in requests.items():
            clear_prefix_cache()
            reply = ask(client, request)
            if round_index:
                replies[label].append(reply)
    ttft = {mode: statistics.median(ttft_ms(r) for r in runs) for mode, runs in replies.items()}
    prefill = {mode: statistics.median(r["timings"]["prefill_ms"] for r in runs) for mode, runs in replies.items()}
    base = ttft.get("qvpic")
    table = Table(title=f"every mode, same request ({question['question']!r}), median of {repeats}",
                  caption="TTFT: route (embed the query, rank the chunks) + KV load + page render + re-anchor + "
                          "prefill, as the server timed them for a one-token answer; prefill ms is the model's "
                          "share. × qvpic: the mode's TTFT divided by qvpic's — 2.00 means twice as slow as "
                          "qvpic, below 1 faster. Cached tokens: context whose KV came from the store instead of "
                          "a forward pass (each request met an empty prefix cache: repeats of a request are "
                          "served from it in every mode, docs/DEPLOY.md). The tiny model computes in "
                          "milliseconds, so routing and KV loading weigh more here than with a real 7B model, where "
                          "prefill dominates "
                          "(docs/BENCHMARKS.md).")
    for column in ("mode", "context tokens", "cached tokens", "prefill ms", "TTFT ms", "× qvpic"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for mode, runs in replies.items():
        usage = runs[-1]["usage"]
        ratio = f"{ttft[mode] / base:.2f}" if base else "–"
        table.add_row(mode, str(usage["context_tokens"]), str(usage["cached_tokens"]), f"{prefill[mode]:.1f}",
                      f"{ttft[mode]:.1f}", ratio)
    return table


def cache_hit_line(client, question: dict, top_k: int) -> str:
    """The first question twice without `no-cache`: the first fills the response cache (a `no-cache` request
    never writes it), the second is answered from it and says so."""
    body = {"query": question["question"], "top_k": top_k, "max_new_tokens": 8}
    client.post("/v1/answer", json=body, headers={"Cache-Control": ""}).raise_for_status()
    started = time.perf_counter()
    response = client.post("/v1/answer", json=body, headers={"Cache-Control": ""})
    client_ms = (time.perf_counter() - started) * 1e3
    reply = response.json()
    if response.status_code != 200 or not reply.get("cache_hit"):
        return (f"asked again without Cache-Control: no-cache, the first question was computed again "
                f"({client_ms:.0f} ms)")
    return (f"asked again without `Cache-Control: no-cache`, the first question came from the response cache "
            f"(level {reply['response_cache']['level']}, `cache_hit: true`) in {client_ms:.1f} ms over HTTP, "
            f"with no model work (its timings report no load, prefill or decode).")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logs.configure(args.verbose)
    import httpx
    from rich.console import Console

    from jobs.cluster import init_ray
    from jobs.ingest import print_summary
    from pipeline.ingest import IngestConfig, ingest
    from schemas.config import ModelSpec
    from schemas.store import StoreSpec

    console = Console(width=max(Console().width, 120))
    questions = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    num_documents = sum(1 for line in CORPUS.read_text().splitlines() if line.strip())
    port = free_port(args.port)

    console.rule("1. ingest the bundled corpus (Ray Data)")
    console.print(f"{num_documents} documents from {CORPUS.name} → chunks → page images at two resolutions → "
                  f"embeddings → KV caches compiled with {args.model}, into {args.store} (about a minute on 2 cores; "
                  "a store that has them already is reused)")
    init_ray(quiet=False)
    try:
        summary = ingest(IngestConfig(corpus=str(CORPUS), store=StoreSpec(uri=args.store),
                                      model=ModelSpec(path=args.model)))
    except (ValueError, FileNotFoundError) as error:  # e.g. a store compiled for another model
        console.print(f"[red]qvpic demo: {error}[/red]\n(another --store, or remove {args.store}, starts afresh)")
        return 2
    print_summary(summary, as_json=False)

    import ray
    from ray import serve

    from serve.app import build_app
    from serve.config import AppConfig

    console.rule("2. start the Serve application")
    console.print("four deployments — ingress (HTTP), router, generator (with its KV cache loader), inspector (/ui) — "
                  "on the local Ray …")
    started = time.perf_counter()
    logs.quiet_libraries()  # Serve's driver-side logger, configured on import (replicas log to Ray's files)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(AppConfig(store=StoreSpec(uri=args.store), model=ModelSpec(path=args.model))),
              name=APP_NAME, route_prefix="/")
    moved = "" if port == args.port else f" (port {args.port} was taken)"
    console.print(f"serving at http://127.0.0.1:{port}{moved} (OpenAPI at /docs, inspector at /ui) after "
                  f"{time.perf_counter() - started:.1f} s")
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300, headers=NO_CACHE) as client:
            console.rule("3. ask over HTTP")
            console.print(questions_table(client, questions, args.top_k))
            console.rule("4. what qvpic buys: the same request in every mode")
            store = client.get("/v1/store").json()
            tiers = sorted((store.get("tiers") or {}).items(), key=lambda item: item[1])  # (name, dpi), lowest first
            generator = serve.get_deployment_handle("Generator", app_name=APP_NAME)
            console.print(modes_table(client, questions[0], store["modes"], args.repeats,
                                      tiers[0][0] if tiers else None,
                                      lambda: generator.clear_prefix_cache.remote().result()))
            console.print(cache_hit_line(client, questions[0], args.top_k))
    except (RuntimeError, httpx.HTTPError) as error:
        console.print(f"[red]qvpic demo: {error}[/red]")
        return 1
    finally:
        console.rule("5. shut down")
        serve.delete(APP_NAME)  # drains the application; the local Ray, and Serve with it, ends below
        ray.shutdown()
    console.print(f"done. The store stays in {args.store} (a re-run reuses it); serve it again with "
                  f"`{command_name()} serve --store {args.store} --model {args.model}` (Ctrl-C stops it), then open "
                  f"http://127.0.0.1:{args.port}/ui to see what the model saw: each chunk's page at the tier it was "
                  f"served, why, and where its KV came from.")
    return 0


if __name__ == "__main__":
    logs.as_program()
    sys.exit(main())
