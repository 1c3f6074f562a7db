"""OpenAI-compatible wire models: `/v1/chat/completions`, `/v1/models` and OpenAI-shaped errors.

Same rules as schemas/api.py: unknown fields rejected, every list and string bounded.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from schemas.api import (
    MAX_NEW_TOKENS,
    MAX_QUERY_CHARS,
    MAX_SEED,
    MAX_TIMEOUT_S,
    AnswerReport,
    Attribution,
    FinishReason,
    Query,
    Routing,
    Selection,
    Strict,
)
from schemas.wire import JsonBool, JsonFloat, JsonInt


class OpenAIError(Strict):
    message: str
    type: str  # "invalid_request_error" (4xx) or "server_error" (5xx), as OpenAI names them
    param: str | None = None
    code: int | None = None  # the HTTP status


class OpenAIErrorBody(Strict):
    """Errors of the OpenAI-compatible routes, in OpenAI's shape (its client reads `error.message`)."""

    error: OpenAIError


# ---- OpenAI-compatible chat ------------------------------------------------------------------------
class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant"]
    content: Query | Annotated[list[TextPart], Field(min_length=1, max_length=64)]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class QvpicOptions(Selection, Routing, Attribution):
    """Extension field `qvpic` of a chat request; with no selection the last user message retrieves."""

    timeout_s: JsonFloat | None = Field(None, gt=0.0, le=MAX_TIMEOUT_S, description="deadline of the whole "
                                        "request (504 past it); else header X-Request-Timeout, else the server's "
                                        "default")

    @model_validator(mode="after")
    def _at_most_one_selection(self) -> QvpicOptions:
        if self.num_given() > 1:
            raise ValueError("give at most one of chunk_ids, doc_ids or top_k")
        return self


class StreamOptions(Strict):
    include_usage: JsonBool = False


class ChatCompletionRequest(Strict):
    model: str = Field(min_length=1, max_length=256)
    messages: list[ChatMessage] = Field(min_length=1, max_length=64)
    max_tokens: JsonInt | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    max_completion_tokens: JsonInt | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    temperature: JsonFloat = Field(1.0, ge=0.0, le=2.0)  # OpenAI's defaults
    top_p: JsonFloat = Field(1.0, gt=0.0, le=1.0)
    n: JsonInt = Field(1, ge=1, le=1)
    seed: JsonInt | None = Field(None, ge=0, le=MAX_SEED)
    stream: JsonBool = False
    stream_options: StreamOptions | None = None
    qvpic: QvpicOptions = Field(default_factory=QvpicOptions)

    @model_validator(mode="after")
    def _single_user_turn(self) -> ChatCompletionRequest:
        # The store's KV was compiled under the model's own template prefix (its default system
        # prompt), so a custom system prompt or earlier turns would change what the cache means.
        if len(self.messages) != 1 or self.messages[0].role != "user" or not self.messages[0].text().strip():
            raise ValueError("messages must be exactly one non-empty user message (context chunks go in `qvpic`)")
        if len(self.messages[0].text()) > MAX_QUERY_CHARS:
            raise ValueError(f"the user message is longer than {MAX_QUERY_CHARS} characters")
        return self

    @property
    def query(self) -> str:
        return self.messages[0].text()

    @property
    def max_new_tokens(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 256


class PromptTokensDetails(Strict):
    cached_tokens: int


class ChatUsage(Strict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(Strict):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(Strict):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: None = None


class ChatCompletion(Strict):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: ChatUsage
    qvpic: AnswerReport  # extension: routing, timings and cache figures of this answer


class ChunkDelta(Strict):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(Strict):
    index: int = 0
    delta: ChunkDelta
    finish_reason: FinishReason | None = None
    logprobs: None = None


class ChatCompletionChunk(Strict):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: ChatUsage | None = None
    qvpic: AnswerReport | None = None


class ModelCard(Strict):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(Strict):
    object: Literal["list"] = "list"
    data: list[ModelCard]
