"""The claims registry shared by qvpic's vLLM engine (which registers each request's claim before adding it) and
the scheduler side of its KV connector (which reads it): both run in the generator's process. A claim is what the
connector may supply for one request; the worker side never reads this registry, only a step's metadata."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

CLAIM_KEY = "qvpic_claim"  # the request's kv_transfer_params entry naming its claim
REQUEST_KEY = "qvpic_request"  # and the request id the engine gave it (vLLM suffixes its own internal one)
HISTORY_KEY = "qvpic_history"  # a history pass's entry: the claim whose first `offset` columns it computes


@dataclass
class Claim:
    """What the connector may supply for one request: the first `num_tokens` prompt tokens' KV."""

    # [layers, 2, num_tokens - offset, kv_heads, head_dim] in the model's dtype: token-major, as a backend's cache
    # write takes keys and values, so a load's columns are views (no copy on the forward's path)
    kv: torch.Tensor
    # prompt columns before `kv`'s first: vLLM's history pass computed them, in the blocks of `history`
    offset: int = 0
    # the history pass's vLLM request id and its blocks, held until the claim is dropped (set when it finishes)
    history: tuple[str, list[int]] | None = None
    # of those columns, the ones the history pass found in vLLM's prefix cache (the rest it computed): accounting
    history_cached: int = 0
    # per vLLM request id: the columns the worker wrote, [start, end) (vLLM's own prefix cache held those before)
    loads: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.offset + self.kv.shape[2]

    @property
    def ready(self) -> bool:
        """Whether every column can be supplied: a claim with an offset waits for its history pass's blocks."""
        return self.offset == 0 or self.history is not None


class Claims:
    """Claims by key, registered by the engine before it adds a request and dropped when it ends."""

    def __init__(self):
        self._claims: dict[str, Claim] = {}
        self._held: dict[str, str] = {}  # claim key -> the vLLM id of its history pass, whose blocks are held
        self._lock = threading.Lock()

    def put(self, key: str, claim: Claim) -> None:
        with self._lock:
            self._claims[key] = claim

    def get(self, key: str) -> Claim | None:
        with self._lock:
            return self._claims.get(key)

    def drop(self, key: str) -> Claim | None:
        with self._lock:
            return self._claims.pop(key, None)

    def hold(self, key: str, request_id: str) -> None:
        with self._lock:
            self._held[key] = request_id

    @property
    def holding(self) -> bool:
        """Whether a history pass's blocks are still held (vLLM frees them at a step after the claim is dropped)."""
        with self._lock:
            return bool(self._held)

    @property
    def releasable(self) -> bool:
        """Whether held blocks wait for a step to be handed back (their claims were dropped)."""
        with self._lock:
            return any(key not in self._claims for key in self._held)

    def released(self) -> set[str]:
        """The history passes whose claims were dropped since the last call: their blocks can be freed."""
        with self._lock:
            done = {key for key in self._held if key not in self._claims}
            return {self._held.pop(key) for key in done}

    def __len__(self) -> int:
        return len(self._claims)


CLAIMS = Claims()
