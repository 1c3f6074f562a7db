"""`qvpic bench`: suite listing and dispatch, and the TTFT benchmark's CPU path through benchmarks/gpu.sh."""

from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from jobs import bench
from schemas.config import Mode

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def fake_suites(monkeypatch):
    """Two fake suite modules: one taking options, one taking none; records what each was called with."""
    calls: list[tuple[str, list[str] | None]] = []
    with_options = types.ModuleType("fake_with_options")
    with_options.__spec__ = importlib.machinery.ModuleSpec("fake_with_options", None)
    with_options.main = lambda argv=None: calls.append(("with", argv)) or 0
    without_options = types.ModuleType("fake_without_options")
    without_options.__spec__ = importlib.machinery.ModuleSpec("fake_without_options", None)
    without_options.main = lambda: calls.append(("without", None)) or 3
    monkeypatch.setitem(sys.modules, "fake_with_options", with_options)
    monkeypatch.setitem(sys.modules, "fake_without_options", without_options)
    suites = (bench.Suite("with", "fake_with_options", "takes options", ("--quick",)),
              bench.Suite("without", "fake_without_options", "takes none", ()),
              bench.Suite("slow", "fake_with_options", "not in all", None),
              bench.Suite("absent", "benchmarks.no_such_suite", "missing here", ()))
    monkeypatch.setattr(bench, "SUITES", suites)
    monkeypatch.setattr(bench, "BY_NAME", {s.name: s for s in suites})
    return calls


def test_listing_names_every_real_suite(capsys):
    assert bench.main(["--help"]) == 0
    out = capsys.readouterr().out
    for suite in bench.SUITES:
        assert f"  {suite.name} " in out
    assert all(s.available for s in bench.SUITES if s.name in {"ttft", "runtime", "ingest", "legibility", "render"})


def test_dispatch_passes_options_and_rejects_bad_calls(fake_suites, capsys):
    assert bench.main(["with", "--repeats", "2"]) == 0
    assert fake_suites == [("with", ["--repeats", "2"])]
    assert bench.main(["without"]) == 3
    for argv, message in ((["without", "--x"], "takes no options"), (["nope"], "unknown suite 'nope'"),
                          (["absent"], "not in this checkout"), (["all", "--x"], "takes no options")):
        assert bench.main(argv) == 2
        assert message in capsys.readouterr().err


def test_all_runs_the_quick_suites_that_exist(fake_suites):
    assert bench.main(["all"]) == 3  # the worst exit code of the suites run
    assert fake_suites == [("with", ["--quick"]), ("without", None)]


def test_no_suite_runs_all(fake_suites):
    assert bench.main([]) == 3
    assert fake_suites == [("with", ["--quick"]), ("without", None)]


def test_gpu_script_cpu_fallback_runs_the_ttft_benchmark(tmp_path):
    """No CUDA here (and hidden if there is one): the script runs the same benchmark on the tiny model."""
    out = tmp_path / "ttft.md"
    # PY: this interpreter, whose environment has the requirements; a bare `python3` may be another Python,
    # which the script would install the whole project into
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PY": sys.executable}
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu.sh"), str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no CUDA device" in done.stderr
    text = out.read_text()
    ttft_table = text.split("TTFT, median ms")[1].split("\n\n")[1]
    rows = [line for line in ttft_table.splitlines() if line.startswith("| tiny-qwen")]
    assert [row.split("|")[3].strip() for row in rows] == ["2", "4"]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        ttfts = [float(c) for c in cells[3:3 + len(Mode)]]
        assert all(t > 0 for t in ttfts)
    tokens = text.split("Context tokens")[1].split("\n\n")[1]
    for line in (l for l in tokens.splitlines() if l.startswith("| tiny-qwen")):
        counts = dict(zip([m.value for m in Mode], (c.strip() for c in line.strip("|").split("|")[2:])))
        assert counts["full_text"] == counts["text_pic"] and counts["full_image"] == counts["qvpic"]
        assert int(counts["image_pic"].split()[0]) < int(counts["uniform_high"].split()[0])
    for entry in ("high.template", "low.plain", "low.template", "text.text"):
        assert f"| {entry} |" in text
    assert "Online path over HTTP" not in text  # --no-http in the fallback
