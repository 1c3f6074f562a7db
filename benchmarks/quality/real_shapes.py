"""Exactness at the real models' shapes, the full set: every case of tests/pipeline/runtime/test_real_shapes.py.

CI runs one case per check and family; this runs all of them (`QVPIC_REAL_SHAPES=full`: every seed, compile
prefix, mutation and batched kind the tiny-model suites run, LLaVA-OneVision's 384-px pages included) in one
pytest process, reads its JUnit report, and writes per family and check the cases passed / failed / skipped and
their wall time to its section of docs/BENCHMARKS.md. It measures correctness, not speed: the times say what
the set costs on the machine named in the section.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

from pipeline.eval import markdown_table, write_section
from pipeline.runtime import REAL_SHAPES

TESTS = Path(__file__).resolve().parents[2] / "tests" / "test_real_shapes.py"


def run(families: list[str]) -> list[tuple[str, str, str, float]]:
    """(family, check, outcome, seconds) of every case, from one full-set pytest run."""
    with tempfile.TemporaryDirectory(prefix="qvpic-real-shapes-") as tmp:
        report = Path(tmp) / "junit.xml"
        selection = " or ".join(families)  # the family is part of every parametrised id
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TESTS), f"--junitxml={report}",
                "-k", selection]
        subprocess.run(argv, env={**os.environ, "QVPIC_REAL_SHAPES": "full"}, check=False)
        cases = []
        for case in ET.parse(report).iter("testcase"):
            name = case.get("name", "")
            check, _, params = name.partition("[")
            family = next(f for f in families if f in params)
            outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
            cases.append((family, check, outcome, float(case.get("time", 0.0))))
        return cases


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", choices=REAL_SHAPES, default=list(REAL_SHAPES))
    args = parser.parse_args(argv)
    cases = run(args.families)
    counts: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for family, check, outcome, seconds in cases:
        counts[family, check][outcome] += 1
        counts[family, check]["seconds"] += seconds
    rows = [(family, check, int(c["passed"]), int(c["failure"] + c["error"]), int(c["skipped"]), round(c["seconds"], 1))
            for (family, check), c in counts.items()]
    failed = sum(r[3] for r in rows)
    body = (
        "Every case of tests/pipeline/runtime/test_real_shapes.py (`QVPIC_REAL_SHAPES=full`): the assembled context "
        "against the "
        "independent 4-D-mask reference and its negative controls, on models built from the public configs "
        "(pipeline/runtime/real_shapes.py), float32, random weights, 2 decoder and 2 vision layers. Tolerance: "
        "max |Δ logit| ≤ 1e-5·sqrt(hidden / 64) (tests/pipeline/runtime/test_runtime_exactness.py `tolerance`: "
        "7.5e-5 at hidden "
        "3,584, 8e-5 at 4,096); a control must miss by 20 times that.\n\n"
        + markdown_table(["model", "check", "passed", "failed", "skipped", "seconds"], rows)
        + f"\n\n{len(cases)} cases, {failed} failed."
    )
    command = "python -m benchmarks.quality.real_shapes" + (
        f" --families {' '.join(args.families)}" if args.families != list(REAL_SHAPES) else "")
    write_section("real-shapes", "Exactness at the real models' shapes (issue 24)", command, body)
    print(body)


if __name__ == "__main__":
    main()
