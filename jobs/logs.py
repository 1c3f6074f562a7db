"""How loud a job is: its own progress and summaries by default, every library's own logs on request.

Quiet (the default, `QVPIC_LOG_LEVEL=WARNING`) keeps out of the terminal what a user of `qvpic demo`,
`ingest` or `serve` cannot act on: Ray's, Ray Data's and Serve's INFO lines, transformers' progress
bars, library deprecation warnings (Python hides those from end users by default; Ray turns its own
back on) and the C++ log lines Ray's driver writes straight to file descriptor 2 (e.g. Ray Data's
spurious "constructor arguments in the object store", ray-project/ray#57733). Nothing is lost: Ray
keeps every log under its session directory (`/tmp/ray/session_latest/logs`), and the driver's C++
lines go to `native_log_path()`. `--verbose` or `QVPIC_LOG_LEVEL=INFO` (or `DEBUG`) shows everything
as the libraries print it.

`configure()` runs first thing in a job's `main`, before Ray or transformers are imported, so that
their handlers, workers and subprocesses start with these settings. Only a job that runs as its own
program (`as_program()`: the `qvpic` command, `python -m jobs.<job>`) moves file descriptor 2; a job
called in-process, by a test or a notebook, leaves its host's stderr alone.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path

LEVEL_ENV = "QVPIC_LOG_LEVEL"
QUIET_LEVEL = logging.WARNING
LIBRARY_LOGGERS = ("ray", "ray.data", "ray.serve", "ray.train", "ray.tune", "filelock", "urllib3")
_native_log: Path | None = None
_own_process = False


def as_program() -> None:
    """This process is a qvpic command: quiet mode may redirect its file descriptor 2."""
    global _own_process
    _own_process = True


def add_verbose_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="store_true",
                        help=f"also show Ray's, Ray Data's, Serve's and transformers' own logs "
                             f"(or set {LEVEL_ENV}=INFO)")


def level(verbose: bool = False) -> int:
    """`--verbose`: INFO (DEBUG when QVPIC_LOG_LEVEL asks for it); else QVPIC_LOG_LEVEL; else WARNING."""
    name = os.environ.get(LEVEL_ENV, "").strip().upper()
    named = logging.getLevelName(name) if name else None
    env_level = named if isinstance(named, int) else None
    if name and env_level is None:
        print(f"qvpic: ignoring {LEVEL_ENV}={name!r} (use DEBUG, INFO, WARNING or ERROR)", file=sys.stderr)
    if verbose:
        return min(logging.INFO, env_level if env_level is not None else logging.INFO)
    return env_level if env_level is not None else QUIET_LEVEL


def is_verbose() -> bool:
    """Whether the libraries' own INFO logs reach the terminal (after `configure`, also in Ray workers)."""
    return level() <= logging.INFO


def native_log_path() -> Path | None:
    """Where this process's C-level stderr goes while quiet (None when it goes to the terminal)."""
    return _native_log


def configure(verbose: bool = False, native_to_file: bool = True) -> int:
    """Set this process (and the Ray workers and subprocesses it starts) to `level(verbose)`; idempotent.
    `native_to_file=False` keeps C-level stderr on the terminal even when quiet (a long-running server,
    whose rare native lines, about signals or crashes, are worth seeing)."""
    chosen = level(verbose)
    os.environ[LEVEL_ENV] = logging.getLevelName(chosen)  # sub-jobs and Ray workers (runtime_env) inherit it
    if chosen > logging.INFO:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' "Loading weights" bars too
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        if _own_process and native_to_file:
            _native_stderr_to_file()  # before any handler binds to sys.stderr
    logging.basicConfig(level=chosen, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(chosen)
    quiet_libraries()
    return chosen


def quiet_libraries() -> None:
    """Re-apply quiet mode to library loggers and warning filters; call again after importing Ray (which
    configures its loggers and re-enables its deprecation warnings on import). No-op when verbose."""
    if is_verbose():
        return
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(max(logger.getEffectiveLevel(), QUIET_LEVEL))
        for handler in logger.handlers:  # console handlers only: Ray's file handlers keep everything
            if not isinstance(handler, logging.FileHandler) and handler.level < QUIET_LEVEL:
                handler.setLevel(QUIET_LEVEL)
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # Ray's RayDeprecationWarning included


def _native_stderr_to_file() -> None:
    """Point file descriptor 2 at a log file and `sys.stderr` at a copy of the terminal's descriptor:
    Python's own stderr output (tracebacks, progress bars, warnings) still reaches the user, while lines
    that C/C++ code writes to descriptor 2 directly land in the file."""
    global _native_log
    if _native_log is not None:
        return
    try:
        sys.stderr.flush()
        terminal = os.dup(2)
    except (OSError, ValueError):  # no usable stderr (e.g. closed): nothing to redirect
        return
    folder = Path(tempfile.gettempdir()) / "qvpic-logs"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{Path(sys.argv[0]).stem or 'qvpic'}-{os.getpid()}.log"
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    sys.stderr = os.fdopen(terminal, "w", buffering=1, encoding=sys.stderr.encoding or "utf-8",
                           errors="backslashreplace")
    _native_log = path
