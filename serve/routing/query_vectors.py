"""The router's recent query embeddings, per tenant: a conversation's follow-up re-scores its earlier user
messages (`history_chunks`) and a repeated question is embedded again — each of those is one MiniLM forward
(~5–15 ms on two cores) that the answer does not change. Keys are sha256 of the tenant's salt (set by the
server from the authenticated tenant, serve/http/exchange.py `tenant_salt`) and the text: one tenant's hit
never comes from another's query, so the embedding time tells no one what someone else asked."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

import numpy as np


class QueryVectors:
    """LRU of `max_entries` query vectors (`[dim]` float32, ~1.5 KB each for MiniLM); 0 entries: off."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._vectors: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @staticmethod
    def key(salt: bytes, text: str) -> bytes:
        return hashlib.sha256(salt + b"\x00" + text.encode("utf-8", "surrogatepass")).digest()

    def get(self, salt: bytes, text: str) -> np.ndarray | None:
        key = self.key(salt, text)
        with self._lock:
            vector = self._vectors.get(key)
            if vector is None:
                self.misses += 1
                return None
            self._vectors.move_to_end(key)
            self.hits += 1
            return vector

    def put(self, salt: bytes, text: str, vector: np.ndarray) -> None:
        if not self.max_entries:
            return
        with self._lock:
            self._vectors[self.key(salt, text)] = vector
            while len(self._vectors) > self.max_entries:
                self._vectors.popitem(last=False)

    def __len__(self) -> int:
        return len(self._vectors)
