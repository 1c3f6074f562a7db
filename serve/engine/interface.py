"""The engine seam: what the generator asks of whatever executes its requests' forward passes.

The generator (serve/engine/generator.py) prepares each request — its context from the router's plan
(serve/engine/prepared.py), its sampling controls — and drives an `Engine` from there; the engine owns the model's
forwards: it batches the request with every other one in flight, prefills what is new, decodes, and reports back
through the request's `Sequence` (serve/engine/sequence.py) alone. qvpic's own engine (serve/engine/qvpic/) is one
implementation: CPU and GPU, the exactness oracle, and the home of selective recompute.

The contract, both sides:

    add(seq)       Queue a request; its forks (`seq.forks`, n > 1 choices) ride with it and are prefilled once.
                   Called on the generator's event loop, so it returns at once. Raises before anything is queued:
                   `TooLargeError` (413) when it can never fit, `BusyError` (503, Retry-After) when the queue is
                   full, `InvalidRequestError` (400) for what the engine cannot serve (a grammar it cannot compile).
    outputs        From any thread, for each member in turn: `seq.deliver(token_id)` per token in order, then
                   `seq.finish(end, error)` exactly once. Before its first token the engine sets the member's prompt
                   accounting (`num_prompt_tokens`, `prefix_cached_tokens`) and `queue_ms`, `reanchor_ms`,
                   `prefill_ms`; `decode_ms` grows with each later token; with `sampling.logprobs`, a token's entry is
                   appended to `token_logprobs` before the token is delivered. `End.FAILED` carries the error:
                   a step that failed as a whole carries `step_failure(error)`.
    abort(seq)     The caller went away: end `seq` (`End.CANCELLED`) at the engine's next step and free its KV; a
                   no-op once it finished. Thread-safe.
    stats()        `EngineStats` now; cheap enough for every scrape of the replica's metrics.
    clear_prefix_cache()
                   Drop cached prompt KV (a cold measurement), after every finished request's blocks were kept.

Deadlines are the engine's too: a member past `seq.deadline` ends with `End.DEADLINE` at the next step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from schemas.config import EngineConfig
from schemas.errors import BusyError
from serve.engine.sequence import Sequence

OUT_OF_MEMORY_RETRY_S = 1.0  # a step that ran the device out of memory: its requests' Retry-After


def step_failure(error: Exception) -> Exception:
    """What a step that failed as a whole (not one row's own work: that row fails alone) means to each request in
    flight. Out of device memory is the batch's, not any request's fault, and passes once the batch is gone: a clean
    503 with Retry-After (the OOM as its cause), not a 500. Anything else is a fault of the engine's: as it was."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):  # the device's (both engines'), or the host's
        busy = BusyError("the generator ran out of device memory in a batched step; retry", OUT_OF_MEMORY_RETRY_S)
        busy.__cause__ = error
        return busy
    return error


@dataclass
class PrefixCacheStats:
    """The engine's prefix KV cache (cumulative counts, and bytes held now); `EngineStats` carries a copy."""

    hit_tokens: int = 0  # prompt columns served from the cache
    lookups: int = 0  # prompts looked up
    inserted_blocks: int = 0  # blocks kept from finished requests
    logits_hits: int = 0  # a prompt's last-column logits found (used only if every block of the prompt is too)
    evicted_blocks: int = 0  # dropped from the host tier (or from the device when there is none)
    demoted_blocks: int = 0  # moved from the device to the host tier
    device_nbytes: int = 0  # held on the engine's device now
    host_nbytes: int = 0  # held in host memory now


@dataclass(frozen=True)
class EngineStats:
    """One engine's state, as the replica's metrics and `/v1/store` report it."""

    running: int  # rows in the batch, and requests being prefilled to join it
    waiting: int  # queued, not yet prefilled
    kv_nbytes: int  # the batch's KV as allocated now
    steps: int  # engine steps since start
    decoded_tokens: int  # tokens emitted since start, every request's
    ended: dict[str, int]  # requests by how they ended: stop, length, cancelled, deadline, failed
    forward_threads: int  # torch's intra-op threads on the thread that runs the forwards (ForwardSpec.threads)
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)


class Engine(ABC):
    """What executes a generator's requests (the contract is this module's docstring)."""

    config: EngineConfig  # the caps it runs under, as resolved at start (the generator's tenant shares read them)

    @abstractmethod
    def add(self, seq: Sequence) -> None:
        """Queue `seq` and its forks (TooLargeError, BusyError, InvalidRequestError: nothing was queued)."""

    @abstractmethod
    def abort(self, seq: Sequence) -> None:
        """End `seq` at the next step (a no-op once it finished)."""

    @abstractmethod
    def stats(self) -> EngineStats:
        """The engine's state now."""

    @abstractmethod
    def clear_prefix_cache(self, timeout_s: float = 10.0) -> None:
        """Drop the prefix KV cache once every finished request's blocks are kept (a cold measurement)."""
