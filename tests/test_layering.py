"""Dependencies run one way: schemas ← pipeline ← serve; jobs wires them; benchmarks sit on top.

Checked on the source (every `import` statement, lazy ones inside functions included), so a new
upward import fails here rather than in a reader's head.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
OURS = ("schemas", "pipeline", "serve", "jobs", "benchmarks")
MAY_IMPORT = {
    "schemas": {"schemas"},
    "pipeline": {"schemas", "pipeline"},
    "serve": {"schemas", "pipeline", "serve"},
    "jobs": {"schemas", "pipeline", "serve", "jobs"},
    "benchmarks": set(OURS),
}


def imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & set(OURS)


@pytest.mark.parametrize("package", OURS)
def test_imports_point_down(package):
    upward = {str(path.relative_to(REPO)): sorted(imported_packages(path) - MAY_IMPORT[package])
              for path in sorted((REPO / package).rglob("*.py"))}
    assert {path: names for path, names in upward.items() if names} == {}


def test_the_check_sees_an_upward_import(tmp_path):
    """Negative control: the scanner finds a lazy import inside a function."""
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from benchmarks.report import write_section\n    import serve.app\n")
    assert imported_packages(source) == {"benchmarks", "serve"}
