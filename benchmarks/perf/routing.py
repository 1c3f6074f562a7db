"""Routing a new query (issue 39 item 3): where `Router.plan`'s milliseconds go, query embedding included, with
the embedder on sentence-transformers' `encode` (before) and on ONNX Runtime (after), interleaved query by query
in one process; a conversation's follow-ups, as served and as routed before this round's change
(benchmarks/perf/routing_follow_ups.py); then the vector search alone at 10^6 rows.

    python -m benchmarks.perf.routing                          # builds the conversation benchmark's store (bench-qwen)
    python -m benchmarks.perf.routing --store /tmp/bench-store # reuses a store built there by an earlier run
    python -m benchmarks.perf.routing --million-rows 0         # without the 10^6-row search

The store is `benchmarks.peer.conversation`'s: the same chunks (its pool of 168, 192 tokens each) compiled by the
same in-process ingest (benchmarks/tools/ttft_store.py). Every query is new (the router's query-vector memory and its
kept entries are off),
one chat turn retrieving 8 chunks in qvpic mode, as that benchmark's turn 1 asks. The 10^6-row part builds a flat
int8 index over random unit rows (what the store builds for them: no IVF reaches its recall target there,
docs/BENCHMARKS.md `scale-serve`) and times `VectorIndex.search` as the router calls it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.perf.routing_follow_ups import HEADER as FOLLOW_UP_HEADER
from benchmarks.perf.routing_follow_ups import describe, measure_follow_ups
from benchmarks.tools.machine import machine_line
from jobs.help import HelpFormatter
from pipeline.eval import markdown_table, write_section

POOL = (4 + 16 + 1) * 4 * 2  # benchmarks.peer.conversation's store: (conversations + interleaved + warm-up) x turns x 2
CHUNK_TOKENS = 192  # benchmarks/peer/speed.py's
TOP_K, WARM_UP = 8, 10
FOLLOW_UPS = 20  # conversations of 4 turns in the follow-up part (benchmarks/perf/routing_follow_ups.py)
TARGET_MS = {"store": 10.0, "million": 25.0}  # issue 39 item 3: p50 of a new query's route
PARTS = ("embed", "tokenize", "model", "route", "layout", "search", "rows", "place")


def build_store(path: Path, model: str) -> str:
    """The conversation benchmark's store at `path`, built once (a marker file says it is complete)."""
    from benchmarks.tools import ttft_store
    from schemas.config import DType, ModelSpec
    from schemas.render import RenderSpec

    complete = path.parent / f"{path.name}.complete"  # beside the store, not in it
    if not complete.exists():
        spec = ModelSpec(path=model, dtype=DType.FLOAT32, device="cpu")
        ttft_store.build(str(path), spec, RenderSpec(), CHUNK_TOKENS, POOL)
        complete.write_text("")
    return str(path)


class Clock:
    """Milliseconds of the wrapped calls, summed per part, for the request being measured: wall, and CPU (the
    process's, every thread's: on a shared box the wall time is the CPU time stretched by the other work)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = collections.defaultdict(float)
        self.cpu: dict[str, float] = collections.defaultdict(float)

    def wrap(self, part: str, owner: object, name: str) -> None:
        function = getattr(owner, name)

        @functools.wraps(function)
        def timed(*args, **kwargs):
            started, cpu = time.perf_counter(), time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.spent[part] += (time.perf_counter() - started) * 1e3
                self.cpu[part] += (time.process_time() - cpu) * 1e3
        setattr(owner, name, timed)


def instrument(clock: Clock, router, embedders) -> None:
    import serve.routing.router as router_module

    for embedder in embedders:
        clock.wrap("embed", embedder, "embed")
        model = embedder._onnx.session if embedder._onnx is not None else embedder._model
        clock.wrap("model", model, "run" if embedder._onnx is not None else "forward")
    tokenizer = embedders[0]._model.tokenizer  # one class for both: wrapped once
    clock.wrap("tokenize", type(tokenizer), "__call__")
    clock.wrap("route", router, "route")
    clock.wrap("layout", type(router.prompt), "conversation")
    clock.wrap("layout", type(router.prompt), "tokens")
    catalog = router.snapshot.catalog
    clock.wrap("search", catalog.vectors, "search")
    clock.wrap("rows", catalog, "chunk_rows")
    clock.wrap("rows", catalog, "entries_of")
    clock.wrap("place", router_module, "place")


def measure_store(uri: str, model: str, queries: int, threads: tuple[int, ...]) -> tuple[list[list], dict]:
    from pipeline.runtime import Embedder, EmbedRuntime
    from schemas.api import AnswerRequest
    from schemas.config import DType, ModelSpec
    from schemas.conversation import Message
    from serve.config import RouterConfig
    from serve.routing.embed_queue import EmbedQueue
    from serve.routing.query_vectors import QueryVectors
    from serve.routing.retrieval import EntryCache
    from serve.routing.router import Router

    router = Router(RouterConfig(store=uri, model=ModelSpec(path=model, dtype=DType.FLOAT32, device="cpu"),
                                 query_cache_entries=0))
    router.query_vectors = QueryVectors(0)  # every query is new
    # and so are its chunks' entries: each query's chunks are read as a new question's are (else the configuration
    # timed first would read them for all); the follow-ups below keep theirs, as served
    with router.snapshot.using(EntryCache(0)):
        texts = [row["text"] for row in router.snapshot.catalog.texts(list(range(router.snapshot.catalog.num_rows)))]
        embedders = {}
        for count in threads:  # each runtime takes the process's torch threads when it is built
            torch.set_num_threads(count)
            embedders |= {(count, runtime): Embedder(runtime=runtime) for runtime in EmbedRuntime}
        if any(e.runtime is not runtime for (_, runtime), e in embedders.items()):
            raise RuntimeError("the ONNX embedder fell back to encode (its log says why): nothing to compare")
        clock = Clock()
        instrument(clock, router, list(embedders.values()))

        def question(i: int) -> str:  # benchmarks.peer.conversation's, from a chunk's words: it retrieves that chunk
            words = texts[i % len(texts)].split()
            return "What does the passage say about " + " ".join(words[3 + i // len(texts):13 + i // len(texts)]) + "?"

        def turn(text: str) -> AnswerRequest:
            return AnswerRequest(query=text, top_k=TOP_K, mode="qvpic", messages=[Message(role="user", content=text)])

        samples: dict[tuple, dict[str, list[float]]] = {key: collections.defaultdict(list) for key in embedders}
        # the router embeds through its queue (serve/routing/embed_queue.py), which holds the embedder it was built
        # with: each embedder compared gets a queue of its own (swapping `router.embedder` alone measured the
        # router's own embedder under both names)
        queues = {key: EmbedQueue(embedder.embed, embedder.batch_size) for key, embedder in embedders.items()}
        loop = asyncio.new_event_loop()  # one loop, as a replica has: its default executor's threads stay up
        for count in threads:
            torch.set_num_threads(count)
            for i in range(WARM_UP + queries):
                for runtime in EmbedRuntime:  # interleaved: both see the same load
                    router.embedder, router.embeds = embedders[(count, runtime)], queues[(count, runtime)]
                    clock.spent.clear()
                    clock.cpu.clear()
                    cpu = time.process_time()
                    plan = loop.run_until_complete(router.plan(turn(question(i))))
                    if i >= WARM_UP:
                        cell = samples[(count, runtime)]
                        cell["plan"].append(plan.route_ms)
                        cell["plan cpu"].append((time.process_time() - cpu) * 1e3)
                        for part in PARTS:
                            cell[part].append(clock.spent.get(part, 0.0))
                            cell[part + " cpu"].append(clock.cpu.get(part, 0.0))
        loop.close()
        torch.set_num_threads(1)  # a router replica's
    router.embedder, router.embeds = (embedders[(min(threads), EmbedRuntime.ONNX)],
                                      queues[(min(threads), EmbedRuntime.ONNX)])
    follow_ups = measure_follow_ups(router, [question(i) for i in range(FOLLOW_UPS * 4 + 4)], FOLLOW_UPS, TOP_K)
    rows = []
    for (count, runtime), cell in samples.items():
        median = {part: statistics.median(values) for part, values in cell.items()}
        p90 = float(np.percentile(cell["plan"], 90))
        rows.append([count, runtime.value, f"{median['plan']:.2f}", f"{p90:.2f}", f"{median['plan cpu']:.2f}",
                     *(f"{median[p]:.2f} / {median[p + ' cpu']:.2f}" for p in PARTS)])
    return rows, {"rows": router.snapshot.catalog.num_rows, "index": router.snapshot.catalog.vectors.info.kind.value,
                  "follow_ups": follow_ups}


def measure_million(num_rows: int, queries: int, threads: tuple[int, ...]) -> list[list]:
    """`VectorIndex.search` (int8 flat scan, float16 rerank) over `num_rows` random unit rows, top-8."""
    from pipeline.store.catalog.embedding_rows import EmbeddingRows
    from pipeline.store.catalog.vector_index import VectorIndex, code_scale, write_flat
    from schemas.generation import ScanSpec, SearchInfo, SearchKind

    rng = np.random.default_rng(0)
    dim = 384
    array = np.empty((num_rows, dim), np.float16)
    for start in range(0, num_rows, 65_536):
        block = rng.standard_normal((min(65_536, num_rows - start), dim), dtype=np.float32)
        array[start:start + len(block)] = block / np.linalg.norm(block, axis=1, keepdims=True)
    rows = EmbeddingRows(array=array)
    scale = code_scale(rows)
    out = []
    with tempfile.TemporaryDirectory(prefix="qvpic-routing-") as folder:
        files = write_flat(rows, scale, Path(folder))
        info = SearchInfo(kind=SearchKind.FLAT, files=files, num_rows=num_rows, dim=dim, code_scale=scale)
        indexes = {t: VectorIndex(Path(folder), rows, info, ScanSpec(search_threads=t)) for t in threads}
        qs = rng.standard_normal((WARM_UP + queries, dim), dtype=np.float32)
        qs /= np.linalg.norm(qs, axis=1, keepdims=True)
        times: dict[int, list[float]] = {t: [] for t in threads}
        cpus: dict[int, list[float]] = {t: [] for t in threads}
        for i, query in enumerate(qs):
            for t, index in indexes.items():  # interleaved
                started, cpu = time.perf_counter(), time.process_time()
                index.search(query, TOP_K)
                if i >= WARM_UP:
                    times[t].append((time.perf_counter() - started) * 1e3)
                    cpus[t].append((time.process_time() - cpu) * 1e3)
        for t, index in indexes.items():
            index.close()
            out.append([f"{num_rows:,}", t, len(files), f"{statistics.median(times[t]):.2f}",
                        f"{np.percentile(times[t], 90):.2f}", f"{statistics.median(cpus[t]):.2f}"])
    return out


def report(store_rows: list[list], store: dict, million: list[list], queries: int, load: tuple[str, str]) -> str:
    header = ["torch threads", "embedder", "route p50 ms", "route p90 ms", "route p50 CPU ms", "embed",
              "of it: tokenize", "of it: model", "route after embedding", "of it: layout + tokens", "search",
              "chunk + entry rows", "placement"]
    text = (f"{machine_line()}. Load average (1 min) {load[0]} before, {load[1]} after: other work shared the "
            f"2 cores. Store: the conversation benchmark's, {store['rows']} chunks, {store['index']} index. "
            f"{queries} new queries per row (plus {WARM_UP} warm-up), one chat turn each retrieving {TOP_K} chunks "
            f"in qvpic mode, the two embedders interleaved query by query. Route = `Plan.route_ms` (query "
            f"embedding included; one query, so no batching) and the process's CPU time over the same call; the parts' "
            f"columns are medians, wall / CPU ms.\n\n"
            + markdown_table(header, store_rows)
            + "\n\n" + describe(FOLLOW_UPS, TOP_K) + "\n\n" + markdown_table(FOLLOW_UP_HEADER, store["follow_ups"]))
    if million:
        text += (f"\n\nThe vector search alone at {million[0][0]} rows (`VectorIndex.search`, top-8: int8 flat scan in "
                 f"{million[0][2]} shards, float16 rerank of 64 candidates; shards scanned on 1 or 2 threads, "
                 f"`router.scan.search_threads`), {queries} random unit queries:\n\n"
                 + markdown_table(["rows", "search threads", "shards", "search p50 ms", "search p90 ms",
                                   "search p50 CPU ms"], million))
    text += "\n\n" + verdict(store_rows, million)
    return text


def verdict(store_rows: list[list], million: list[list]) -> str:
    """Each target against the best ONNX configuration, in wall time as measured and in CPU time (what an
    unshared core would take); at 10^6 rows composed as that route with the store's search replaced by the
    10^6-row one (nothing else in a route grows with the store: it reads the selected rows only)."""
    ours = min((row for row in store_rows if row[1] == "onnxruntime"), key=lambda row: float(row[2]))
    wall, cpu = float(ours[2]), float(ours[4])
    search_wall, search_cpu = (float(x) for x in ours[10].split(" / "))

    def met(value: float, target: float) -> str:
        return f"{value:.1f} ms ({'met' if value <= target else 'missed'})"

    line = (f"Targets (issue 39 item 3), best configuration {ours[0]} torch thread(s) + onnxruntime: a new query's "
            f"route p50 ≤ {TARGET_MS['store']:.0f} ms at this store: wall {met(wall, TARGET_MS['store'])}, CPU "
            f"{met(cpu, TARGET_MS['store'])}")
    if million:
        best = min(million, key=lambda row: float(row[3]))
        far_wall = wall - search_wall + float(best[3])
        far_cpu = cpu - search_cpu + float(best[5])
        line += (f"; ≤ {TARGET_MS['million']:.0f} ms at {best[0]} rows (composed, {best[1]} search thread(s)): "
                 f"wall {met(far_wall, TARGET_MS['million'])}, CPU {met(far_cpu, TARGET_MS['million'])}")
    return line + "."


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.perf.routing", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--store", type=Path, help="where the store is built, or was built by an earlier run "
                   "(default: a temporary directory)")
    p.add_argument("--model", default="bench-qwen")
    p.add_argument("--queries", type=int, default=40, help="timed new queries per configuration")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads (1: a router replica "
                   "under Ray, which sets OMP_NUM_THREADS=1 for a fractional CPU)")
    p.add_argument("--million-rows", type=int, default=1_000_000, help="rows of the search-only part (0: skip)")
    p.add_argument("--no-write", action="store_true", help="do not update docs/BENCHMARKS.md")
    args = p.parse_args(argv)
    command = ("python -m benchmarks.perf.routing " + " ".join(argv)).strip()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="qvpic-routing-store-") as folder:
        uri = build_store(args.store or Path(folder) / "store", args.model)
        store_rows, store = measure_store(uri, args.model, args.queries, tuple(args.threads))
    million = measure_million(args.million_rows, args.queries, tuple(args.threads)) if args.million_rows else []
    body = report(store_rows, store, million, args.queries, (f"{load_before:.1f}", f"{os.getloadavg()[0]:.1f}"))
    print(body, flush=True)
    if not args.no_write:
        write_section("routing", "Routing a new query: the embedding and the rest (issue 39 item 3)", command, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
