"""Ingest at scale (the ingest half of the scale benchmark): ≥10k chunks of real text through `qvpic ingest`.

Real text, not repeated sentences: the descriptions of the installed Python distributions, Debian's
package changelogs and copyright notices under /usr/share/doc, and the docstrings of the standard
library's sources. Measured side by side in one run, with tiny-qwen on CPU:

- the stage-cost bound: render, embed and compile (batched, every variant) timed alone in this process
  on one core each over a sample of the same chunks; their serial sum is what one core can do, twice
  that the 2-core bound; the target is ≥ 0.6 × the bound (≥ 1.2 × the serial rate);
- ingest throughput of the whole job (`qvpic ingest` as a subprocess, its own local Ray) next to it;
- the driver's peak RSS (VmHWM) on a small and a large corpus (target ≤ 1.2× from 1k to 10k chunks);
- store files per 1k chunks after the job (parts compacted, shards packed);
- a no-op rerun (target ≤ 10% of the first run: the corpus hashed against the last job's record, no
  pipeline), the same rerun forced through the pipeline (`--force`: every chunk found stored by content
  key), and a rerun with 1% new documents (model work ≈ 1%).

    python -m benchmarks.scale.scale_ingest              # 10k and 1k chunks (about 20 minutes on 2 quiet cores)
    python -m benchmarks.scale.scale_ingest --quick      # 2k and 400 chunks
"""

from __future__ import annotations

import argparse
import ast
import glob
import gzip
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from pipeline.eval import markdown_table, write_section
from schemas.corpus import chunk_key

CHUNK_TOKENS = 256
CHARS_PER_CHUNK = 420  # tiny-qwen's tokenizer: ~0.55 tokens a character, chunks fill ~85% of 256 tokens
FILES = 32  # JSONL files per corpus: parallel read tasks
MAX_DOC_CHARS = 60_000  # no one document dominates


def real_texts() -> Iterator[tuple[str, str]]:
    """(doc_id, text) of real prose on this machine, deterministic order, no text twice."""
    seen: set[str] = set()

    def fresh(doc_id: str, text: str) -> Iterator[tuple[str, str]]:
        text = text.strip()[:MAX_DOC_CHARS]
        digest = chunk_key(text)  # the pipeline's document key: a text it would deduplicate is skipped
        if len(text) >= 200 and digest not in seen:
            seen.add(digest)
            yield doc_id, text

    for dist in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata.get("Name") or ""):
        yield from fresh(f"pypi/{dist.metadata.get('Name')}", dist.metadata.get_payload() or "")
    for path in sorted(glob.glob("/usr/share/doc/*/changelog.Debian.gz")):
        with gzip.open(path, "rt", errors="replace") as f:
            yield from fresh(f"debian/{Path(path).parent.name}/changelog", f.read(200_000))
    for path in sorted(glob.glob("/usr/share/doc/*/copyright")):
        yield from fresh(f"debian/{Path(path).parent.name}/copyright", Path(path).read_text(errors="replace"))
    for path in sorted(glob.glob(f"{os.path.dirname(os.__file__)}/**/*.py", recursive=True)):
        try:
            tree = ast.parse(Path(path).read_text(errors="replace"))
        except (SyntaxError, ValueError):
            continue
        docs = [ast.get_docstring(n) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        yield from fresh(f"stdlib/{Path(path).relative_to(os.path.dirname(os.__file__))}",
                         "\n\n".join(d for d in docs if d))


def write_corpus(root: Path, docs: list[tuple[str, str]]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(FILES):
        with open(root / f"part-{i:02d}.jsonl", "w") as out:
            for doc_id, text in docs[i::FILES]:
                out.write(json.dumps({"doc_id": doc_id, "text": text}) + "\n")


def corpora(root: Path, num_chunks: int, small_chunks: int) -> tuple[Path, Path, Path]:
    """(small corpus, large corpus, 1% more documents): documents taken in order until each holds about
    its number of chunks; the large corpus starts with the small one."""
    source = real_texts()

    def take(num: int) -> list[tuple[str, str]]:
        docs, size = [], 0
        while size < num * CHARS_PER_CHUNK:
            doc_id, text = next(source)
            docs.append((doc_id, text))
            size += len(docs[-1][1])
        return docs

    small = take(small_chunks)
    large = small + take(num_chunks - small_chunks)
    write_corpus(root / "small", small)
    write_corpus(root / "large", large)
    (root / "extra").mkdir(parents=True, exist_ok=True)
    with open(root / "extra" / "more.jsonl", "w") as out:
        for doc_id, text in take(max(1, num_chunks // 100)):
            out.write(json.dumps({"doc_id": doc_id, "text": text}) + "\n")
    return root / "small", root / "large", root / "extra" / "more.jsonl"


def stage_costs(corpus: Path, batch_size: int, sample: int) -> dict[str, float]:
    """Seconds per chunk of render, embed and compile, each alone on one core, over `sample` chunks."""
    import torch

    from pipeline.ingest import IngestConfig, Kind, open_store, rows_table
    from pipeline.ingest.stages import ChunkStage, CompilePlan, CompileStage, RenderStage
    from pipeline.runtime import VLM, Embedder
    from pipeline.store import entry_slots
    from schemas.config import ModelSpec
    from schemas.corpus import Document
    from schemas.store import StoreSpec

    torch.set_num_threads(1)  # what a stage actor gets: one core (Ray sets OMP_NUM_THREADS=1 below 1 CPU)
    chunker = ChunkStage(ModelSpec(), CHUNK_TOKENS)
    chunks: list[dict] = []
    for path in sorted(corpus.glob("*.jsonl")):
        for line in open(path):
            record = json.loads(line)
            chunks += chunker.chunks(Document(doc_id=record["doc_id"], text=record["text"], source=path.name))
            if len(chunks) >= sample:
                break
        if len(chunks) >= sample:
            break
    chunks = list({c["chunk_key"]: c for c in chunks[:sample]}.values())
    with tempfile.TemporaryDirectory() as store_dir:
        store, manifest = open_store(IngestConfig(corpus=str(corpus), store=StoreSpec(uri=store_dir)))
        slots = json.dumps([[t, v.value] for t, v in entry_slots(manifest, manifest.variants)])
        units = rows_table([{"kind": Kind.UNIT.value, "key": c["chunk_key"], "chunk_key": c["chunk_key"],
                             "text": c["text"], "slots_json": slots, "error": "", "needs_embedding": True}
                            for c in chunks])
        renderer, embedder = RenderStage(manifest.render, None), Embedder()
        compiler = CompileStage(CompilePlan(ModelSpec(), store.spec, manifest.to_json(), batch_size),
                                vlm=VLM(ModelSpec()))
        compiler(renderer(units.slice(0, batch_size)))  # warm-up outside the timings
        embedder.embed([c["text"] for c in chunks[:8]])
        times = {}
        started = time.perf_counter()
        rendered = renderer(units)
        times["render"] = time.perf_counter() - started
        started = time.perf_counter()
        for start in range(0, len(chunks), 256):
            embedder.embed([c["text"] for c in chunks[start:start + 256]])
        times["embed"] = time.perf_counter() - started
        started = time.perf_counter()
        for start in range(0, rendered.num_rows, 4 * batch_size):
            compiler(rendered.slice(start, 4 * batch_size))
        times["compile"] = time.perf_counter() - started
    torch.set_num_threads(os.cpu_count() or 1)
    return {name: seconds / len(chunks) for name, seconds in times.items()} | {"sample": len(chunks)}


def run_ingest(corpus: Path, store: Path, batch_size: int, *flags: str) -> dict:
    """`qvpic ingest` in a fresh driver process; its summary plus the driver's peak RSS (VmHWM) and the
    process's wall time (`process_s`: imports and Ray start-up included, what a scheduled job pays)."""
    command = [sys.executable, "-m", "jobs.ingest", "--corpus", str(corpus), "--store", str(store), "--json",
               "--chunk-tokens", str(CHUNK_TOKENS), "--compile-batch-size", str(batch_size), *flags]
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    peak = 0
    while proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/status") as status:
                peak = max([peak] + [int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:")])
        except FileNotFoundError:
            break
        time.sleep(0.2)
    out, _ = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"ingest of {corpus} failed ({proc.returncode})")
    # the summary object; Ray may forward worker log lines to the driver's stdout around it
    summary, _ = json.JSONDecoder().raw_decode(out, out.index('{\n  "job_id"'))
    assert summary["balanced"], summary
    return summary | {"driver_peak_rss_nbytes": peak, "process_s": time.perf_counter() - started}


def store_files(store: Path) -> dict[str, int]:
    counts = {"shards": 0, "parts": 0, "other": 0}
    for folder, _, files in os.walk(store):
        kind = "shards" if "/shards" in folder else "parts" if folder.rsplit("/", 1)[-1] in (
            "index", "chunks", "quarantine") else "other"
        counts[kind] += len(files)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale.scale_ingest", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=10_000)
    parser.add_argument("--small", type=int, default=1_000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--sample", type=int, default=256, help="chunks timed for the stage-cost bound")
    parser.add_argument("--quick", action="store_true", help="2k and 400 chunks")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.chunks, args.small, args.sample = 2_000, 400, 128
    with tempfile.TemporaryDirectory(prefix="qvpic-scale-ingest-") as tmp:
        root = Path(tmp)
        small, large, extra = corpora(root / "corpus", args.chunks, args.small)
        costs = stage_costs(large, args.batch_size, args.sample)
        serial_s = costs["render"] + costs["embed"] + costs["compile"]
        print(f"stage costs {costs}", flush=True)
        small_run = run_ingest(small, root / "store-small", args.batch_size)
        print("small", small_run, flush=True)
        first = run_ingest(large, root / "store", args.batch_size)
        print("large", first, flush=True)
        files = store_files(root / "store")
        noop = run_ingest(large, root / "store", args.batch_size)
        print("no-op", noop, flush=True)
        forced = run_ingest(large, root / "store", args.batch_size, "--force")  # the pipeline's own incremental path
        print("no-op, forced", forced, flush=True)
        (large / "zz-more.jsonl").write_bytes(extra.read_bytes())
        more = run_ingest(large, root / "store", args.batch_size)
        print("+1%", more, flush=True)
    rate = first["num_chunks_compiled"] / first["wall_s"]
    work = lambda s: s["num_chunks_compiled"] + s["num_chunks_embedded"]  # noqa: E731  model work, in chunks
    rows = [
        ["chunks compiled (large / small corpus)",
         f"{first['num_chunks_compiled']:,} / {small_run['num_chunks_compiled']:,}", ""],
        ["stage costs alone, ms per chunk (render / embed / compile)",
         " / ".join(f"{costs[k] * 1e3:.1f}" for k in ("render", "embed", "compile")),
         f"{costs['sample']} chunks, 1 core each"],
        ["serial rate (1 core) · 2-core bound, chunks/s", f"{1 / serial_s:.2f} · {2 / serial_s:.2f}", ""],
        ["ingest, chunks/s (whole job)", f"{rate:.2f}", f"{rate * serial_s / 2:.2f}× the 2-core bound (target ≥ 0.6)"],
        ["driver peak RSS, MiB (small → large)",
         f"{small_run['driver_peak_rss_nbytes'] / 2**20:.0f} → {first['driver_peak_rss_nbytes'] / 2**20:.0f}",
         f"{first['driver_peak_rss_nbytes'] / small_run['driver_peak_rss_nbytes']:.2f}× (target ≤ 1.2)"],
        ["store files per 1k chunks (parts · shards)",
         f"{(files['parts'] + files['shards']) * 1000 / first['num_chunks']:.0f}",
         f"{files['parts']} parts · {files['shards']} shards for {first['num_chunks']:,} chunks"],
        ["first run, process wall s", f"{first['process_s']:.1f}", "imports and Ray start-up included"],
        ["no-op rerun, process wall s", f"{noop['process_s']:.1f}",
         f"{noop['process_s'] / first['process_s']:.1%} of the first run (target ≤ 10%); "
         + (f"unchanged since {noop['unchanged_since']}: corpus hashed, no pipeline" if noop["unchanged_since"]
            else "the pipeline ran")],
        ["no-op rerun with --force, process wall s", f"{forced['process_s']:.1f}",
         f"{forced['process_s'] / first['process_s']:.1%} of the first run: the whole pipeline, every chunk found "
         f"stored ({work(forced)} compiled + embedded)"],
        ["+1% documents, process wall s", f"{more['process_s']:.1f}",
         f"{more['process_s'] / first['process_s']:.1%} of the first run"],
        ["+1% documents, model work (chunks compiled + embedded)", f"{work(more):,}",
         f"{work(more) / work(first):.1%} of the first run's {work(first):,} (target ≈ 1%)"],
    ]
    body = (f"tiny-qwen float32 on CPU, chunks of ≤ {CHUNK_TOKENS} tokens, every variant and tier (6 entries a chunk "
            f"by default), compile batch {args.batch_size}; `qvpic ingest` in its own driver process with a private "
            "local Ray (4 logical "
            "CPUs on this 2-core machine). Stage costs are measured in this run on the same corpus.\n\n"
            + markdown_table(["measure", "value", "note"], rows))
    print(body)
    if not args.no_write:
        write_section("scale-ingest", "Ingest at scale: one streaming job, compacted store, incremental reruns",
                      " ".join(["python -m benchmarks.scale.scale_ingest",
                                *(argv if argv is not None else sys.argv[1:])]),
                      body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
