"""One step in its own process: `python -m benchmarks.gpu_check.step NAME RESULT.json [--dry] [--hang]`.

The step writes its result file as it goes (`Record`), so a step cut by its timeout keeps what it measured."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from pathlib import Path

from benchmarks.gpu_check import STEPS
from benchmarks.gpu_check.common import Context, Record, Skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check.step")
    p.add_argument("name", choices=[s.name for s in STEPS])
    p.add_argument("result")
    p.add_argument("--dry", action="store_true")
    p.add_argument("--hang", action="store_true", help="hang before the step (the runner's timeout control)")
    args = p.parse_args(argv)
    record = Record(Path(args.result))
    record.flush()
    if args.hang:
        time.sleep(10 ** 6)
    step = next(s for s in STEPS if s.name == args.name)
    started = time.perf_counter()
    try:
        function = getattr(importlib.import_module(f"benchmarks.gpu_check.{step.module}"), step.name)
        function(Context(dry=args.dry), record)
    except Skip as skip:
        record.flush("skipped", str(skip))
        return 0
    except Exception as error:  # noqa: BLE001 - the runner records it and goes on to the next step
        record.data["traceback"] = traceback.format_exc()[-4000:]
        record.flush("error", f"{type(error).__name__}: {error}"[:500])
        return 1
    record.data["step_s"] = round(time.perf_counter() - started, 2)
    if record.failures:
        record.flush("failed", f"{len(record.failures)} check(s) failed: {', '.join(record.failures)}")
    else:
        record.flush("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
