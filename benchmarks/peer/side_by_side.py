"""Side by side with vLLM (issue 23): the same bench-qwen checkpoint, chunks and questions in the engine users
would pick instead. Needs the peer venv (`make peer-vllm`); not part of `make test` or CI.

    python -m benchmarks.peer.side_by_side --oracle     # greedy float32 agreement of full_text/full_image with vLLM
    python -m benchmarks.peer.side_by_side --quick      # TTFT and decode side by side, small (≲10 min on 2 cores)

One process per engine, never at once: qvpic runs in this process, vLLM in the peer venv's Python
(benchmarks/peer/vllm_side.py), with the same cores (this process's torch threads; vLLM's
`VLLM_CPU_OMP_THREADS_BIND` set to as many, benchmarks/peer/engine.py). The oracle is benchmarks/peer/oracle.py.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.peer import engine, oracle
from jobs.help import HelpFormatter
from pipeline.eval import write_section
from pipeline.runtime import VLM, resolve_path
from schemas.config import DType, ModelSpec
from schemas.modes import Mode


def run_oracle(spec: ModelSpec, per_mode: int) -> tuple[str, bool]:
    """The oracle's section, and whether its target was met."""
    with tempfile.TemporaryDirectory(prefix="qvpic-oracle-") as folder:
        reqs = oracle.requests(spec, Path(folder), per_mode)
        vlm = VLM(spec)
        started = time.perf_counter()
        ours = oracle.run_qvpic(vlm, reqs)
        qvpic_s = time.perf_counter() - started
        control = oracle.run_qvpic(vlm, oracle.reordered(reqs))  # the negative controls: chunks reversed, ...
        images = [r for r in reqs if r.mode is Mode.FULL_IMAGE]
        with oracle.transposed_grids(vlm):  # ... and the image grids' M-RoPE axes swapped
            moved = oracle.run_qvpic(vlm, images)
        pages = max(sum(len(p) for p in r.pieces if not isinstance(p, str)) for r in reqs)
        job = engine.job(spec, pages, [{"kind": "oracle", "max_tokens": oracle.NEW_TOKENS,
                                            "requests": [r.parts() for r in reqs]}])
        del vlm
        started = time.perf_counter()
        theirs = engine.run_job(job)[0]["results"]
        vllm_s = time.perf_counter() - started
    table, met = oracle.report(reqs, ours, theirs)
    image_idx = [i for i, r in enumerate(reqs) if r.mode is Mode.FULL_IMAGE]
    their_images = [theirs[i] for i in image_idx]
    grid_control = oracle.control_agreement(images, moved, their_images, (Mode.FULL_IMAGE,), multi_chunk=False)
    gaps = "; ".join(
        f"{mode.value}: {oracle.margin_gap(reqs, ours, theirs, mode)} as compiled, "
        f"{oracle.margin_gap(reqs, control, theirs, mode)} with chunks reversed"
        + (f", {oracle.margin_gap(images, moved, their_images, mode)} with grids transposed"
           if mode is Mode.FULL_IMAGE else "") for mode in (Mode.FULL_TEXT, Mode.FULL_IMAGE))
    verdict = (f"Target: the same first token and first {oracle.NEW_TOKENS} tokens on ≥{oracle.TARGET_SHARE:.0%} "
               f"of the requests of each mode — **{'met' if met else 'missed'}**.\n\nNegative control: qvpic given "
               f"each 2–3-chunk request's chunks in reverse order, against vLLM's answers to the original order — "
               f"same first {oracle.NEW_TOKENS} tokens on {oracle.control_agreement(reqs, control, theirs)} "
               f"(were these near the agreement above, it would say nothing about prompt building). Second control, "
               f"images only: every image token's M-RoPE height and width positions swapped, nothing else changed "
               f"(benchmarks/peer/oracle.py `transposed_grids`) — same first {oracle.NEW_TOKENS} tokens on "
               f"{grid_control}.\n\nLogits, not just tokens: |qvpic's first-step margin − vLLM's| (top-1 − top-2 logit "
               f"at the first new token; median / max over the requests) — {gaps}. Float32 kernels of two "
               f"engines differ by rounding only, so the as-compiled gap is the floor a control must clear.")
    return (f"{spec.path} {spec.dtype.value}, greedy, {torch.get_num_threads()} threads for each engine; "
            f"{per_mode} requests per mode, 1–3 of the store's first {oracle.POOL_CHUNKS} chunks "
            f"({oracle.CHUNK_TOKENS}-token chunks, pages at the lowest tier) in a random order, then the question. "
            f"qvpic: `VLM.prefill_full` + greedy steps ({qvpic_s:.0f} s); vLLM: `LLM.chat` with the checkpoint's "
            f"chat template, images as base64 PNG, the same min/max pixels ({vllm_s:.0f} s, engine start "
            f"included).\n\n{table}\n\n{verdict}"), met


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.peer.side_by_side", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--oracle", action="store_true", help="the correctness oracle instead of the timings")
    p.add_argument("--quick", action="store_true", help="fewer rounds and requests")
    p.add_argument("--model", default="bench-qwen")
    p.add_argument("--dtype", type=DType, default=None, choices=list(DType),
                   help="default: float32 (bf16 is unmeasurably slow on a CPU without AVX-512)")
    p.add_argument("--per-mode", type=int, default=25, help="oracle requests per mode (both modes: 50)")
    p.add_argument("--no-write", action="store_true", help="do not update docs/BENCHMARKS.md")
    args = p.parse_args(argv)
    command = ("python -m benchmarks.peer.side_by_side " + " ".join(argv)).strip()
    spec = ModelSpec(path=args.model, dtype=args.dtype or DType.FLOAT32, device="cpu")
    resolve_path(spec)  # build the checkpoint once, before either engine starts
    met = True
    if args.oracle:
        body, met = run_oracle(spec, args.per_mode)
        name, title = "peer-vllm-oracle", "vLLM as a correctness oracle for full prefill (issue 23)"
    else:
        from benchmarks.peer import speed

        with tempfile.TemporaryDirectory(prefix="qvpic-peer-") as folder:
            name, title, body = "peer-vllm", "Side by side with vLLM: TTFT and decode (issue 23)", \
                speed.run(spec, args.quick, Path(folder))
    print(body, flush=True)
    if not args.no_write:
        write_section(name, title, command, body)
    return 0 if met else 1  # a missed oracle target fails the command, not only its table


if __name__ == "__main__":
    sys.exit(main())
