"""Lazy high tier: what `qvpic ingest --lazy-high-tier` saves at ingest, what a first promotion costs, and how
fast a realistic query mix makes the store all-hot.

One run, side by side: the same synthetic chunks ingested eagerly and lazily by the real stages (ingest
wall time, store bytes); then, on the lazy store, a request promoting one chunk timed three ways —
first promotion (compile + write-back), warm hit (the generator's device hot tier) and store hit (device and
host tiers cleared, the written-back entry read) — against the same request on the eager store, all with one
decoded token so the wall time is the TTFT. Convergence is counted on a Zipf query mix over a larger
catalogue: a promotion compiles exactly when its chunk was never promoted before (one compile per key,
tests/serve/kv/test_lazy_tier.py), so the share of promotions that compile per window of requests is exact
arithmetic on the request stream.

    python -m benchmarks.perf.lazy_tier --quick
    python -m benchmarks.perf.lazy_tier --quick --no-write    # print the section, leave docs/BENCHMARKS.md as it is
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.tools.ttft_store import chunk_texts
from pipeline.eval import write_section
from pipeline.ingest import IngestConfig, open_store
from pipeline.ingest.stages import compile_in_process
from pipeline.runtime import VLM, Embedder
from pipeline.store import Store
from schemas.api import AnswerRequest
from schemas.config import ModelSpec
from schemas.corpus import Chunk
from schemas.modes import Mode
from schemas.sampling import Sampling
from schemas.store import StoreSpec
from serve import build_local

COMMAND = "python -m benchmarks.perf.lazy_tier --quick"
ROUNDS = 3  # ingest rounds per store kind


def ingest(root: Path, model: ModelSpec, vlm: VLM, embedder: Embedder, texts: list[str], counts: list[int],
           lazy: bool) -> tuple[float, int, int]:
    """A store of `texts` built by the ingest stages in-process: (compile-stage seconds, shard bytes, entries)."""
    store, manifest = open_store(IngestConfig(corpus="(in-process)", store=StoreSpec(uri=str(root)), model=model,
                                              lazy_high_tier=lazy))
    chunks = [Chunk.build(f"bench/{i:03d}", 0, text, n) for i, (text, n) in enumerate(zip(texts, counts))]
    started = time.perf_counter()
    errors = compile_in_process(store, manifest, vlm, [(c.chunk_key, c.text, None) for c in chunks])
    compile_s = time.perf_counter() - started
    assert not errors, errors
    store.publish_chunks([{**c.model_dump(), "source": "synthetic", "image_path": None, "embedding": v.tolist()}
                          for c, v in zip(chunks, embedder.embed(texts))])
    return compile_s, shard_bytes(root), store.stats().num_entries


def shard_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "shards").rglob("*.safetensors"))


class Side:
    """One store's serving roles, in-process (serve/local.py `build_local`)."""

    def __init__(self, uri: str, model: ModelSpec):
        self.stack = build_local({"store": uri, "model": model.model_dump(), "router": {"max_chunks": 8},
                                  "loader": {"max_nbytes": 1 << 30}})

    def ttft_ms(self, chunk_id: str, query: str) -> float:
        """Wall time of a request serving one chunk at the high tier, decoding one token."""
        request = AnswerRequest(query=query, chunk_ids=[chunk_id], mode=Mode.UNIFORM, tier="high", max_new_tokens=1)
        started = time.perf_counter()
        plan = asyncio.run(self.stack.router.plan(request))
        answer = self.stack.generator.generate_blocking(plan, Sampling(max_new_tokens=1))
        assert answer.report.chunks[0].tier == "high", f"{chunk_id} was served at {answer.report.chunks[0].tier}"
        return (time.perf_counter() - started) * 1e3


def promotions(sides: dict[str, Side], chunk_ids: list[str], query: str) -> dict[tuple[str, str], list[float]]:
    """TTFTs by (store, first | warm | store), the two stores interleaved request by request."""
    times: dict[tuple[str, str], list[float]] = {}
    for chunk_id in chunk_ids:
        for kind in ("first", "warm"):
            for name, side in sides.items():
                times.setdefault((name, kind), []).append(side.ttft_ms(chunk_id, query))
        for name, side in sides.items():
            side.stack.clear_caches()  # the device hot tier and the loader's host LRU: the entry is read from the store
            times.setdefault((name, "store"), []).append(side.ttft_ms(chunk_id, query))
    return times


def convergence(num_chunks: int, num_requests: int, promoted_per_request: int, zipf_s: float,
                seed: int = 0) -> list[tuple[int, float, float]]:
    """(requests so far, share of this window's promotions that compiled, share of the catalogue compiled)
    at each power-of-ten window boundary."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, num_chunks + 1) ** zipf_s
    weights /= weights.sum()
    seen = np.zeros(num_chunks, bool)
    rows, window_compiled, window_total, boundary = [], 0, 0, 10
    for request in range(1, num_requests + 1):
        chunks = rng.choice(num_chunks, size=promoted_per_request, replace=False, p=weights)
        window_compiled += int((~seen[chunks]).sum())
        window_total += len(chunks)
        seen[chunks] = True
        if request == boundary or request == num_requests:
            rows.append((request, window_compiled / window_total, float(seen.mean())))
            window_compiled = window_total = 0
            boundary *= 10
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="12 chunks, 6 timed promotions, 10^4 Zipf requests")
    parser.add_argument("--model", default="tiny-qwen")
    parser.add_argument("--no-write", action="store_true", help="do not update docs/BENCHMARKS.md")
    args = parser.parse_args(argv)
    model = ModelSpec(path=args.model, device="cpu")
    num_chunks, timed, zipf_requests = (12, 6, 10_000) if args.quick else (48, 12, 1_000_000)
    texts, counts, query = chunk_texts(model, 128, num_chunks, seed=0)
    vlm, embedder = VLM(model), Embedder()
    compile_s: dict[bool, list[float]] = {False: [], True: []}
    sizes: dict[bool, tuple[int, int]] = {}
    with tempfile.TemporaryDirectory(prefix="lazy-bench-") as work:
        ingest(Path(work) / "warm-up", model, vlm, embedder, texts[:2], counts[:2], False)  # first-call costs
        for round_ in range(ROUNDS):  # alternating, so drift on a shared machine hits both
            for lazy in (round_ % 2 == 1, round_ % 2 == 0):
                name = f"{'lazy' if lazy else 'eager'}-{round_}"
                elapsed, nbytes, entries = ingest(Path(work) / name, model, vlm, embedder, texts, counts, lazy)
                compile_s[lazy].append(elapsed)
                sizes[lazy] = (nbytes, entries)
        roots = {"lazy": Path(work) / f"lazy-{ROUNDS - 1}", "eager": Path(work) / f"eager-{ROUNDS - 1}"}
        sides = {name: Side(str(root), model) for name, root in roots.items()}
        chunk_ids = [f"bench/{i:03d}#00000" for i in range(timed)]
        times = promotions(sides, chunk_ids, query)
        compiled = sides["lazy"].stack.generator.repairer.lazy.stats.compiled
        after_bytes = shard_bytes(roots["lazy"])
        eager_stats = Store.open(str(roots["eager"])).stats()
        for side in sides.values():
            side.stack.close()
    med = {key: statistics.median(v) for key, v in times.items()}
    eager_s, lazy_s = statistics.median(compile_s[False]), statistics.median(compile_s[True])
    (eager_bytes, eager_entries), (lazy_bytes, lazy_entries) = sizes[False], sizes[True]
    high = next((g.nbytes for g in eager_stats.groups if g.tier == "high"), 0)
    lines = [
        f"{num_chunks} synthetic chunks of ≤128 tokens, {args.model} float32 on CPU (every variant compiled; the "
        "lazy store skips the high tier's templated entries; tiny pages, so the high tier is a smaller share of the "
        "bytes than at real size, where high.template is the largest image entry). Preliminary: measured on a "
        "shared, loaded 2-core machine; ratios are side by side in one run.", "",
        "| | eager | lazy | lazy / eager |", "|---|---|---|---|",
        f"| compile stage, median of {ROUNDS} (s) | {eager_s:.2f} | {lazy_s:.2f} | {lazy_s / eager_s:.2f} |",
        f"| KV shard bytes on disk | {eager_bytes:,} | {lazy_bytes:,} | {lazy_bytes / eager_bytes:.2f} |",
        f"| KV entries | {eager_entries} | {lazy_entries} | |", "",
        f"The high tier's templated entries are {high / max(eager_bytes, 1):.0%} of the eager store's KV bytes. "
        f"After {timed} promotions the lazy store holds {after_bytes:,} bytes "
        f"({compiled} entries compiled and written back).", "",
        f"TTFT of a request promoting one chunk (1 decoded token; median of {timed}):", "",
        "| | lazy store (ms) | eager store (ms) | lazy / lazy warm hit |", "|---|---|---|---|",
        f"| first promotion (compile + write-back) | {med['lazy', 'first']:.0f} | {med['eager', 'first']:.0f} "
        f"(store read) | {med['lazy', 'first'] / med['lazy', 'warm']:.2f} |",
        f"| warm hit (device hot tier) | {med['lazy', 'warm']:.0f} | {med['eager', 'warm']:.0f} | 1.00 |",
        f"| store hit (device and host tiers cleared) | {med['lazy', 'store']:.0f} | {med['eager', 'store']:.0f} "
        f"| {med['lazy', 'store'] / med['lazy', 'warm']:.2f} |", "",
    ]
    for chunks, s in ((10_000, 1.0), (100_000, 1.1)) if not args.quick else ((10_000, 1.0),):
        rows = convergence(chunks, zipf_requests, 2, s)
        lines += [f"Convergence to all-hot: Zipf(s={s}) over {chunks:,} chunks, 2 promotions per request "
                  f"({zipf_requests:,} requests):", "",
                  "| requests so far | promotions in the window that compiled | catalogue compiled |", "|---|---|---|"]
        lines += [f"| {n:,} | {share:.1%} | {hot:.1%} |" for n, share, hot in rows] + [""]
    lines.append("A first promotion pays one compile of the chunk's high-tier pages on the generator (on a GPU: one "
                 "batched prefill of ~1.7k vision tokens per A4 page) plus one shard and one index-part write; every "
                 "later promotion is a hit. The router prices a pending entry from the low tier's pages scaled to "
                 "the high DPI; the served entry's own counts replace the estimate.")
    if not args.no_write:
        write_section("lazy_tier", "Lazy high tier: ingest saved vs first-promotion TTFT, convergence to all-hot",
                      COMMAND if args.quick else "python -m benchmarks.perf.lazy_tier", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
