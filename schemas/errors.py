"""Errors of the online API: each maps to one HTTP status, raised anywhere on the request path (the
ingress turns them into responses; schemas/api.py holds their bodies)."""

from __future__ import annotations

import math
from enum import StrEnum


class Fault(StrEnum):
    """Why a stored page image or KV entry could not be served: a stable code a response carries instead of the
    error's own message, which names host paths (a shard's, a page image's) that stay in the server log
    (docs/SECURITY.md, "No host paths in responses")."""

    NO_IMAGES_ROOT = "no_images_root"
    OUTSIDE_IMAGES_ROOT = "outside_images_root"
    NOT_A_REGULAR_FILE = "not_a_regular_file"
    PAGE_IMAGE_UNREADABLE = "page_image_unreadable"
    SHARD_MISSING = "shard_missing"
    SHARD_UNREADABLE = "shard_unreadable"
    SHARD_TORN = "shard_torn"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    ENTRY_MALFORMED = "entry_malformed"


FAULT_WORDS = {
    Fault.NO_IMAGES_ROOT: "page images are not read here: no images_root is configured",
    Fault.OUTSIDE_IMAGES_ROOT: "its page image lies outside images_root: not read",
    Fault.NOT_A_REGULAR_FILE: "its page image is not a regular file: not read",
    Fault.PAGE_IMAGE_UNREADABLE: "its page image is not readable here",
    Fault.SHARD_MISSING: "its KV shard is missing",
    Fault.SHARD_UNREADABLE: "its KV shard is unreadable",
    Fault.SHARD_TORN: "its KV shard is torn (shorter than the index says)",
    Fault.CHECKSUM_MISMATCH: "its KV entry fails its checksum",
    Fault.ENTRY_MALFORMED: "its KV entry is malformed",
}


def fault_text(fault: Fault) -> str:
    """What a response says of `fault`: words and the code, no path."""
    return f"{FAULT_WORDS[fault]} [{fault.value}]"


def public_reason(error: BaseException) -> str:
    """`error` as a response may quote it: its fault's words and code when it carries one (its message names a
    host path), else its message (qvpic's own, which name ids and limits only)."""
    fault = getattr(error, "fault", None)
    return fault_text(fault) if isinstance(fault, Fault) else str(error)


class ApiError(ValueError):
    """A request the server understood but cannot serve; `status_code` is the HTTP answer."""

    status_code = 400

    def headers(self) -> dict[str, str]:
        """HTTP headers the error response carries."""
        return {}

    def body_fields(self) -> dict[str, int]:
        """Machine-readable fields the error body carries beside its message."""
        return {}


class InvalidRequestError(ApiError):
    """A request valid in shape that this server cannot take (a logit_bias token id past the vocabulary)."""


class InvalidHeaderError(ApiError):
    """A governance header (X-Tenant, X-Task-Type, X-Max-Token-Budget) with a malformed value."""


class UnauthorizedError(ApiError):
    """No API key, or an unknown one, on a server that maps keys to tenants."""

    status_code = 401

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class RetryLaterError(ApiError):
    """An error the client should retry after `retry_after_s` (sent as Retry-After, whole seconds, at least 1)."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # crosses Serve handles: keep the delay
        return type(self), (str(self), self.retry_after_s)

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


class RateLimitedError(RetryLaterError):
    """The tenant's request or token rate is spent; `retry_after_s` is when it will have refilled enough."""

    status_code = 429


class TooManyInFlightError(RetryLaterError):
    """The tenant already has its `max_in_flight` requests in progress on this replica."""

    status_code = 429


class UnknownIdsError(ApiError):
    """Chunk or document ids that are not in the store (the message names them)."""

    status_code = 404


class UnknownModelError(ApiError):
    status_code = 404
    openai_code, param = "model_not_found", "model"  # OpenAI's


class UnknownResponseError(ApiError):
    """A stored response id this tenant does not have (never stored, expired, deleted, or another tenant's)."""

    status_code = 404

    def __init__(self, response_id: str, param: str | None = None):
        super().__init__(f"Response with id {response_id[:256]!r} not found.")  # OpenAI's words
        self.param = param


class TooLargeError(ApiError):
    """Too many chunks, or more tokens than the model's context holds (the message gives the limit)."""

    status_code = 413


class ContextLengthError(TooLargeError):
    """More tokens than the model's context holds. OpenAI answers this with a 400 `context_length_exceeded`
    (its clients look for that code); the native routes keep 413."""

    openai_status, openai_code, param = 400, "context_length_exceeded", "messages"

    def __init__(self, message: str, counted_tokens: int = 0):
        super().__init__(message)
        self.counted_tokens = counted_tokens  # the prompt tokens the router read to find this: charged to the tenant

    def __reduce__(self):  # crosses Serve handles: keep the count
        return type(self), (str(self), self.counted_tokens)


class BudgetExceededError(TooLargeError):
    """Even the cheapest placement of the request's chunks that its mode allows (qvpic: every chunk at its
    lowest tier), with the n × max_tokens its answer may add, exceeds the request's token budget;
    `min_context_tokens` is what it needs at least (the whole prompt and those completion tokens)."""

    def __init__(self, message: str, min_context_tokens: int, budget_tokens: int):
        super().__init__(message)
        self.min_context_tokens, self.budget_tokens = min_context_tokens, budget_tokens

    def __reduce__(self):
        return type(self), (str(self), self.min_context_tokens, self.budget_tokens)

    def body_fields(self) -> dict[str, int]:
        return {"min_context_tokens": self.min_context_tokens, "budget_tokens": self.budget_tokens}


class UnknownTierError(UnknownIdsError):
    """A `tier` the store does not have (the message names the ones it has)."""


class UnservableError(ApiError):
    """The store lacks the KV entries a mode needs (not compiled, or every stored copy is corrupt)."""

    status_code = 503


class PageImageRefusedError(ApiError):
    """A chunk's stored page image lies outside the server's images root (or none is configured): it is not read,
    so a mode that needs the chunk's pixels cannot serve it (the message names the chunk and the reason)."""

    status_code = 422


class BusyError(RetryLaterError):
    """The generator's batch and queue are full (its KV or batch cap): retry after `retry_after_s`."""

    status_code = 503


class WorkerLostError(RetryLaterError):
    """A process doing part of the request's work died under it (a router's framing process): the work is not
    retried there, as the request may be what killed it; the client may retry after `retry_after_s`."""

    status_code = 503


class StoreUnavailableError(RetryLaterError):
    """The shared store of `/v1/responses` did not answer: whether a stored response exists is unknown (not a 404),
    so retry after `retry_after_s`."""

    status_code = 503


class DeadlineExceededError(ApiError):
    """The request ran past its deadline (`timeout_s`, header X-Request-Timeout, or the server's default);
    its work was stopped."""

    status_code = 504
