"""Markdown for people: one table formatter, and the writer of one named section of docs/BENCHMARKS.md (or of
another document a benchmark reports in, e.g. docs/RELIABILITY.md).

Here, below both `jobs/` and `benchmarks/`, so the evaluation job and every benchmark write their
sections the same way and nothing imports `benchmarks/`. A section is delimited by HTML comments
`<!-- bench:NAME -->…<!-- /bench:NAME -->`, so a rerun replaces its own section and leaves the rest.
"""

from __future__ import annotations

import platform
import re
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

BENCHMARKS_MD = Path(__file__).resolve().parents[2] / "docs" / "BENCHMARKS.md"
RELIABILITY_MD = BENCHMARKS_MD.with_name("RELIABILITY.md")  # benchmarks of a reliability claim write theirs there
HEADER = (
    "# Benchmarks\n\n"
    "Each section is written by the benchmark named in it, with the command that produced it. "
    "Machines are noisy: figures are medians, and comparisons are ratios measured side by side in one run.\n"
)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A pipe table; floats to 4 significant digits, None as an en dash."""
    def cell(value: Any) -> str:
        if value is None:
            return "–"
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


def write_section(name: str, title: str, command: str, body_md: str, path: Path = BENCHMARKS_MD) -> Path:
    """Replace (or append) the section `name` of `path` with `body_md`, stamped with command and machine."""
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"{platform.machine()}, {platform.processor() or 'cpu'}, Python {sys.version.split()[0]}"
    section = (
        f"<!-- bench:{name} -->\n## {title}\n\n"
        f"Command: `{command}`  \nRun: {stamp} on {machine}\n\n{body_md.strip()}\n<!-- /bench:{name} -->"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else HEADER
    pattern = re.compile(rf"<!-- bench:{re.escape(name)} -->.*?<!-- /bench:{re.escape(name)} -->", re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section + "\n"
    path.write_text(text)
    return path
