"""The lock files and the pyproject.toml they are compiled from. One reading of both, for `make lock`
(which stamps each lock with the requirements it was compiled from) and for tests/project/test_lock.py (which
fails when pyproject.toml and a lock no longer agree).

    python -m tests.support.lockfile stamp requirements.lock            # from [project] dependencies
    python -m tests.support.lockfile stamp requirements-dev.lock dev    # ... plus the `dev` extra
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.support.paths import REPO

ROOT = REPO
PYPROJECT = ROOT / "pyproject.toml"
LOCKS = {ROOT / "requirements.lock": (), ROOT / "requirements-dev.lock": ("dev",)}
GPU_LOCK = ROOT / "requirements-gpu.lock"  # GPU nodes (`make lock-gpu`, `make install-gpu`); never installed by CI
STAMP = "# compiled from (tests/project/test_lock.py checks these against pyproject.toml):"
STAMP_LINE = "#   "
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\]+)")
# Packages of CUDA builds: a lock holding any of them would install GPU wheels on every machine.
CUDA_ONLY = re.compile(r"^(nvidia-.*|cuda-.*|triton)$")


def pyproject_inputs(extras: tuple[str, ...] = (), pyproject: Path = PYPROJECT) -> list[str]:
    """What a lock is compiled from: `requires-python`, then the dependencies (and extras), normalised."""
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in extras:
        requirements += project["optional-dependencies"][extra]
    return [f"python {project['requires-python']}"] + sorted(str(Requirement(r)) for r in requirements)


def stamped_inputs(lock: Path) -> list[str] | None:
    """The inputs a lock says it was compiled from; None when it carries no stamp."""
    lines = lock.read_text().splitlines()
    if STAMP not in lines:
        return None
    stamped = []
    for line in lines[lines.index(STAMP) + 1:]:
        if not line.startswith(STAMP_LINE):
            break
        stamped.append(line.removeprefix(STAMP_LINE))
    return stamped


def pins(lock: Path) -> dict[str, str]:
    """Canonical package name → pinned version (every requirement line of the lock)."""
    out = {}
    for line in lock.read_text().splitlines():
        if line and not line[0].isspace() and not line.startswith(("#", "-")):
            match = PIN.match(line)
            if match is None:
                raise ValueError(f"{lock.name}: not an exact pin: {line!r}")
            out[canonicalize_name(match.group(1))] = match.group(2)
    return out


def disagreements(lock: Path, extras: tuple[str, ...], pyproject: Path = PYPROJECT, cuda: bool = False) -> list[str]:
    """Every way in which `lock` does not match what pyproject.toml asks for (empty: they agree); `cuda`: the GPU
    lock, which must pin torch's CUDA build and its CUDA packages where the others must pin neither."""
    problems = []
    wanted, stamped = pyproject_inputs(extras, pyproject), stamped_inputs(lock)
    if stamped != wanted:
        added = sorted(set(wanted) - set(stamped or []))
        removed = sorted(set(stamped or []) - set(wanted))
        problems.append(f"{lock.name} was compiled from other requirements than pyproject.toml now lists "
                        f"(new or changed: {added}; gone: {removed}): run `make lock` and commit the locks")
    pinned = pins(lock)
    for text in wanted[1:]:
        requirement = Requirement(text)
        version = pinned.get(canonicalize_name(requirement.name))
        if version is None:
            problems.append(f"{lock.name} pins no {requirement.name}, which pyproject.toml requires")
        elif not requirement.specifier.contains(Version(version), prereleases=True):
            problems.append(f"{lock.name} pins {requirement.name}=={version}, outside pyproject.toml's {requirement}")
    torch = pinned.get("torch")
    cuda_pins = sorted(name for name in pinned if CUDA_ONLY.match(name))
    if cuda:
        if torch is None or Version(torch).local is not None:
            problems.append(f"{lock.name} must pin torch's CUDA build (PyPI's, no local version), not {torch!r}")
        if not cuda_pins:
            problems.append(f"{lock.name} pins no CUDA package: compile it with PyPI's torch (make lock-gpu)")
        return problems
    if torch is None or Version(torch).local != "cpu":
        problems.append(f"{lock.name} must pin the CPU build of torch (a +cpu version), not {torch!r}")
    if cuda_pins:
        problems.append(f"{lock.name} pins CUDA packages {cuda_pins[:5]}: compile it with the CPU torch (make lock)")
    return problems


def stamp(lock: Path, extras: tuple[str, ...]) -> None:
    """Write the inputs into the lock, after the compiler's own header, replacing an older stamp."""
    lines = lock.read_text().splitlines()
    if STAMP in lines:
        start = lines.index(STAMP)
        end = start + 1
        while end < len(lines) and lines[end].startswith(STAMP_LINE):
            end += 1
        del lines[start:end]
    header = 0
    while header < len(lines) and lines[header].startswith("#"):
        header += 1
    block = [STAMP] + [STAMP_LINE + text for text in pyproject_inputs(extras)]
    lock.write_text("\n".join(lines[:header] + block + lines[header:]) + "\n")


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "stamp":
        sys.exit(__doc__)
    stamp(Path(sys.argv[2]), tuple(sys.argv[3:]))
