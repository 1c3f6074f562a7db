"""What checking a store costs: the parts check serving and every publish run first, and `qvpic verify`.

Synthetic stores written through the Store API (benchmarks/scale/scale_serve.py's writer: 3 entries a chunk,
every entry pointing at one real shard) and published, at two sizes with the same number of parts and
at one size with ten times the parts, so the table shows what each cost grows with: the parts check
must follow the number of parts (a listing, one small read) and not the number of chunks; a shallow
verify streams every index row once against one shard listing (plus the coverage join); --deep also
reads and checksums every entry. Medians of `--repeats` runs, side by side in one process.

    python -m benchmarks.scale.store_check            # 20k and 200k chunks
    python -m benchmarks.scale.store_check --quick    # 5k and 50k chunks
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.scale import scale_serve
from pipeline.eval import markdown_table, write_section


def build(root: Path, num_chunks: int, num_parts: int) -> None:
    from pipeline.store import Store, publish_generation

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


PROBE_RANGE_ROWS = 25_000  # key range of the memory probe: small, so the runs span one range and several

PEAK_PROBE = """
import json, sys, time
import pipeline.store.check.key_ranges
from pipeline.store.store import Store
from pipeline.store.check.checks import verify
pipeline.store.check.key_ranges.RANGE_ROWS = int(sys.argv[3])
verify(Store.open(sys.argv[4]))  # warm: lazy imports and kernel set-up are not the store's cost
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current size
before = {l.split(":")[0]: int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(("VmRSS", "VmHWM"))}
report = verify(Store.open(sys.argv[1]), deep=sys.argv[2] == "deep")
after = {l.split(":")[0]: int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")}
print(json.dumps({"ok": report.ok, "peak_growth_mib": (after["VmHWM"] - before["VmRSS"]) / 1024}))
"""


def peak_growth_mib(root: Path, deep: bool, warm_root: Path) -> float:
    """How far a fresh process's peak resident memory rises above its post-import size during a verify."""
    out = subprocess.run([sys.executable, "-c", PEAK_PROBE, str(root), "deep" if deep else "shallow",
                          str(PROBE_RANGE_ROWS), str(warm_root)],
                         capture_output=True, text=True, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["ok"]
    return result["peak_growth_mib"]


def measure(root: Path, repeats: int, warm_root: Path) -> dict:
    from pipeline.store import Store, parts_checks
    from pipeline.store.check import verify

    store = Store.open(str(root))
    checks = parts_checks(store)
    assert all(c.ok for c in checks)
    report = verify(store)
    assert report.ok, [f.detail for f in report.problems]
    return {"index_parts": checks[0].num_present, "chunk_parts": checks[1].num_present,
            "index_rows": report.counts["index_rows"],
            "check_ms": timed(lambda: parts_checks(Store.open(str(root))), repeats * 4) * 1e3,
            "verify_s": timed(lambda: verify(Store.open(str(root))), repeats),
            "deep_s": timed(lambda: verify(Store.open(str(root)), deep=True), max(1, repeats // 2)),
            "verify_peak_mib": peak_growth_mib(root, False, warm_root),
            "deep_peak_mib": peak_growth_mib(root, True, warm_root)}


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
            result = measure(root, args.repeats, Path(tmp) / "store-0")
            print(num_chunks, result, flush=True)
            rows.append([f"{num_chunks:,}", f"{result['index_parts']} + {result['chunk_parts']}",
                         f"{result['index_rows']:,}", f"{result['check_ms']:.2f}", f"{result['verify_s']:.2f}",
                         f"{result['deep_s']:.2f}", f"{result['verify_peak_mib']:.0f} / {result['deep_peak_mib']:.0f}"])
    body = markdown_table(["chunks", "index + chunk parts", "index rows", "parts check (ms)", "verify (s)",
                           "verify --deep (s)", "peak RSS growth MiB (verify / --deep)"], rows)
    body += ("\n\nThe parts check is what `qvpic serve` (the app builder's preflight) and every publish run "
             "first: compare the first two rows (10x the chunks, same parts) with the first and third (same "
             "chunks, 10x the parts). `verify` and `--deep` stream every index row; --deep also reads and "
             "checksums every entry (here all entries share one small shard, so it measures the per-row cost, "
             "not disk bandwidth). Peak RSS growth: how far a fresh process's peak resident memory rises during "
             "one verify above its size after a warm-up verify of the smallest store, with key ranges of "
             f"{PROBE_RANGE_ROWS:,} rows (default 250,000: the coverage join holds one range, Arrow's own peak "
             "about 0.45 KB a row). Most of what still grows with the rows is allocator retention, not live "
             "data: Arrow's mimalloc pool keeps freed pages (its own peak allocation in that pass is ~14 MiB at "
             "150k rows; with `ARROW_DEFAULT_MEMORY_POOL=system` the growth roughly halves). Measured on a "
             "shared 2-core machine under load: read the ratios.")
    write_section("store-check", "Store consistency: the start-up parts check and `qvpic verify`",
                  "python -m benchmarks.scale.store_check " + " ".join(argv if argv is not None else sys.argv[1:]),
                  body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
