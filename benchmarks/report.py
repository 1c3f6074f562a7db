"""Writes one named section of docs/BENCHMARKS.md, leaving the other benchmarks' sections intact."""

from __future__ import annotations

import platform
import re
import sys
from datetime import datetime, timezone
from pathlib import Path

BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"
HEADER = (
    "# Benchmarks\n\n"
    "Each section is written by the benchmark named in it, with the command that produced it. "
    "Machines are noisy: figures are medians, and comparisons are ratios measured side by side in one run.\n"
)


def write_section(name: str, title: str, command: str, body_md: str, path: Path = BENCHMARKS_MD) -> Path:
    """Replace (or append) the section `name` of BENCHMARKS.md with `body_md`."""
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


def markdown_table(headers: list[str], rows: list[list[object]]) -> str:
    def fmt(v: object) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
