"""Decoding parameters of one request: the one type every surface builds them into."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol


class SamplingFields(Protocol):
    """What a request carries about decoding (the native and the OpenAI-compatible request both do)."""

    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int | None


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if (self.max_new_tokens < 1 or not math.isfinite(self.temperature) or self.temperature < 0
                or not 0 < self.top_p <= 1):
            raise ValueError(f"invalid sampling parameters {self}")

    @classmethod
    def of(cls, request: SamplingFields) -> Sampling:
        return cls(request.max_new_tokens, request.temperature, request.top_p, request.seed)
