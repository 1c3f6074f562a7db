"""KV on the wire: read-only arrays become tensors over the same memory, with no process-wide warning filter.

torch warns about a non-writable array only once per process, so each check runs in a fresh
interpreter with UserWarnings (what torch raises) turned into errors.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.paths import REPO

ROOT = REPO

SETUP = """
import numpy as np, torch
from serve.kv import from_wire, to_wire
tensor = torch.randn(2, 2, 1, 5, 4).to(torch.bfloat16)
array, dtype = to_wire(tensor)
assert not array.flags.writeable
shared = np.frombuffer(array.tobytes(), dtype=array.dtype).reshape(array.shape)  # read-only, like Ray's
"""


def run_strict(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", SETUP + code], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120)


def test_from_wire_shares_read_only_memory_without_warning():
    result = run_strict("""
for source in (array, shared):
    out = from_wire(source, dtype)
    assert out.data_ptr() == source.ctypes.data  # no copy
    assert torch.equal(out, tensor)
import warnings
from tests.support.paths import REPO
assert not any("not writable" in str(f) for f in warnings.filters)  # no filter hides anything
""")
    assert result.returncode == 0, result.stderr


def test_negative_control_from_numpy_would_warn():
    result = run_strict("torch.from_numpy(shared)")
    assert result.returncode != 0 and "not writable" in result.stderr
