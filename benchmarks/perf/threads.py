"""Which thread runs the forward (pipeline/runtime/threads.py): one token of bench-qwen over a 600-column context,
the model loaded and run in three arrangements, each in a fresh process (libgomp keeps a thread's pool for the
thread's life, so one process cannot show two arrangements):

    loader    the forward on the thread that loaded the model (`limits` measures this way)
    other     on another thread, the loading thread still alive (a Serve replica before: the model loaded on
              the replica's event-loop thread, the engine on its own thread)
    passing   on another thread, the model loaded on a thread that has ended (the generator now)

    python -m benchmarks.perf.threads             # fp32 and bf16 (where native), 3 rounds, shuffled
    python -m benchmarks.perf.threads --quick     # 1 round
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time

import torch

from benchmarks.tools.machine import machine_line
from jobs.help import HelpFormatter
from pipeline.eval import markdown_table, write_section

ARRANGEMENTS = ("loader", "other", "passing")
CONTEXT, STEPS, WARM_UP = 600, 60, 10


def measure(arrangement: str, dtype: str, model: str) -> float:
    """Median ms of one-token forwards in `arrangement` (run in this process, which must be fresh)."""
    from benchmarks.perf.limits import context_slab
    from pipeline.runtime import VLM, in_passing_thread
    from schemas.config import DType, ForwardSpec, ModelSpec
    from serve.engine.qvpic.batch import decode_step

    def load():
        vlm = VLM(ModelSpec(path=model, dtype=DType(dtype), device="cpu"))
        vlm.use_forward(ForwardSpec())
        with torch.inference_mode():
            return vlm, context_slab(vlm, 1, CONTEXT, 2)

    def steps(vlm, slab) -> float:
        times = []
        with torch.inference_mode():
            for _ in range(WARM_UP + STEPS):
                slab.lengths[:] = CONTEXT
                slab.next_positions[:] = CONTEXT
                slab.valid[:, CONTEXT:] = False
                slab.read_back()  # the host's bookkeeping too (serve/engine/qvpic/batch.py `Slab`)
                started = time.perf_counter()
                decode_step(vlm, slab, [5])
                times.append((time.perf_counter() - started) * 1e3)
        return statistics.median(times[WARM_UP:])

    vlm, slab = in_passing_thread(load) if arrangement == "passing" else load()
    if arrangement == "loader":
        return steps(vlm, slab)
    return in_passing_thread(steps, vlm, slab, name="engine-like")  # this thread, the loader or not, stays alive


def dtypes() -> list[str]:
    native_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()  # bf16 only where the CPU has it, as `limits`
    return ["float32"] + (["bfloat16"] if native_bf16 else [])


def run(model: str, rounds: int) -> dict[tuple[str, str], list[float]]:
    cells = [(a, d) for a in ARRANGEMENTS for d in dtypes()]
    out: dict[tuple[str, str], list[float]] = {cell: [] for cell in cells}
    for r in range(rounds):
        random.Random(r).shuffle(cells)
        for arrangement, dtype in cells:
            done = subprocess.run([sys.executable, "-m", "benchmarks.perf.threads", "--one", arrangement, dtype,
                                   "--model", model], capture_output=True, text=True, check=True)
            out[(arrangement, dtype)].append(json.loads(done.stdout.strip().splitlines()[-1])["ms"])
            print(f"round {r + 1}: {arrangement:8s} {dtype:9s} {out[(arrangement, dtype)][-1]:.2f} ms", flush=True)
    return out


def report(out: dict[tuple[str, str], list[float]], model: str, rounds: int) -> str:
    rows = []
    for dtype in dict.fromkeys(d for _, d in out):
        ms = {a: statistics.median(out[(a, dtype)]) for a in ARRANGEMENTS}
        rows.append([dtype, *(ms[a] for a in ARRANGEMENTS), ms["other"] / ms["loader"], ms["passing"] / ms["loader"]])
    return (f"Machine: {machine_line()}. {model}, one token over {CONTEXT} columns, median of {STEPS} forwards per "
            f"process, median over {rounds} processes per cell (shuffled order).\n\n"
            + markdown_table(["dtype", "on the loading thread ms", "another thread, loader alive ms",
                              "another thread, loaded on an ended thread ms", "other / loader", "passing / loader"],
                             rows) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.perf.threads", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 round instead of 3")
    p.add_argument("--model", default="bench-qwen")
    p.add_argument("--no-write", action="store_true", help="do not update docs/BENCHMARKS.md")
    p.add_argument("--one", nargs=2, metavar=("ARRANGEMENT", "DTYPE"), help=argparse.SUPPRESS)  # a child's cell
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps({"ms": measure(args.one[0], args.one[1], args.model)}))
        return 0
    rounds = 1 if args.quick else 3
    body = report(run(args.model, rounds), args.model, rounds)
    print(body)
    if not args.no_write:
        command = "python -m benchmarks.perf.threads" + (" --quick" if args.quick else "")
        print(write_section("threads", "Which thread runs the forward: one OpenMP pool per process", command, body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
