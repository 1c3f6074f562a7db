"""A generation's float16 chunk embeddings, read without keeping them resident.

Search reads whole blocks while a job builds an index, and a few rows per request while serving (the
candidates it rescores): `blocks` reads sequentially, `take` reads each row with one `pread`. Nothing
is memory-mapped, so a router's resident memory does not grow with the rows its requests happen to
touch (10^6 x 384 float16 rows are 768 MB); the kernel's page cache still keeps hot rows in memory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import numpy as np


class EmbeddingRows:
    """[rows, dim] float16 rows backed by a .npy file or, for small sets and tests, an array. Thread-safe."""

    def __init__(self, array: np.ndarray | None = None, path: Path | None = None):
        if (array is None) == (path is None):
            raise ValueError("EmbeddingRows needs exactly one of array or path")
        self.array, self.path, self._fd = array, path, None
        if path is not None:
            header = np.load(path, mmap_mode="r", allow_pickle=False)  # reads the header only
            if header.dtype != np.float16 or header.ndim != 2:
                raise ValueError(f"{path} holds {header.dtype} {header.shape}, not [rows, dim] float16")
            self.shape, self.offset = header.shape, header.offset
            del header
            self._fd = os.open(path, os.O_RDONLY)
        else:
            self.shape = array.shape
        self.row_nbytes = self.shape[1] * 2

    @classmethod
    def of(cls, rows: "EmbeddingRows | np.ndarray") -> "EmbeddingRows":
        return rows if isinstance(rows, EmbeddingRows) else cls(array=np.asarray(rows))

    def __len__(self) -> int:
        return self.shape[0]

    def blocks(self, block_rows: int, start: int = 0, stop: int | None = None) -> Iterator[tuple[int, np.ndarray]]:
        """(first row, [rows, dim] block) over rows [start, stop), in order."""
        stop = len(self) if stop is None else stop
        for first in range(start, stop, block_rows):
            count = min(block_rows, stop - first)
            if self.array is not None:
                yield first, self.array[first:first + count]
                continue
            data = os.pread(self._fd, count * self.row_nbytes, self.offset + first * self.row_nbytes)
            yield first, np.frombuffer(data, np.float16).reshape(count, self.shape[1])

    def take(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows), dim] float16 rows, in the order given."""
        rows = np.asarray(rows, np.int64)
        if self.array is not None:
            return np.asarray(self.array[rows], np.float16)
        if len(rows) and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"rows outside [0, {len(self)})")
        out = np.empty((len(rows), self.shape[1]), np.float16)
        if not len(rows):  # a search that found nothing (a filter reading no row in the lists it probed)
            return out
        view = memoryview(out).cast("B")
        for i, row in enumerate(rows.tolist()):
            os.preadv(self._fd, [view[i * self.row_nbytes:(i + 1) * self.row_nbytes]],
                      self.offset + row * self.row_nbytes)
        return out

    def rerank(self, query: np.ndarray, candidates: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The best `k` of `candidates` by float16-row score with `query`: (rows, scores), best first, ties by
        row; padded with row -1 where there are fewer than `k` candidates (so answers stack)."""
        candidates = np.unique(candidates)  # sorted: rows read in file order, ties broken by row
        scores = self.take(candidates).astype(np.float32) @ query  # [candidates]
        order = np.argsort(-scores, kind="stable")[:k]
        if len(order) < k:
            return np.pad(candidates[order], (0, k - len(order)), constant_values=-1), scores[order]
        return candidates[order], scores[order]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()
