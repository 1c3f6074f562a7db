"""Where things are, for tests in any folder of tests/: the repository's root, and tests/ itself (its data/ and
fixtures/)."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
