"""The `qvpic` command line as a user meets it: `--help` answers at once and speaks the values users type;
jobs are quiet by default and loud on request."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.cli import SUBCOMMANDS
from schemas.modes import Variant
from tests.support.paths import REPO

ROOT = REPO
# Importing any of these takes seconds: `--help` must not need them.
HEAVY_MODULES = ("ray", "torch", "transformers", "sentence_transformers", "matplotlib", "serve", "pipeline.store.store")

HELP_PROBE = """
import contextlib, io, json, sys
from jobs.cli import main
out = {}
for command in sys.argv[1:]:
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        try:
            code = main([command, "--help"])
        except SystemExit as exit:
            code = exit.code
    out[command] = {"code": code, "help": text.getvalue()}
out["modules"] = sorted(sys.modules)
print(json.dumps(out))
"""


def run_python(code: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


@pytest.fixture(scope="module")
def helps() -> dict:
    result = run_python(HELP_PROBE, *SUBCOMMANDS)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_every_help_answers_without_importing_heavy_modules(helps):
    for command in SUBCOMMANDS:
        assert helps[command]["code"] == 0 and helps[command]["help"].startswith("usage:"), command
    loaded = [m for m in helps["modules"] if m.split(".")[0] in HEAVY_MODULES or m in HEAVY_MODULES]
    assert not loaded, f"`--help` imported {loaded[:8]}: import them in main, after parsing"


def test_help_shows_typed_values_and_defaults(helps):
    for command in SUBCOMMANDS:
        text = helps[command]["help"]
        assert not re.search(r"\b(DType|Variant|Mode|ModelFamily)\.[A-Z]", text), (command, text)
        assert not re.search(r"\bissues? \d|#\d", text), (command, text)  # help is for users, not the tracker
    ingest = helps["ingest"]["help"]
    variants = [v.value for v in Variant]
    assert "{float32,bfloat16,float16}" in ingest and "{" + ",".join(variants) + "}" in ingest
    assert "default: float32" in ingest and "default: " + " ".join(variants) in ingest
    assert "(default: 8000)" in helps["serve"]["help"] and "--verbose" in helps["serve"]["help"]
    assert "(default: 20080)" in helps["demo"]["help"] and "(default: tiny-qwen)" in helps["demo"]["help"]
    assert "no SUITE: all" in helps["bench"]["help"]


def test_help_formatter_negative_control():
    """Without the formatter, argparse prints enum members as Python sees them: the test above can fail."""
    import argparse

    from schemas.config import DType

    plain = argparse.ArgumentParser(prog="x")
    plain.add_argument("--dtype", type=DType, default=DType.FLOAT32, choices=list(DType))
    assert "DType.FLOAT32" in plain.format_help()


QUIET_PROBE = """
import os, sys
from jobs import logs
if "--in-process" not in sys.argv:
    logs.as_program()
logs.configure(verbose="--verbose" in sys.argv)
os.write(2, b"native line from C\\n")  # what Ray's C++ core worker does
print("python line", file=sys.stderr, flush=True)
import logging
logging.getLogger("ray.data").info("ray data info line")
logging.getLogger("qvpic.job").warning("our warning")
import warnings
warnings.warn("a library deprecation", DeprecationWarning, stacklevel=1)
print(logs.native_log_path() or "", os.environ["QVPIC_LOG_LEVEL"])
"""


def test_quiet_by_default_keeps_native_and_library_lines_out_of_the_terminal():
    result = run_python(QUIET_PROBE, env={"QVPIC_LOG_LEVEL": ""})
    assert result.returncode == 0, result.stderr
    assert "python line" in result.stderr and "our warning" in result.stderr
    assert "native line" not in result.stderr and "ray data info line" not in result.stderr
    assert "a library deprecation" not in result.stderr
    log_path, level = result.stdout.split()
    assert level == "WARNING" and "native line from C" in Path(log_path).read_text()  # kept, not lost
    Path(log_path).unlink()


@pytest.mark.parametrize("how", ["flag", "env"])
def test_verbose_or_the_env_brings_everything_back(how):
    args, env = (("--verbose",), {"QVPIC_LOG_LEVEL": ""}) if how == "flag" else ((), {"QVPIC_LOG_LEVEL": "info"})
    result = run_python(QUIET_PROBE, *args, env=env)
    assert result.returncode == 0, result.stderr
    for line in ("native line from C", "python line", "ray data info line", "our warning"):
        assert line in result.stderr, line
    assert result.stdout.split() == ["INFO"]  # no native log file: stderr is the terminal's


def test_a_job_called_in_process_leaves_its_hosts_stderr_alone():
    result = run_python(QUIET_PROBE, "--in-process", env={"QVPIC_LOG_LEVEL": ""})
    assert result.returncode == 0, result.stderr
    assert "native line from C" in result.stderr and "ray data info line" not in result.stderr
    assert result.stdout.split() == ["WARNING"]  # quiet, but no file descriptor was moved


def test_an_unknown_level_is_named_and_ignored():
    result = run_python("from jobs import logs; print(logs.level())", env={"QVPIC_LOG_LEVEL": "loud"})
    assert result.stdout.strip() == "30" and "ignoring QVPIC_LOG_LEVEL='LOUD'" in result.stderr


def test_a_rerun_says_nothing_to_compile(capsys):
    from jobs.ingest import print_summary
    from pipeline.ingest import IngestSummary

    print_summary(IngestSummary("ingest-x", inputs=3, indexed=3, deduplicated=0, quarantined={}, num_chunks=5,
                                num_chunk_texts=5, num_chunks_compiled=0, wall_s=1.0), as_json=False)
    out = capsys.readouterr().out
    assert "nothing to compile: the store already holds the KV entries of every chunk" in out
    assert "compiled entries" not in out
