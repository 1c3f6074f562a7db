"""Runtime benchmark: full prefill of the context vs query-only prefill on an assembled cache.

Measures, in one process and side by side (medians of `repeats` runs):
  - full prefill of `[prefix][context ≈ context_tokens][query]`,
  - linking the same context from compiled chunks: assembly + re-anchoring, then the query prefill,
  - re-anchoring alone per 1k cached tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pipeline.eval import markdown_table, write_section
from pipeline.runtime import VLM
from schemas.config import DType, ModelSpec

FILLER = (
    "The quarterly maintenance report lists part XK-4471-B, shipped on 12 March to the Oslo depot, and "
    "invoice 88213 paid by Marta Oyelaran for a total of 1,093.40 euros after the agreed discount. "
)


def chunk_texts(vlm: VLM, num_chunks: int, tokens_per_chunk: int) -> list[str]:
    """`num_chunks` distinct texts of exactly `tokens_per_chunk` tokens each."""
    ids = vlm.adapter.encode(FILLER * (tokens_per_chunk // 20 + 2))
    texts = []
    for i in range(num_chunks):
        piece = vlm.adapter.encode(f"Section {i}. ") + ids
        texts.append(vlm.tokenizer.decode(piece[:tokens_per_chunk]))
    return texts


def median_s(fn, repeats: int) -> float:
    """Median seconds of `fn()` after a warm-up; CUDA work is waited for (kernels launch asynchronously)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()  # warm-up
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(model: str, dtype: DType, context_tokens: int, num_chunks: int, repeats: int) -> dict[str, float]:
    vlm = VLM(ModelSpec(path=model, dtype=dtype))
    texts = chunk_texts(vlm, num_chunks, context_tokens // num_chunks)
    query = vlm.tokenizer.decode(vlm.adapter.encode(FILLER)[:32 - len(vlm.adapter.turn_suffix_ids)])
    chunks = [vlm.compile_text(t) for t in texts]
    num_cached = sum(c.num_tokens for c in chunks)

    full_s = median_s(lambda: vlm.prefill_full(texts, query), repeats)
    assemble_s = median_s(lambda: vlm.assemble(chunks), repeats)
    context = vlm.assemble(chunks)
    prefill_s = median_s(lambda: vlm.prefill_query(context, query), repeats)
    keys = torch.cat([c.kv[:, 0] for c in chunks], dim=2)[:, :, :1024]  # [layers, kv_heads, 1024, head_dim]
    # The path `assemble` takes: one float32 matmul by the chunk's rotation matrix, cast back once.
    rotation = vlm.adapter.rotation_matrices(torch.tensor([1234], device=keys.device), keys.shape[-1])[0]
    reanchor_s = median_s(lambda: (keys.float() @ rotation).to(keys.dtype), repeats)
    return {
        "cached_tokens": num_cached, "full_prefill_s": full_s, "assemble_s": assemble_s,
        "query_prefill_s": prefill_s, "reanchor_per_1k_s": reanchor_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qvpic bench runtime", description=__doc__)
    parser.add_argument("--model", default="bench-qwen")
    parser.add_argument("--dtypes", nargs="+", type=DType, default=[DType.BFLOAT16, DType.FLOAT32])
    parser.add_argument("--context-tokens", type=int, default=4096)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-write", action="store_true", help="print only; do not update docs/BENCHMARKS.md")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for dtype in args.dtypes:
        r = run(args.model, dtype, args.context_tokens, args.chunks, args.repeats)
        rows.append([
            args.model, dtype.value, r["cached_tokens"], r["full_prefill_s"] * 1e3, r["query_prefill_s"] * 1e3,
            r["full_prefill_s"] / r["query_prefill_s"], r["assemble_s"] * 1e3, r["reanchor_per_1k_s"] * 1e3,
            r["assemble_s"] / r["query_prefill_s"],
        ])
        print(dict(zip(["model", "dtype"], rows[-1][:2])), r, flush=True)
    headers = ["model", "dtype", "cached tokens", "full prefill ms", "query prefill ms", "full / query",
               f"assembly+re-anchor of {args.chunks} chunks ms", "re-anchor per 1k tokens ms",
               "assembly / query prefill"]
    body = (
        f"{args.chunks} text chunks compiled under the template, {args.context_tokens} context tokens, a "
        f"32-token query turn, medians of {args.repeats} runs after a warm-up, one process, "
        f"{torch.get_num_threads()} torch threads. Target: assembly + re-anchoring ≤ 10% of the query prefill.\n\n"
        + markdown_table(headers, rows)
    )
    command = "python -m benchmarks.perf.runtime " + " ".join(argv or [])
    if not args.no_write:
        write_section("runtime", "Runtime: full prefill vs query-only prefill (issue 2)", command.strip(), body)
    print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
