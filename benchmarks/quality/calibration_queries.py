"""Which calibration queries predict the recall real queries get from an IVF index.

An IVF's `nprobe` is calibrated on synthetic queries (pipeline/store/catalog/ann_calibration.py); the choice is only
as good as their recall curve is close to real queries'. On a realistic store (MiniLM embeddings of
real sentences synthesised to N rows, benchmarks/tools/realistic_vectors.py), this measures recall@8 against
exact search at several `nprobe` for: held-out real sentences (the stand-in for real questions),
stored rows held out of their own answers, and stored rows moved to cosine c in a random direction
for several c. The production index is used (int8 codes, float16 rerank of 64 candidates).

    python -m benchmarks.quality.calibration_queries            # 300k rows
    python -m benchmarks.quality.calibration_queries --quick    # 50k rows
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from pipeline.eval import markdown_table, write_section

NPROBES = (2, 5, 10, 20, 40, 80)
COSINES = (0.5, 0.4, 0.3, 0.2)
K, CANDIDATES, NUM_QUERIES = 8, 64, 256


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quality.calibration_queries", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=300_000)
    parser.add_argument("--quick", action="store_true", help="50k rows")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    rows_wanted = 50_000 if args.quick else args.rows

    import faiss

    from benchmarks.tools.realistic_vectors import Synthesizer, embedded
    from pipeline.store.catalog import EmbeddingRows, calibration_queries, code_scale, exact_top_k, recall_at_k
    from pipeline.store.catalog.vector_index import _ivf
    from schemas.generation import SearchSpec

    started = time.perf_counter()
    base, real, _ = embedded(5_000, NUM_QUERIES + 20)
    rng = np.random.default_rng(0)
    rows = EmbeddingRows.of(Synthesizer(base).rows(rows_wanted, rng).astype(np.float16))
    scale = code_scale(rows)
    ivf = _ivf(rows, scale, SearchSpec(), seed=0)

    def curve(queries: np.ndarray, exclude: np.ndarray | None = None) -> list[float]:
        exclude = np.full(len(queries), -1) if exclude is None else exclude
        truth = exact_top_k(rows, queries, K, exclude)
        out = []
        for nprobe in NPROBES:
            _, found = ivf.search(queries * scale, CANDIDATES + 1, params=faiss.SearchParametersIVF(nprobe=nprobe))
            answers = np.stack([rows.rerank(q, f[(f >= 0) & (f != x)], K)[0]
                                for q, f, x in zip(queries, found, exclude)])
            out.append(recall_at_k(answers, truth))
        return out

    sources = np.sort(rng.choice(len(rows), NUM_QUERIES, replace=False))
    stored = rows.take(sources).astype(np.float32)
    table = [["held-out real sentences", *curve(real[:NUM_QUERIES].astype(np.float32))],
             ["stored rows, each held out of its answers", *curve(stored, sources)]]
    table += [[f"stored rows moved to cosine {c}", *curve(calibration_queries(stored, c, rng))] for c in COSINES]
    default = SearchSpec().calibration_query_cosine
    body = (f"{len(rows):,} realistic rows (MiniLM embeddings of 5,000 real sentences, synthesised), IVF of "
            f"{ivf.nlist} lists with int8 codes, {NUM_QUERIES} queries a row; recall@{K} against exact search "
            f"after the float16 rerank of {CANDIDATES} candidates, by `nprobe`:\n\n"
            + markdown_table(["queries", *(f"nprobe {n}" for n in NPROBES)], table)
            + f"\n\nThe calibration's default is cosine {default}: the curve closest to the real sentences' and "
              "not above it, so the `nprobe` it picks for a target recall serves at least about that recall. Stored "
              "rows held out of their answers overstate it most: a synthesised row has near-copies. Wall time "
              f"{time.perf_counter() - started:.0f} s.\n")
    print(body)
    if not args.no_write:
        write_section("calibration-queries", "IVF calibration queries against real ones",
                      "python -m benchmarks.quality.calibration_queries" + (" --quick" if args.quick else ""), body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
