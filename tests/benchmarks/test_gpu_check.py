"""benchmarks/gpu_check (issue 59 item 6): the dry run is what CI can check of a script written for a GPU box —
that it starts, gates each step on what it needs, writes a line per step, and that a hung step is cut by its own
timeout while the next step still runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.gpu_check import STEPS

REPO = Path(__file__).resolve().parents[2]


def run(out: Path, *extra: str) -> tuple[int, list[dict]]:
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--dry", "--out", str(out), *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    lines = [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]
    return done.returncode, lines


def test_every_step_writes_a_line_ok_or_skipped_with_a_reason(tmp_path):
    code, lines = run(tmp_path)
    assert [line["step"] for line in lines] == [step.name for step in STEPS]
    for line in lines:
        assert line["status"] in ("ok", "skipped"), line
        if line["status"] == "skipped":
            assert line["reason"], line
    assert code == 0
    by = {line["step"]: line for line in lines}
    assert by["preflight"]["versions"]["torch"] and "sdpa" in by["preflight"]
    assert by["decode"]["results"] and by["attention"]["results"]  # the CPU analogues ran, not only skipped
    engine = by["engine"]  # the engine end to end, without Ray (serve.metrics keeps its Prometheus sink alone)
    assert engine["status"] == "ok" and engine["ttft_ms"]["p50"] > 0 and len(engine["checks"]) == 3, engine
    # the engine's pinned SDPA set is recorded (issue 59 item 3), with its pick and time beside the dispatcher's
    assert by["attention"]["engine_backends"] == ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]
    assert all("engine_chosen" in row and "engine_ms" in row for row in by["attention"]["results"])


def test_a_hung_step_is_cut_by_its_timeout_and_the_next_still_runs(tmp_path):
    code, lines = run(tmp_path, "--only", "preflight,attention", "--hang", "preflight", "--timeout", "preflight=4")
    hung, after = lines
    assert hung["step"] == "preflight" and hung["status"] == "timed_out" and hung["wall_s"] < 60
    assert after["step"] == "attention" and after["status"] == "ok"
    assert code == 1  # a timed-out step fails the run


def test_a_spent_budget_skips_the_step_saying_so(tmp_path):
    _, lines = run(tmp_path, "--only", "preflight", "--budget-s", "0")
    assert lines == [dict(lines[0], step="preflight", status="skipped")] and "budget" in lines[0]["reason"]
