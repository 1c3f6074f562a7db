"""One request inside the engine: what it asked for, what it has produced, and how it ended.

The request's side (a coroutine in the generator replica) creates a `Sequence`, submits it and reads
its events; the engine's thread fills it. Two fields cross threads: `cancelled` (set by the request's
side, read by the engine at its next step) and `emit` (the engine's thread-safe way back). This
module imports nothing heavy.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from schemas.sampling import Sampling

_ids = itertools.count()


class Status(Enum):
    WAITING = "waiting"  # submitted, not yet prefilled
    RUNNING = "running"  # a row of the batch
    FINISHED = "finished"


class End(Enum):
    STOP = "stop"  # the model ended its turn
    LENGTH = "length"  # max_new_tokens decoded
    CANCELLED = "cancelled"  # the request's side went away (client disconnect)
    DEADLINE = "deadline"  # past its deadline
    FAILED = "failed"  # the engine's step raised; `error` says why


@dataclass(frozen=True)
class Finished:
    """The last event of a sequence."""

    end: End
    error: BaseException | None = None


@dataclass(eq=False)
class Sequence:
    sampling: Sampling
    context: Any  # what the engine prefills: serve/engine/prepared.py `LinkedContext` or `OnlineContext`
    num_prompt_tokens: int  # context + query tokens: the columns it holds once prefilled
    num_query_tokens: int  # tokens of its batched query prefill (0: its whole prompt is prefilled alone)
    emit: Callable[[int | Finished], None]  # thread-safe: a token id, then one Finished
    deadline: float | None = None  # time.monotonic() after which it ends with End.DEADLINE
    # its stop strings over the decoded text (serve/engine/stops.py `StopMatcher`), fed by the engine's thread
    # alone: a completed match finishes it (End.STOP) before another decode step; None without stop strings
    stops: Any = None
    # n > 1: the other choices' sequences. Only this one is queued and prefilled; at its join each fork takes a copy
    # of its prompt's KV row and picks its first token from the same logits row (one prefill, n rows decoded)
    forks: list[Sequence] = field(default_factory=list)
    grammar: Any = None  # an llguidance matcher when the answer is constrained to a JSON schema (engine thread only)
    # with sampling.logprobs: per emitted token (its log-probability, ((id, log-probability), …) of the best
    # `logprobs` alternatives), appended by the engine's thread before the token is delivered
    token_logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] = field(default_factory=list)
    id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    token_ids: list[int] = field(default_factory=list)
    end: End | None = None
    cancelled: bool = False  # set from the request's side; the engine drops the row at its next step
    # Timings the answer report carries (ms): assembly and re-anchoring, the prefill forward that gave
    # its first token (shared with the requests prefilled beside it), and its decode steps.
    resumed: Any = None  # pipeline.runtime.Resumed of a linked prompt: what the prefix cache held, its block keys
    prefix_cached_tokens: int = 0  # prompt columns whose KV came from the prefix cache
    linked_tokens: int = 0  # vLLM's engine: prompt columns its connector wrote (qvpic's counts them in `resumed`)
    prompt_logits: Any = None  # `[vocab]` tensor: the logits its prompt's last column gave, until its blocks are kept
    queue_ms: float = 0.0  # submitted until its prefill began
    reanchor_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    submitted_at: float = field(default_factory=time.monotonic)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens its join runs through the model: its query on a linked context (the context's KV is
        copied, not computed), its whole prompt when prefilled alone."""
        return self.num_query_tokens or self.num_prompt_tokens

    @property
    def members(self) -> list[Sequence]:
        """It and its forks: the rows it takes once it joins."""
        return [self, *self.forks]

    @property
    def max_columns(self) -> int:
        """The most KV columns it can ever hold: prompt, then every token but the last (never fed back)."""
        return self.num_prompt_tokens + self.sampling.max_new_tokens - 1

    @property
    def pending_token(self) -> int:
        """The last token picked: the next decode step feeds it."""
        return self.token_ids[-1]

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    def cancel(self) -> None:
        self.cancelled = True

    def deliver(self, event: int | Finished) -> None:
        """Hand `event` to the request's side; if that side is gone (its event loop closed), cancel."""
        try:
            self.emit(event)
        except Exception:  # noqa: BLE001  the engine's thread must never die of a reader that left
            self.cancelled = True

    def finish(self, end: End, error: BaseException | None = None) -> None:
        if self.status is Status.FINISHED:
            return
        self.status, self.end = Status.FINISHED, end
        self.deliver(Finished(end, error))
