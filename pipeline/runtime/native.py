"""Native CPU kernels built on first use: a C++ source compiled by the machine's compiler and loaded with ctypes.

Each process builds what it uses, once, into a private temporary directory (mode 0700) that is removed after
loading: no cache on disk that could go stale or be swapped by another user, for ~0.2-1 s of one core per
kernel and process (a torch extension of the same loops takes ~35 s, `torch.compile` ~6-20 s per process:
docs/BENCHMARKS.md `limits`). The sources use a plain C ABI and no torch headers. Users: re-anchoring
(pipeline/runtime/reanchor.py) and the fused forward's small operations (pipeline/runtime/decoder_ops.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")

FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
COMPILE_TIMEOUT_S = 120  # a cold compiler on a loaded 2-core machine takes ~1 s; past this, torch ops serve


class KernelUnavailable(RuntimeError):
    """No native kernel in this process: no compiler, or it failed (the torch ops serve instead)."""


def compiler() -> str | None:
    """The C++ compiler to build with: `$CXX` if set (a name on PATH or a path), else g++ or c++."""
    named = os.environ.get("CXX")
    if named:
        return shutil.which(named)
    return shutil.which("g++") or shutil.which("c++")


def build_library(source: Path, wrap: Callable[[ctypes.CDLL], T], cxx: str | None = None,
                  flags: tuple[str, ...] = FLAGS) -> T:
    """`source` compiled by `cxx` (default: `compiler()`), loaded and given to `wrap` (which binds its functions);
    `KernelUnavailable` says why not."""
    cxx = cxx or compiler()
    if cxx is None:
        raise KernelUnavailable("no C++ compiler on PATH (g++, c++ or $CXX)")
    with tempfile.TemporaryDirectory(prefix=f"qvpic-{source.stem}-") as build_dir:  # mode 0700: this user's alone
        target = Path(build_dir) / f"{source.stem}.so"
        try:
            subprocess.run([cxx, *flags, str(source), "-o", str(target)], check=True, capture_output=True,
                           text=True, timeout=COMPILE_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as error:
            detail = getattr(error, "stderr", None) or error
            raise KernelUnavailable(f"{cxx} could not build {source.name}: {detail}") from error
        try:
            return wrap(ctypes.CDLL(str(target)))  # mapped: it outlives the directory
        except (OSError, AttributeError) as error:  # a library that does not load, or lacks a function
            raise KernelUnavailable(f"{cxx} built {source.name}, but it does not load: {error}") from error


class BuiltOnce(Generic[T]):
    """A native library's wrapper, built by `build` on the first `get` (the only call that pays for it); None,
    logged once as `without`, where it cannot be (no compiler, a failed build): the torch ops serve then."""

    def __init__(self, build: Callable[[], T], without: str, logger: logging.Logger):
        self._build, self._without, self._log = build, without, logger
        self._lock = threading.Lock()
        self.state: dict[str, T | None] = {}  # "built" once tried: the wrapper, or None

    def get(self) -> T | None:
        if "built" not in self.state:
            with self._lock:
                if "built" not in self.state:
                    try:
                        self.state["built"] = self._build()
                    except KernelUnavailable as error:
                        self._log.warning("%s: %s", self._without, error)
                        self.state["built"] = None
        return self.state["built"]
