"""The runner: each step in a subprocess under its own timeout, one JSON line per step the moment it ends, a total
budget, a summary table at the end. Imports no torch itself: a broken CUDA install is a step's failure, not ours."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from benchmarks.gpu_check import BUDGET_S, DRY_TIMEOUT_S, STEPS

REPO = Path(__file__).resolve().parents[2]
MIN_STEP_S = 5  # a step given less than this is skipped for the budget, not started


def unpack_wheels(wheels: Path, into: Path) -> list[str]:
    """Every `.whl` under `wheels` unpacked into `into` (a wheel is a zip of its site-packages tree): no pip."""
    names = []
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(into)
        names.append(wheel.name)
    return names


def run_step(step, args, timeout_s: float, env: dict, workdir: Path) -> dict:
    result = workdir / f"{step.name}.json"
    command = [sys.executable, "-m", "benchmarks.gpu_check.step", step.name, str(result)]
    command += ["--dry"] * args.dry + ["--hang"] * (step.name in args.hang)
    started = time.monotonic()
    # its own process group: a timeout kills whatever the step started too
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        timed_out = True
    line = {"step": step.name, "wall_s": round(time.monotonic() - started, 2), "timeout_s": round(timeout_s, 1)}
    try:
        line.update(json.loads(result.read_text()))
    except (OSError, ValueError):
        line["status"] = "error"
    if timed_out:
        line["status"], line["reason"] = "timed_out", f"cut at its {timeout_s:.0f} s timeout"
    elif line.get("status") == "running":  # the process died without a verdict (a crash, a segfault)
        line["status"], line["reason"] = "error", f"exit code {process.returncode} with no verdict"
    if line["status"] in ("error", "timed_out"):
        line["output_tail"] = (output or "")[-2000:]
    return line


def summary(lines: list[dict]) -> str:
    rows = [f"{'step':<13} {'status':<10} {'wall s':>7}  reason / headline"]
    for line in lines:
        note = line.get("reason") or line.get("headline") or ""
        rows.append(f"{line['step']:<13} {line['status']:<10} {line['wall_s']:>7.1f}  {str(note)[:100]}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--dry", action="store_true", help="every step on CPU at tiny shapes (CI)")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="where gpu_check.jsonl goes (default $OUT)")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="total wall time for all steps")
    p.add_argument("--only", default="", help="comma-separated step names (default: all)")
    p.add_argument("--timeout", action="append", default=[], metavar="STEP=S", help="one step's timeout, seconds")
    p.add_argument("--wheels", type=Path, default=None, help="a folder of .whl files put on the steps' path")
    p.add_argument("--hang", default="", help=argparse.SUPPRESS)  # steps made to hang: the timeout's control
    args = p.parse_args(argv)
    args.hang = set(filter(None, args.hang.split(",")))
    only = set(filter(None, args.only.split(",")))
    overrides = {name: float(seconds) for name, seconds in (item.split("=", 1) for item in args.timeout)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "gpu_check.jsonl"
    jsonl.write_text("")
    deadline = time.monotonic() + args.budget_s
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    carried = REPO / "gpu_check_models"  # tiny checkpoints carried to a box that cannot build them (exactness)
    if carried.is_dir() and "QVPIC_MODEL_CACHE" not in env:
        env["QVPIC_MODEL_CACHE"] = str(carried)
    lines = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        workdir = Path(tmp)
        if args.wheels is not None:
            site = workdir / "site"
            print(f"wheels unpacked: {', '.join(unpack_wheels(args.wheels, site)) or 'none'}", flush=True)
            env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
        for step in STEPS:
            if only and step.name not in only:
                continue
            left = deadline - time.monotonic()
            timeout_s = min(overrides.get(step.name, DRY_TIMEOUT_S if args.dry else step.timeout_s), left)
            if left < MIN_STEP_S:
                line = {"step": step.name, "status": "skipped", "wall_s": 0.0,
                        "reason": f"budget: {max(0.0, left):.0f} s of --budget-s {args.budget_s:.0f} left"}
            else:
                print(f"[gpu_check] {step.name}: {step.what} (≤ {timeout_s:.0f} s)", flush=True)
                line = run_step(step, args, timeout_s, env, workdir)
            lines.append(line)
            with jsonl.open("a") as f:  # the moment it ends: a run cut short keeps every step before
                f.write(json.dumps(line, default=str) + "\n")
    print(summary(lines), flush=True)
    print(f"results: {jsonl}", flush=True)
    bad = [line for line in lines if line["status"] in ("failed", "error", "timed_out")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
