"""What `/v1/responses` returns: OpenAI's `Response` object and the items of its `output` (shapes checked against
the openai SDK's `openai.types.responses.Response` in tests/serve/http/test_openai_responses.py).

    message        the answer's text: one `output_text` part (with its log-probabilities when `include` asks)
    function_call  one tool call: `call_id` is what the client's `function_call_output` answers

`usage` is chat's, renamed: `input_tokens` the whole prompt, `input_tokens_details.cached_tokens` the part whose
KV was not computed for this request (linked store chunks, the prefix cache), `output_tokens` the answer's.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, Field

from schemas.decoding import TokenLogprob
from schemas.report import AnswerReport


class ResponseStatus(str, Enum):
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    INCOMPLETE = "incomplete"  # cut at max_output_tokens (or the context): `incomplete_details.reason` says which


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[TokenLogprob] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ResponseStatus = ResponseStatus.COMPLETED
    content: list[OutputText] = Field(default_factory=list)


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str  # a JSON object, as text
    status: ResponseStatus = ResponseStatus.COMPLETED


OutputItem = OutputMessage | OutputFunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int
    cache_write_tokens: int = 0  # the SDK's type requires it; what the prefix cache kept is not counted here


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # no reasoning models here


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """OpenAI's `Response`; the request's settings echoed as OpenAI echoes them."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    qvpic: AnswerReport | None = None  # extension: routing, timings and cache figures of this answer


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True
