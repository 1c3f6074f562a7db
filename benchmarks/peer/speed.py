"""TTFT and decode, qvpic and vLLM side by side on the same store's chunks and question
(benchmarks/peer/side_by_side.py).

Workloads, each a list of requests naming chunks of one store (built by benchmarks/tools/ttft_store.py):
- `identical`: the same 16 chunks in the same order every time: vLLM's best case (its prefix cache holds all);
- `reordered`: the same 16 chunks in a new order each time: position independence;
- `zipf`: 8–16 chunks drawn by Zipf popularity from the pool, in a random order: the realistic RAG case.
vLLM is warm: before the measured requests it has seen each workload's `warm` requests (for `reordered`, the
chunks in their first order; for `zipf`, as many other Zipf sets), so its prefix cache holds what it can.
qvpic answers in `qvpic`, `text_pic`, `full_text` and `full_image` mode (HTTP: `Cache-Control: no-cache`, no
response cache); vLLM is given the chunks as text and, separately, as the page images of the store's lowest
tier (what qvpic compiled), in the same order, then the question. Over HTTP the two servers are up together
and every round sends each qvpic mode and each vLLM representation its request in turn (interleaved, one at
a time; vLLM's processes stopped while qvpic's request runs: servers.VLLMServer); in-process figures follow,
one engine at a time. Decode: `DECODE_REQUESTS` of the zipf requests,
`NEW_TOKENS` new tokens each, at concurrency 1 and 16 (qvpic's batched engine in `qvpic` mode vs vLLM's
continuous batching on the text prompts), tokens/s = new tokens / wall time.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.peer import engine, serve_floor, servers
from benchmarks.perf.batching import percentile
from benchmarks.tools import ttft_store
from benchmarks.tools.machine import cpu_flags
from pipeline.eval import markdown_table
from pipeline.runtime import Renderer, in_passing_thread
from schemas.config import ModelSpec
from schemas.modes import Mode
from schemas.render import RenderSpec

SET_CHUNKS = 16
ZIPF_EXPONENT = 1.1
CHUNK_TOKENS = 192  # ~3,100 context tokens for 16 chunks, the prompt size
NEW_TOKENS = 32
DECODE_REQUESTS = 16
CONCURRENCY = (1, 16)
QVPIC_MODES = (Mode.QVPIC, Mode.TEXT_PIC, Mode.FULL_TEXT, Mode.FULL_IMAGE)
REPRESENTATIONS = ("text", "image")
# qvpic / vLLM (issue 39): HTTP TTFT on reordered and zipf, in-process TTFT on them, HTTP TTFT on identical
# (with the prefix cache); decode tokens/s at 16
TARGET_REUSE, TARGET_REUSE_IN_PROCESS, TARGET_IDENTICAL, TARGET_DECODE = 0.1, 0.08, 1.0, 1.0


@dataclass(frozen=True)
class Workload:
    name: str
    warm: list[list[int]]  # chunk indices of vLLM's warm-up requests
    requests: list[list[int]]  # chunk indices of the measured requests, in prompt order


def workloads(rounds: int, pool: int, seed: int = 0) -> list[Workload]:
    rng = random.Random(seed)
    base = list(range(SET_CHUNKS))
    orders = []
    while len(orders) < rounds:
        order = rng.sample(base, len(base))
        if order != base and order not in orders:
            orders.append(order)
    weights = [1 / (rank + 1) ** ZIPF_EXPONENT for rank in range(pool)]

    def zipf_set() -> list[int]:
        size, chosen = rng.randint(8, SET_CHUNKS), []
        while len(chosen) < size:
            chunk = rng.choices(range(pool), weights)[0]
            if chunk not in chosen:
                chosen.append(chunk)
        return chosen  # drawn by popularity, so already in a random order

    zipf = [zipf_set() for _ in range(2 * rounds)]
    return [Workload("identical", [base], [base] * rounds), Workload("reordered", [base], orders),
            Workload("zipf", zipf[:rounds], zipf[rounds:])]


@dataclass(frozen=True)
class Corpus:
    store_uri: str
    chunk_ids: tuple[str, ...]
    query: str
    texts: list[str]
    pages: list[list[str]]  # PNG paths per chunk, the lowest tier

    def parts(self, chunks: list[int], representation: str) -> list[dict]:
        if representation == "text":
            pieces = [{"text": self.texts[c]} for c in chunks]
        else:
            pieces = [{"image": p} for c in chunks for p in self.pages[c]]
        return pieces + [{"text": self.query}]


def build_corpus(spec: ModelSpec, workdir: Path, pool: int) -> Corpus:
    render = RenderSpec()
    bench = ttft_store.build(str(workdir / "store"), spec, render, CHUNK_TOKENS, pool)
    texts, _, _ = ttft_store.chunk_texts(spec, CHUNK_TOKENS, pool, 0)  # the same texts, in the same order
    renderer, pages = Renderer(render), []
    for c, text in enumerate(texts):
        pages.append([])
        for n, page in enumerate(renderer.render(text, render.lowest_tier).pages):
            pages[-1].append(str(workdir / f"chunk{c:02d}-page{n}.png"))
            page.save(pages[-1][-1])
    return Corpus(bench.uri, bench.chunk_ids, bench.query, texts, pages)


def run(spec: ModelSpec, quick: bool, workdir: Path) -> str:
    rounds, pool = (3, 20) if quick else (8, 24)
    started = time.perf_counter()
    # compiled on a thread that ends: this process's in-process qvpic runs later, and a thread kept with an OpenMP
    # pool beside the engine's slows its forwards ~1.4x (pipeline/runtime/threads.py)
    corpus = in_passing_thread(build_corpus, spec, workdir, pool)
    loads = workloads(rounds, pool)
    build_s = time.perf_counter() - started
    max_images = max(sum(len(corpus.pages[c]) for c in r) for w in loads for r in w.requests + w.warm)
    over_http = servers.measure(spec, corpus, loads, max_images, QVPIC_MODES, REPRESENTATIONS,
                             workdir / "vllm-server.log")
    decode_sets = workloads(DECODE_REQUESTS, pool, seed=1)[2].requests  # zipf sets of their own
    ours = servers.in_process_qvpic(spec, corpus, loads, QVPIC_MODES, decode_sets, NEW_TOKENS, CONCURRENCY)
    tasks = [{"kind": "ttft", "warm": [corpus.parts(r, rep) for r in w.warm],
              "requests": [corpus.parts(r, rep) for r in w.requests]} for w in loads for rep in REPRESENTATIONS]
    tasks.append({"kind": "decode", "max_tokens": NEW_TOKENS, "concurrency": list(CONCURRENCY),
                  "requests": [corpus.parts(r, "text") for r in decode_sets]})
    out = engine.run_job(engine.job(spec, max_images, tasks))
    theirs = {(w.name, rep): out[i] for i, (w, rep) in enumerate((w, rep) for w in loads for rep in REPRESENTATIONS)}
    return report(spec, quick, rounds, pool, over_http, ours, theirs, out[-1]["tokens_per_s"],
                  time.perf_counter() - started, build_s)


PHASES = ("route_ms", "load_ms", "queue_ms", "reanchor_ms", "prefill_ms", "total_ms")  # schemas.report.Timings
SERVER_PHASES = PHASES[:-1]  # the server's work on a request; the rest of its HTTP time is transport


def breakdown_row(over_http: dict, workload: str, mode: Mode) -> list:
    cell = over_http[("qvpic", workload, mode.value)]
    return [workload, mode.value, *(f"{statistics.median(t[k] or 0.0 for t in cell['timings']):.0f}" for k in PHASES),
            f"{statistics.median(cell['ms']):.0f}"]


def serve_floor_table(over_http: dict, floor: dict, best_vllm_ms, verdicts: list[str]) -> str:
    """Serve's floor beside qvpic's linked modes, per workload; a verdict per reuse workload on whether the 0.1×
    target is above the least this engine on Serve could take (Serve's floor + the query-turn prefill alone)."""
    rows = []
    for name in ("identical", "reordered", "zipf"):
        bare = over_http[("serve", name, "floor")]
        bare_ms = statistics.median(bare["ms"])
        hops = {k: statistics.median(t[k] for t in bare["timings"]) for k in serve_floor.HOPS}
        mode = min(servers.LINKED_MODES, key=lambda m: statistics.median(over_http[("qvpic", name, m.value)]["ms"]))
        cell = over_http[("qvpic", name, mode.value)]
        ms = statistics.median(cell["ms"])
        phases_ms = statistics.median(sum(t[k] or 0.0 for k in SERVER_PHASES) for t in cell["timings"])
        prefill_alone = statistics.median(floor[(name, mode.value)]["query_ms"])
        least, target = bare_ms + prefill_alone, TARGET_REUSE * best_vllm_ms(name)
        # identical: its prefix cache answers, no query-turn prefill runs
        rows.append([name, f"{bare_ms:.1f}", " / ".join(f"{hops[k]:.1f}" for k in serve_floor.HOPS),
                     f"{mode.value} {ms:.0f}", f"{phases_ms:.0f}", f"{ms - phases_ms:.0f}",
                     *(["", ""] if name == "identical" else [f"{least:.0f}", f"{target:.0f}"])])
        if name != "identical":
            verdicts.append(f"{name}: Serve's floor {bare_ms:.0f} ms + the query-turn prefill alone "
                            f"{prefill_alone:.0f} ms = {least:.0f} ms, the least a linked request of this engine "
                            f"takes over HTTP here; the 0.1× target is {target:.0f} ms: "
                            + ("**below that floor**" if least > target else "above that floor"))
    return markdown_table(["workload", "Serve's floor: HTTP p50",
                           "in its ingress: body read / route hop / generate hop / all",
                           "qvpic best linked: HTTP p50", "its server phases", "the rest",
                           "Serve's floor + prefill alone", "0.1× vLLM's best"], rows)


def _cell(times: list[float]) -> str:
    return f"{statistics.median(times):.0f} / {percentile(times, 0.99):.0f}"


def report(spec, quick, rounds, pool, over_http, ours, theirs, vllm_decode, wall_s, build_s) -> str:
    def best_vllm_ms(name: str) -> float:
        return min(statistics.median(over_http[("vllm", name, rep)]["ms"]) for rep in REPRESENTATIONS)

    rows, verdicts = [], []
    for name in ("identical", "reordered", "zipf"):
        for mode in QVPIC_MODES:
            h, p = over_http[("qvpic", name, mode.value)], ours["ttft"][(name, mode.value)]
            rows.append([name, "qvpic", mode.value, _cell(h["ms"]), _cell(p["ms"]), statistics.median(h["tokens"])])
        for rep in REPRESENTATIONS:
            h, p = over_http[("vllm", name, rep)], theirs[(name, rep)]
            rows.append([name, "vLLM", rep, _cell(h["ms"]), _cell(p["ttft_ms"]), statistics.median(h["tokens"])])
        best_vllm = best_vllm_ms(name)
        best_ours = min(statistics.median(over_http[("qvpic", name, m.value)]["ms"]) for m in servers.LINKED_MODES)
        target = TARGET_IDENTICAL if name == "identical" else TARGET_REUSE
        ratio = best_ours / best_vllm
        verdicts.append(f"{name}: qvpic's best linked mode {best_ours:.0f} ms / vLLM's best representation "
                        f"{best_vllm:.0f} ms = {ratio:.2f}× over HTTP (target ≤ {target}×: "
                        f"**{'met' if ratio <= target else 'missed'}**)")
        if name != "identical":  # in-process: both engines without their servers
            ours_p = min(statistics.median(ours["ttft"][(name, m.value)]["ms"]) for m in servers.LINKED_MODES)
            theirs_p = min(statistics.median(theirs[(name, rep)]["ttft_ms"]) for rep in REPRESENTATIONS)
            verdicts.append(f"{name} in-process: {ours_p:.0f} ms / {theirs_p:.0f} ms = {ours_p / theirs_p:.2f}× "
                            f"(target ≤ {TARGET_REUSE_IN_PROCESS}×: "
                            f"**{'met' if ours_p / theirs_p <= TARGET_REUSE_IN_PROCESS else 'missed'}**)")
    ttft = markdown_table(["workload", "engine", "mode / representation", "HTTP TTFT p50 / p99 ms",
                           "in-process p50 / p99 ms", "context tokens"], rows)
    breakdown = markdown_table(["workload", "mode", *(k.removesuffix("_ms").replace("_", " ") for k in PHASES),
                                "client (HTTP)"], [breakdown_row(over_http, name, mode) for name in
                                                   ("identical", "reordered", "zipf") for mode in servers.LINKED_MODES])
    floor_rows = [[name, mode, round(statistics.median(f["query_tokens"])), f"{statistics.median(f['query_ms']):.0f}",
                   f"{statistics.median(f['one_token_ms']):.0f}",
                   f"{statistics.median(f['query_ms']) / best_vllm_ms(name):.2f}×"]
                  for (name, mode), f in ours["floor"].items()]
    floor = markdown_table(["workload", "mode", "query-turn tokens", "query-turn prefill alone ms",
                            "one-token forward ms", "prefill alone / vLLM's best HTTP TTFT"], floor_rows)
    floor_http = serve_floor_table(over_http, ours["floor"], best_vllm_ms, verdicts)
    decode_rows = [[c, f"{ours['decode'][c]:.1f}", f"{vllm_decode[str(c)]:.1f}",
                    f"{ours['decode'][c] / vllm_decode[str(c)]:.2f}×"] for c in CONCURRENCY]
    ratio16 = ours["decode"][16] / vllm_decode["16"]
    verdicts.append(f"decode at 16: {ratio16:.2f}× vLLM's tokens/s (target ≥ {TARGET_DECODE}×: "
                    f"**{'met' if ratio16 >= TARGET_DECODE else 'missed'}**)")
    decode = markdown_table(["concurrency", "qvpic tokens/s (qvpic mode)", "vLLM tokens/s (text)", "qvpic / vLLM"],
                            decode_rows)
    return (f"CPU flags: {cpu_flags()}. "
            f"{spec.path} {spec.dtype.value}, {torch.get_num_threads()} cores for each engine (qvpic: torch threads "
            f"and the generator replica's CPUs; vLLM: `VLLM_CPU_OMP_THREADS_BIND=0-{torch.get_num_threads() - 1}`, "
            f"{engine.KV_CACHE_GIB} GiB KV cache, prefix caching on). Store of {pool} chunks of ≤{CHUNK_TOKENS} "
            f"tokens; {rounds} measured requests per workload and engine × mode{' (--quick)' if quick else ''}; "
            f"one new token for TTFT (HTTP: the whole one-token response; qvpic `/v1/answer` with "
            f"`Cache-Control: no-cache`, vLLM `/v1/chat/completions`; vLLM's server stopped with SIGSTOP while "
            f"a qvpic request runs, since idle beside it it slowed qvpic's prefill ~2×). p99 of {rounds} "
            f"requests is their slowest.\n\n{ttft}\n\nWhere qvpic's HTTP TTFT went, medians in ms as the server "
            f"timed them (`timings` of each reply; prefill: the query-only prefill, the floor of the linked "
            f"modes; the client column adds HTTP, the ingress and Serve's hops):\n\n{breakdown}\n\n"
            f"The floor, in-process: the engine's forwards alone (serve/engine/qvpic/batch.py, the path the served "
            f"engine takes) over each measured request's assembled context (routing, loading and re-anchoring done "
            f"beforehand and not timed; medians). The query-turn prefill is the least a linked mode's TTFT can "
            f"cost in this engine; the one-token step over the same slab, which reads every weight once, the least "
            f"any forward of this checkpoint costs in it:\n\n{floor}\n\n"
            f"Ray Serve's own cost, in the same run: a request of qvpic's topology (HTTP → proxy → ingress → a "
            f"router-like deployment and back → a generator-like one and back) through an app that does nothing "
            f"at any stop (benchmarks/peer/serve_floor.py), deployed beside qvpic's and sent a request after each "
            f"of qvpic's. Beside it, qvpic's best linked mode: its server phases (route, load, queue, re-anchoring, "
            f"prefill, as `timings` gives them) and the rest of its HTTP time; and the least a linked request can "
            f"take over HTTP here, Serve's floor plus the query-turn prefill alone (the floor table), against the "
            f"0.1× target (medians, ms):\n\n{floor_http}\n\n"
            f"Decode, {DECODE_REQUESTS} zipf requests, {NEW_TOKENS} new tokens each "
            f"(in-process):\n\n{decode}\n\nTargets:\n\n" + "\n".join(f"- {v}" for v in verdicts)
            + f"\n\nWall time {wall_s:.0f} s (store build {build_s:.0f} s).")
