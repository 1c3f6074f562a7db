"""Embeddings with a real embedding model's neighbourhood structure, at any count, for the serving
benchmark's approximate-index measurements.

Real text: sentences of the docstrings of the installed Python packages and the standard library
(read with `ast`, nothing imported), deduplicated, in a seeded order; embedded with the serving
embedder (MiniLM) once and cached. `base` sentences seed the corpus, `queries` held-out sentences
are the queries (real questions are not on disk; held-out real text is the nearest stand-in).

Synthesis to N rows (SMOTE-like): each row is a random base sentence's embedding moved part of the
way (uniform 0..`reach`) towards one of its `neighbours` nearest base sentences, plus isotropic noise
of norm `noise`, renormalised. Rows stay on the real embeddings' manifold (the directions real text
varies in) instead of filling the sphere uniformly; `statistics` reports cosine statistics of queries
against the synthetic rows next to the same against the real sentences, so a reader can judge it.
"""

from __future__ import annotations

import ast
import hashlib
import re
import sys
import sysconfig
from pathlib import Path

import numpy as np

CACHE = Path.home() / ".cache" / "qvpic" / "bench"
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_MIN_WORDS, _MAX_WORDS = 6, 60


def sentences(limit: int, seed: int = 0) -> list[str]:
    """Up to `limit` distinct docstring sentences of the installed packages, in a seeded order."""
    roots = sorted({sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]})
    found: dict[str, None] = {}
    for root in roots:
        for path in sorted(Path(root).rglob("*.py")):
            if "test" in path.parts[-2].lower():
                continue
            try:
                tree = ast.parse(path.read_text(encoding="utf-8", errors="ignore"))
            except (SyntaxError, ValueError, RecursionError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    for sentence in _SENTENCE.split(" ".join((ast.get_docstring(node) or "").split())):
                        if _MIN_WORDS <= len(sentence.split()) <= _MAX_WORDS and sentence[-1:] in ".!?":
                            found.setdefault(sentence)
            if len(found) >= 4 * limit:  # enough to draw from without reading every file
                break
    ordered = list(found)
    np.random.default_rng(seed).shuffle(ordered)
    return ordered[:limit]


def embedded(num_base: int, num_queries: int) -> tuple[np.ndarray, np.ndarray, str]:
    """(base [num_base, 384], queries [num_queries, 384]) unit float32 embeddings, cached; and the embedder name."""
    from pipeline.runtime import Embedder

    texts = sentences(num_base + num_queries)
    if len(texts) < num_base + num_queries:
        raise RuntimeError(f"found only {len(texts)} distinct docstring sentences, need {num_base + num_queries}")
    embedder = Embedder(batch_size=128)
    key = hashlib.sha256("\n".join([embedder.model_name, *texts]).encode()).hexdigest()[:16]
    path = CACHE / f"sentences-{len(texts)}-{key}.npy"
    if not path.exists():
        print(f"embedding {len(texts):,} real sentences once (cached in {path}) ...", file=sys.stderr, flush=True)
        vectors = np.asarray(embedder.embed(texts), np.float32)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, vectors)
    vectors = np.load(path, allow_pickle=False)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors[:num_base], vectors[num_base:], embedder.model_name


class Synthesizer:
    """Rows drawn around `base` embeddings along the directions to their nearest neighbours."""

    def __init__(self, base: np.ndarray, neighbours: int = 10, reach: float = 0.5, noise: float = 0.25):
        self.base, self.reach, self.noise = base, reach, noise
        self.neighbours = np.empty((len(base), neighbours), np.int64)
        for start in range(0, len(base), 4096):  # [block, base] cosines, self excluded
            scores = base[start:start + 4096] @ base.T
            scores[np.arange(len(scores)), np.arange(start, start + len(scores))] = -np.inf
            self.neighbours[start:start + 4096] = np.argpartition(-scores, neighbours, axis=1)[:, :neighbours]

    def rows(self, count: int, rng: np.random.Generator) -> np.ndarray:
        anchor = rng.integers(0, len(self.base), count)
        other = self.neighbours[anchor, rng.integers(0, self.neighbours.shape[1], count)]
        step = rng.uniform(0.0, self.reach, (count, 1)).astype(np.float32)
        rows = (1 - step) * self.base[anchor] + step * self.base[other]
        jitter = rng.standard_normal(rows.shape, dtype=np.float32)
        rows += self.noise * jitter / np.linalg.norm(jitter, axis=1, keepdims=True)
        return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def statistics(queries: np.ndarray, rows: np.ndarray, k: int = 8) -> dict[str, float]:
    """Mean cosine of each query to its 1st and k-th nearest row, and of random query-row pairs."""
    scores = queries @ rows.T
    top = -np.sort(-np.partition(scores, scores.shape[1] - k, axis=1)[:, -k:], axis=1)
    return {"nn1": float(top[:, 0].mean()), f"nn{k}": float(top[:, k - 1].mean()), "random": float(scores.mean())}
