"""What checking a store costs: the parts check serving and every publish run first, and `qvpic verify`.

Synthetic stores written through the Store API (benchmarks/scale_serve.py's writer: 3 entries a chunk,
every entry pointing at one real shard) and published, at two sizes with the same number of parts and
at one size with ten times the parts, so the table shows what each cost grows with: the parts check
must follow the number of parts (a listing, one small read) and not the number of chunks; a shallow
verify streams every index row once against one shard listing (plus the coverage join); --deep also
reads and checksums every entry. Medians of `--repeats` runs, side by side in one process.

    python -m benchmarks.store_check            # 20k and 200k chunks
    python -m benchmarks.store_check --quick    # 5k and 50k chunks
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import scale_serve
from benchmarks.report import markdown_table, write_section


def build(root: Path, num_chunks: int, num_parts: int) -> None:
    from pipeline.generations import publish_generation
    from pipeline.store import Store

    scale_serve.PART_ROWS = -(-num_chunks // num_parts)  # the writer appends one part per PART_ROWS chunks
    scale_serve.write_store(root, num_chunks, "random")
    publish_generation(Store.open(str(root)), "bench")


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(root: Path, repeats: int) -> dict:
    from pipeline.generations import parts_checks
    from pipeline.store import Store
    from pipeline.verify import verify

    store = Store.open(str(root))
    checks = parts_checks(store)
    assert all(c.ok for c in checks)
    report = verify(store)
    assert report.ok, [f.detail for f in report.problems]
    return {"index_parts": checks[0].num_present, "chunk_parts": checks[1].num_present,
            "index_rows": report.counts["index_rows"],
            "check_ms": timed(lambda: parts_checks(Store.open(str(root))), repeats * 4) * 1e3,
            "verify_s": timed(lambda: verify(Store.open(str(root))), repeats),
            "deep_s": timed(lambda: verify(Store.open(str(root)), deep=True), max(1, repeats // 2))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    small, large = (5_000, 50_000) if args.quick else (20_000, 200_000)
    cases = [(small, 8), (large, 8), (small, 80)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="qvpic-store-check-") as tmp:
        for i, (num_chunks, num_parts) in enumerate(cases):
            root = Path(tmp) / f"store-{i}"
            build(root, num_chunks, num_parts)
            result = measure(root, args.repeats)
            print(num_chunks, result, flush=True)
            rows.append([f"{num_chunks:,}", f"{result['index_parts']} + {result['chunk_parts']}",
                         f"{result['index_rows']:,}", f"{result['check_ms']:.2f}", f"{result['verify_s']:.2f}",
                         f"{result['deep_s']:.2f}"])
    body = markdown_table(["chunks", "index + chunk parts", "index rows", "parts check (ms)", "verify (s)",
                           "verify --deep (s)"], rows)
    body += ("\n\nThe parts check is what `qvpic serve` (the app builder's preflight) and every publish run "
             "first: compare the first two rows (10x the chunks, same parts) with the first and third (same "
             "chunks, 10x the parts). `verify` and `--deep` stream every index row; --deep also reads and "
             "checksums every entry (here all entries share one small shard, so it measures the per-row cost, "
             "not disk bandwidth). Measured on a shared 2-core machine under load: read the ratios.")
    write_section("store-check", "Store consistency: the start-up parts check and `qvpic verify`",
                  "python -m benchmarks.store_check " + " ".join(argv if argv is not None else sys.argv[1:]), body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
