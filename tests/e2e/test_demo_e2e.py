"""`qvpic demo` end to end, as `make demo` runs it: the bundled corpus ingested by Ray Data, the Serve app on
loopback, the questions over HTTP and every mode side by side — exit 0, every table, and nothing a user
should not have to read (tracebacks, Ray's INFO lines, C++ log lines, deprecation warnings)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from schemas.modes import Mode
from tests.support.paths import REPO
from tests.support.ray_fixtures import SUITE_RAY_ENV, free_port

pytestmark = pytest.mark.e2e
ROOT = REPO
QUESTIONS = [json.loads(line) for line in (ROOT / "jobs" / "data" / "questions.jsonl").read_text().splitlines()
             if line.strip()]
NOISE = ("Traceback", " INFO ", "core_worker.cc", "Connecting to existing Serve app", "graceful_shutdown",
         "RayDeprecationWarning", "DeprecationWarning", "Loading weights", "(raylet)", "not writable")


def qvpic() -> list[str]:
    """The console script installed beside this interpreter (as `make demo` runs it), else the module."""
    script = Path(sys.executable).parent / "qvpic"
    return [str(script)] if script.exists() else [sys.executable, "-m", "jobs.cli"]


# CI (.ci/run) runs `make demo` just before `make test` and names its log here: the test then reads the run a
# user's first command makes instead of making a second one (~2.5 min on 2 cores).
DEMO_LOG = os.environ.get("QVPIC_DEMO_LOG")


def logged_demo(log: Path) -> tuple[subprocess.CompletedProcess, Path]:
    """`make demo` as .ci/run logged it. What make printed before its recipe line (`…/qvpic demo`) is the venv's
    install, not the demo's. Exit 0: .ci/run stops before `make test` when `make demo` fails (pipefail)."""
    lines = log.read_text().splitlines(keepends=True)
    start = max(i for i, line in enumerate(lines) if line.rstrip().endswith("/qvpic demo"))
    output = "".join(lines[start + 1:])
    stays = re.search(r"The store stays in\s+(\S+)", output)
    assert stays, f"the demo's last line is missing from {log}:\n{output[-4000:]}"
    return subprocess.CompletedProcess(["make", "demo"], 0, output, ""), ROOT / stays.group(1)


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    if DEMO_LOG:
        yield logged_demo(Path(DEMO_LOG))
        return
    store = tmp_path_factory.mktemp("demo") / "store"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "160"}
    env.pop("QVPIC_LOG_LEVEL", None)  # the default a user gets: quiet
    for key in SUITE_RAY_ENV:  # and Ray's own worker pool
        env.pop(key, None)
    done = subprocess.run([*qvpic(), "demo", "--store", str(store), "--port", str(free_port()), "--repeats", "1"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=1500)
    yield done, store
    shutil.rmtree(store, ignore_errors=True)


@pytest.mark.timeout(1600)
def test_demo_runs_end_to_end_and_says_only_what_a_user_needs(demo):
    done, store = demo
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    # 1. the ingest summary: every document accounted for
    assert "ingest ingest-" in output and "accounted" in output and "│ yes" in output
    assert "compiled entries" in output and "high.template" in output
    # 3. the questions table: every bundled question asked over HTTP
    assert "qvpic mode: top-6 retrieval" in output
    asked = output.split("3. ask over HTTP")[1].split("4. what qvpic buys")[0]
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in asked.splitlines() if line.startswith("│")]
    answered = [row for row in rows if row[1] in {"yes", "no"}]  # a question's first line: gold doc, tiers, TTFT
    assert len(answered) == len(QUESTIONS), asked
    assert all(float(row[4]) > 0 and int(row[3]) > 0 for row in answered)
    assert sum(row[1] == "yes" for row in answered) >= len(QUESTIONS) // 2  # retrieval finds most gold documents
    assert "TTFT: route + KV load + re-anchor + query prefill" in output
    # 4. every mode side by side, with qvpic as the unit of the ratio column, and the caption explaining it
    table = output.split("every mode, same request")[1]
    for mode in Mode:
        assert f"│ {mode.value} " in table, mode
    qvpic_row = next(line for line in table.splitlines() if line.startswith("│ qvpic "))
    assert qvpic_row.rstrip(" │").endswith("1.00")
    assert "× qvpic: the mode's TTFT divided by qvpic's" in " ".join(table.split())
    for mode in ("full_text", "full_image"):  # a full prefill computes its whole context: nothing came cached
        row = next(line for line in table.splitlines() if line.startswith(f"│ {mode} "))  # (a warm prefix cache
        assert row.split("│")[3].strip() == "0", row                                  # would hold it all)
    # the response cache, asked once without no-cache, answers and says so
    assert "came from the response cache (level l1, `cache_hit: true`)" in " ".join(output.split())
    assert "done. The store stays in" in output and (store / "manifest.json").exists()
    for noise in NOISE:
        assert noise not in output, f"{noise!r} in the demo's output:\n{output[-4000:]}"
