"""Serving at scale: router start-up, route latency, resident memory, recall and hot-reload switch time
over synthetic stores of 10^4 .. 10^6 chunks (the serving half of the scale benchmark).

Each store is written through the Store API (chunk and index tables; every entry points at one real
shard, since routing never reads KV) with unit-norm embeddings of one `--distribution`:
- random: drawn uniformly on the sphere, queried by random unit vectors; the hardest case for an
  approximate index (no neighbourhoods), so the exhaustive scan is what serves them;
- clustered: topics with members around them;
- realistic: real sentences embedded with the serving embedder, synthesised to N rows along their
  neighbourhoods, queried by held-out real sentences (benchmarks/tools/realistic_vectors.py): the case an
  approximate index's recall is measured on honestly.
The job-side step, `publish_generation`, runs in a process of its own (time and peak RSS); then a
fresh process starts a Router on the store and measures, one after the other: start-up, RSS, route
p50/p99 (retrieval + placement for an embedded query; query embedding timed separately), a
hot-reload switch (a generation published under the running router), and recall@8 of its retrieval
against exact float16 search.

    python -m benchmarks.scale.scale_serve                 # 10k, 100k, 1M; random
    python -m benchmarks.scale.scale_serve --quick         # 10k, 100k
    python -m benchmarks.scale.scale_serve --sizes 1000000 --distribution random realistic
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from pipeline.eval import markdown_table, write_section

DIM = 384
CHUNKS_PER_DOC = 10
PART_ROWS = 250_000
QUERIES = 300
RECALL_QUERIES = 100
REALISTIC_BASE = 5_000  # real sentences the realistic rows are synthesised around (embedded once, cached)
SEARCH_THREADS = (1, 2)  # route timed with the exhaustive scan on one thread and on two (`router.scan.search_threads`)
QUERY_FILE = "bench-queries.npy"  # beside the store: the queries a realistic store is measured with


def unit_rows(rng: np.random.Generator, n: int, distribution: str, centres: np.ndarray | None) -> np.ndarray:
    rows = rng.standard_normal((n, DIM), dtype=np.float32)
    if distribution == "clustered":  # members at cosine ~0.9 to one of the topic centres
        rows = centres[rng.integers(0, len(centres), n)] + 0.5 * rows / np.sqrt(DIM)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def write_store(root: Path, num_chunks: int, distribution: str, seed: int = 0) -> dict:
    """A store of `num_chunks` chunks (3 entries each) written in parts, never whole in memory; returns
    what the distribution's statistics say (realistic only)."""
    import torch

    from pipeline.ingest import new_manifest
    from pipeline.runtime import Embedder
    from pipeline.store import Store
    from schemas.config import ModelSpec
    from schemas.modes import Variant
    from schemas.render import RenderSpec
    from schemas.tables import INDEX_SCHEMA

    store = Store.open(str(root), create=True)
    embedder_name = Embedder().model_name
    manifest = new_manifest(ModelSpec(path="tiny-qwen", device="cpu"), RenderSpec(),
                            (Variant.TEMPLATE, Variant.TEXT), embedder_name, DIM, "bench")
    store.write_manifest(manifest)
    shard = store.write_shard({"kv": torch.zeros(2, 2, 1, 4, 8)})[0]
    rng = np.random.default_rng(seed)
    centres = unit_rows(rng, max(num_chunks // 50, 1), "random", None)
    synth, stats = None, {}
    if distribution == "realistic":
        from benchmarks.tools.realistic_vectors import Synthesizer, embedded, statistics

        base, queries, _ = embedded(REALISTIC_BASE, QUERIES + 20)
        np.save(root.parent / f"{root.name}-{QUERY_FILE}", queries)
        synth = Synthesizer(base)
        sample = synth.rows(min(num_chunks, REALISTIC_BASE), np.random.default_rng(seed + 1))
        stats = {"synthetic": statistics(queries, sample), "real": statistics(queries, base)}
    slots = [("low", Variant.TEMPLATE, 64, 30), ("high", Variant.TEMPLATE, 176, 50), (None, Variant.TEXT, 40, 40)]
    for start in range(0, num_chunks, PART_ROWS):
        ids = np.arange(start, min(start + PART_ROWS, num_chunks))
        texts = [f"synthetic chunk {i} of document {i // CHUNKS_PER_DOC}" for i in ids]
        keys = [hashlib.sha256(t.encode()).hexdigest() for t in texts]
        vectors = synth.rows(len(ids), rng) if synth else unit_rows(rng, len(ids), distribution, centres)
        store.publish_chunks(pa.table({
            "chunk_id": [f"doc{i // CHUNKS_PER_DOC:07d}#{i % CHUNKS_PER_DOC:05d}" for i in ids],
            "doc_id": [f"doc{i // CHUNKS_PER_DOC:07d}" for i in ids],
            "order": pa.array(ids % CHUNKS_PER_DOC, pa.int32()), "chunk_key": keys, "text": texts,
            "num_text_tokens": pa.array(np.full(len(ids), 40), pa.int32()),
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), DIM),
            "source": ["bench"] * len(ids), "image_path": pa.nulls(len(ids), pa.string())}))
        n, tables = len(ids), []
        for tier, variant, tokens, span in slots:
            image = variant is not Variant.TEXT
            pages = pa.ListArray.from_arrays(np.arange(n + 1, dtype=np.int32),
                                             pa.array([[1, 8, 8] if image else [0, 0, 0]] * n, pa.list_(pa.int32())))
            empty = pa.ListArray.from_arrays(np.zeros(n + 1, np.int32), pa.array([], pa.list_(pa.int32())))
            tables.append(pa.table({
                "chunk_key": keys, "tier": pa.array([tier] * n, pa.string()), "variant": [variant.value] * n,
                "fingerprint": [manifest.entry_fingerprint(variant, tier)] * n,
                "kind": ["image" if image else "text"] * n,
                "num_tokens": pa.array(np.full(n, tokens), pa.int32()),
                "position_span": pa.array(np.full(n, span), pa.int32()),
                "compile_start": pa.array(np.full(n, 12), pa.int32()),
                "grid_thw": pages if image else empty, "image_sizes_px": pages if image else empty,
                "vision_tokens": pa.array(np.full(n, tokens if image else 0), pa.int32()),
                **{name: pa.array([value] * n, INDEX_SCHEMA.field(name).type)
                   for name, value in shard.index_fields().items()}}))
        # one part with every slot: schemas/store.py's tier rule rejects a part of text entries alone
        store.publish_index(pa.concat_tables(tables))
    return stats


def rss_mib() -> dict[str, float]:
    """This process's resident memory now, and its peak (VmHWM: unlike ru_maxrss, not inherited from the
    parent that forked it)."""
    fields = {line.split(":")[0]: float(line.split()[1]) / 1024 for line in open("/proc/self/status")
              if line.startswith(("VmRSS", "RssAnon", "RssFile", "VmHWM"))}
    return {"rss": fields["VmRSS"], "anon": fields["RssAnon"], "file": fields["RssFile"], "peak": fields["VmHWM"]}


def publish(uri: str, job_id: str) -> dict:
    """Runs in a fresh process: the job's last step, its time and its peak resident memory."""
    from pipeline.store import Store, publish_generation

    before = rss_mib()["rss"]
    started = time.perf_counter()
    record = publish_generation(Store.open(uri), job_id)
    return {"publish_s": time.perf_counter() - started, "rss_before_mib": before,
            "peak_rss_mib": rss_mib()["peak"],
            "build_s": record.search.build_s}


def measure(uri: str, seed: int = 1) -> dict:
    """Runs in a fresh process: everything the router costs, in order."""
    started = time.perf_counter()
    from pipeline.store import Store, current_generation_number
    from pipeline.store.catalog import exact_top_k, recall_at_k
    from schemas.api import AnswerRequest
    from schemas.config import ModelSpec
    from schemas.generation import ReloadSpec
    from serve.config import RouterConfig
    from serve.routing import Router

    imported = time.perf_counter()
    router = Router(RouterConfig(store=uri, model=ModelSpec(path="tiny-qwen", device="cpu"), max_chunks=64,
                                 reload=ReloadSpec(poll_s=0.05)))
    ready = time.perf_counter()
    out = {"import_s": imported - started, "startup_s": ready - imported, "rss_startup": rss_mib(),
           "search": router.snapshot.catalog.vectors.info.model_dump(mode="json")}
    rng = np.random.default_rng(seed)
    held_out = Path(uri).parent / f"{Path(uri).name}-{QUERY_FILE}"
    queries = (np.load(held_out, allow_pickle=False) if held_out.exists()
               else unit_rows(rng, QUERIES + 20, "random", None))
    request = AnswerRequest(query="What does the synthetic chunk say?", top_k=8)
    vectors = router.snapshot.catalog.vectors
    times: dict[int, list[float]] = {threads: [] for threads in SEARCH_THREADS}
    for i, query in enumerate(queries):
        for threads in SEARCH_THREADS:  # interleaved, so both settings see the same machine
            vectors.set_search_threads(threads)
            t = time.perf_counter()
            router.route(request, query)
            if i >= 20:  # warm-up: the first searches page the index in
                times[threads].append((time.perf_counter() - t) * 1e3)
    vectors.set_search_threads(router.config.scan.search_threads)
    out["route_ms"] = {f"{stat}_t{threads}": float(np.percentile(times[threads], q))
                       for threads in SEARCH_THREADS for stat, q in (("p50", 50), ("p99", 99))}
    out["rss_routed"] = rss_mib()
    embed = []
    for i in range(30):
        t = time.perf_counter()
        router.embedder.embed([f"question number {i} about the synthetic corpus"])
        embed.append((time.perf_counter() - t) * 1e3)
    out["embed_ms_p50"] = float(np.median(embed))
    store = Store.open(uri)
    before = router.generation
    print("READY-FOR-SWITCH", flush=True)  # the parent publishes a generation (a job's last step) ...
    sys.stdin.readline()  # ... and says so
    while router.generation == before or router.watcher.last_switch_s is None:
        time.sleep(0.005)
    # from the record's `published_at` (just before the pointer moved) until the router served it
    out["switch"] = {"switch_s": router.watcher.last_switch_s, "current": current_generation_number(store)}
    snapshot = router.snapshot
    probe = queries[:RECALL_QUERIES] if held_out.exists() else unit_rows(rng, RECALL_QUERIES, "random", None)
    found = np.stack([snapshot.catalog.vectors.search(q, 8)[0] for q in probe])
    truth = exact_top_k(snapshot.catalog.vectors.embeddings, probe, 8)
    out["recall_at_8"] = recall_at_k(found, truth)
    router.close()
    return out


def run_size(num_chunks: int, distribution: str, work: Path) -> dict:
    from pipeline.store import Store, publish_generation

    root = work / f"store-{distribution}-{num_chunks}"
    t = time.perf_counter()
    stats = write_store(root, num_chunks, distribution)
    written = time.perf_counter() - t
    published = json.loads(subprocess.run([sys.executable, "-m", "benchmarks.scale.scale_serve", "--publish",
                                           str(root)], check=True, stdout=subprocess.PIPE, text=True)
                           .stdout.strip().splitlines()[-1])
    t = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "benchmarks.scale.scale_serve", "--child", str(root)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    for line in child.stdout:  # the router is up and measured: publish under it, as a job would
        if line.startswith("READY-FOR-SWITCH"):
            started = time.perf_counter()
            publish_generation(Store.open(str(root)), "bench-switch")  # unchanged tables: snapshot reused
            republish_s = time.perf_counter() - started
            child.stdin.write("go\n")
            child.stdin.flush()
            break
    output = child.stdout.read()
    if child.wait() != 0:
        raise RuntimeError(f"the measuring process failed with exit code {child.returncode}")
    result = json.loads(output.strip().splitlines()[-1])
    result.update(num_chunks=num_chunks, distribution=distribution, write_s=written, **published,
                  republish_s=republish_s, process_s=time.perf_counter() - t, statistics=stats)
    return result


def section(results: list[dict]) -> str:
    rows = [[f"{r['num_chunks']:,}", r["distribution"], r["search"]["kind"] + (
        f" nprobe {r['search']['nprobe']}/{r['search']['num_lists']}" if r["search"]["kind"] == "ivf" else ""),
        r["publish_s"], r["peak_rss_mib"], r["startup_s"], r["import_s"], r["route_ms"]["p50_t1"],
        r["route_ms"]["p99_t1"], r["route_ms"]["p50_t2"], r["route_ms"]["p99_t2"],
        r["embed_ms_p50"], r["rss_routed"]["rss"], r["rss_routed"]["anon"], r["recall_at_8"],
        r["switch"]["switch_s"] * 1e3] for r in results]
    table = markdown_table(["chunks", "embeddings", "index", "publish s (job step)", "publish peak RSS MiB",
                            "router start-up s",
                            "imports s", "route p50 ms", "route p99 ms", "route p50 ms, 2 threads",
                            "route p99 ms, 2 threads", "embed p50 ms", "router RSS MiB",
                            "of it anonymous", "recall@8", "switch ms"], rows)
    reasons = "\n".join(f"- {r['num_chunks']:,} {r['distribution']}: {r['search']['reason']}" for r in results)
    stats = "\n".join(
        f"- {r['num_chunks']:,}: query to nearest / 8th nearest / random row, synthetic rows "
        f"{s['synthetic']['nn1']:.3f} / {s['synthetic']['nn8']:.3f} / {s['synthetic']['random']:.3f}, the real "
        f"sentences {s['real']['nn1']:.3f} / {s['real']['nn8']:.3f} / {s['real']['random']:.3f}"
        for r in results if (s := r.get("statistics")))
    return (f"{table}\n\nRoute = retrieval + placement for an embedded query (top-8, qvpic), after 20 warm-up "
            "queries, with the exhaustive scan on one thread and on two (`router.scan.search_threads: 2`, "
            "`qvpic serve --router-search-threads 2`; give the router deployment `num_cpus: 2` to match), "
            "the two interleaved query by query; the query embedding (MiniLM, one query) is timed apart. "
            "Start-up = `Router(...)` in a fresh "
            "process (tokenizer, embedder, the generation's catalog and index opened), imports apart. Publish runs "
            "in a process of its own; its peak RSS (VmHWM) includes the imports (~280 MiB). "
            "Router RSS after the routes; "
            "file-backed pages (the mapped index) are the rest. Switch = from the end of a publish "
            "(a job's last step) until the running router serves the new generation (poll 50 ms). "
            "Recall@8 against exact float16 search on "
            f"{RECALL_QUERIES} queries (random unit vectors; held-out real sentences for realistic stores)."
            f"\n\nIndex choice per store:\n{reasons}\n"
            + (f"\nRealistic rows against real text (mean cosines of held-out sentence queries):\n{stats}\n"
               if stats else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10k and 100k chunks only")
    parser.add_argument("--sizes", type=int, nargs="+", default=None)
    parser.add_argument("--distribution", choices=["random", "clustered", "realistic"], nargs="+",
                        default=["random"])
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--publish", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--no-write", action="store_true", help="print results, leave docs/BENCHMARKS.md alone")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child)))
        return 0
    if args.publish:
        print(json.dumps(publish(args.publish, "bench")))
        return 0
    sizes = args.sizes or ([10_000, 100_000] if args.quick else [10_000, 100_000, 1_000_000])
    results = []
    # one section per set of distributions: the random-vector run and an ANN-recall run keep their own
    others = [d for d in args.distribution if d != "random"]
    key = "-".join(["scale-serve", *others])
    title = "Serving at scale: start-up, routing, memory, recall, hot reload" + (
        f" ({', '.join(args.distribution)} embeddings)" if others else "")
    with tempfile.TemporaryDirectory(prefix="qvpic-scale-serve-") as work:
        for distribution in args.distribution:
            for size in sizes:
                results.append(run_size(size, distribution, Path(work)))
                print(json.dumps(results[-1]), flush=True)
                body = section(results)  # written after every size: a long run keeps what it measured
                if not args.no_write:
                    command = "python -m benchmarks.scale.scale_serve " + " ".join(
                        argv if argv is not None else sys.argv[1:])
                    write_section(key, title, command.strip(), body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
