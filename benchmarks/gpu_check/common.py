"""What every step shares: `Skip`, `need`, the result `Record` and the step's `Context`. (Not in step.py, which
runs as __main__: an exception class defined there would not be the one the steps raise.)"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path


class Skip(Exception):
    """The step cannot run here: a module is missing, or the check needs a device this machine lacks."""


def need(*modules: str) -> None:
    """Import each module or skip the step naming the first that is missing (and what it lacked)."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as error:  # ModuleNotFoundError names the module actually missing
            missing = getattr(error, "name", None) or name
            raise Skip(f"{missing} missing (needed by {name})") from None


class Record:
    """The step's result, rewritten to its file at every `set` (atomic rename): what a timeout leaves is valid."""

    def __init__(self, path: Path):
        self.path, self.data, self.failures = path, {}, []

    def set(self, key: str, value) -> None:
        self.data[key] = value
        self.flush()

    def check(self, name: str, ok: bool, **detail) -> bool:
        """One pass/fail check; a failure makes the step `failed` (exactness: the target is 0 failures)."""
        self.data.setdefault("checks", []).append({"name": name, "ok": bool(ok), **detail})
        if not ok:
            self.failures.append(name)
        self.flush()
        return ok

    def flush(self, status: str = "running", reason: str | None = None) -> None:
        body = {"status": status, **({"reason": reason} if reason else {}), **self.data}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body, default=str))
        tmp.replace(self.path)


@dataclass(frozen=True)
class Context:
    dry: bool  # tiny shapes on CPU

    @property
    def cuda(self) -> bool:
        import torch
        return not self.dry and torch.cuda.is_available()

    @property
    def device(self):
        import torch
        return torch.device("cuda" if self.cuda else "cpu")
