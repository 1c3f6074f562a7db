"""The router's recent query embeddings, per tenant: a conversation's follow-up re-scores its earlier user
messages (`history_chunks`) and a repeated question is embedded again — each of those is one MiniLM forward
(~5–15 ms on two cores) that the answer does not change. Keys are sha256 of the tenant's salt (set by the
server from the authenticated tenant, serve/http/exchange.py `tenant_salt`) and the text: one tenant's hit
never comes from another's query, so the embedding time tells no one what someone else asked."""

from __future__ import annotations

import hashlib
import threading

import numpy as np

from serve.kv.lru import ByteLRU


class QueryVectors:
    """The last `max_entries` query vectors (`[dim]` float32, ~1.5 KB each for MiniLM), least recently used
    first out (the tiers' `ByteLRU`, each entry weighing 1); 0 entries: off."""

    def __init__(self, max_entries: int):
        self._vectors: ByteLRU[np.ndarray] = ByteLRU(max_entries, lambda _: 1)
        self._lock = threading.Lock()  # ByteLRU is not thread-safe on its own

    @staticmethod
    def key(salt: bytes, text: str) -> str:
        return hashlib.sha256(salt + b"\x00" + text.encode("utf-8", "surrogatepass")).hexdigest()

    def get(self, salt: bytes, text: str) -> np.ndarray | None:
        with self._lock:
            return self._vectors.get(self.key(salt, text))

    def put(self, salt: bytes, text: str, vector: np.ndarray) -> None:
        with self._lock:
            self._vectors.put(self.key(salt, text), vector)

    def __len__(self) -> int:
        return len(self._vectors)
