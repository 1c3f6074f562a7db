"""OpenAI-compatible wire models: `/v1/chat/completions`, `/v1/models` and OpenAI-shaped errors.

Same rules as schemas/api.py: unknown fields rejected, every list and string bounded. Messages are
schemas/conversation.py's: system, developer, user, assistant and tool turns, text and data-URL image parts.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Literal

from pydantic import Field, ValidationError, model_validator

from schemas.api import (
    MAX_NEW_TOKENS,
    MAX_QUERY_CHARS,
    MAX_SEED,
    MAX_TIMEOUT_S,
    Attribution,
    FinishReason,
    Routing,
    Selection,
    check_generation_prompt,
)
from schemas.conversation import MAX_MESSAGES, Message, check_conversation, last_user_index
from schemas.decoding import ChoiceLogprobs, Decoding
from schemas.extras import TopK
from schemas.report import AnswerReport
from schemas.sampling import MAX_CHOICES
from schemas.tools import MAX_TOOLS, FunctionDef, NamedFunction, NamedToolChoice, ToolChoice, ToolDef, ToolUse
from schemas.wire import JsonBool, JsonFloat, JsonInt, NullIsDefault, Strict


class OpenAIError(Strict):
    message: str
    type: str  # OpenAI's: invalid_request_error, authentication_error, rate_limit_error, server_error, …
    param: str | None = None  # the field's path, e.g. messages[0].content[1].image_url
    code: str | None = None  # OpenAI's: invalid_value, invalid_api_key, rate_limit_exceeded, model_not_found, …


class OpenAIErrorBody(Strict):
    """Errors of the OpenAI-compatible routes, in OpenAI's shape (its client reads `error.message`)."""

    error: OpenAIError


# ---- OpenAI-compatible chat ------------------------------------------------------------------------
class RetrievalMode(str, Enum):
    AUTO = "auto"  # the last user message's text (or retrieval_query) retrieves top_k chunks from the store
    NONE = "none"  # no store chunks: plain chat over the messages alone (a chain that does its own retrieval)


class QvpicOptions(Selection, Routing, Attribution, NullIsDefault):
    """Extension field `qvpic` of a chat request; with no selection the last user message retrieves."""

    retrieval: RetrievalMode = RetrievalMode.AUTO
    retrieval_query: str | None = Field(None, min_length=1, max_length=MAX_QUERY_CHARS, description="what "
                                        "retrieval embeds instead of the last user message's text")
    history_chunks: JsonBool = Field(True, description="each earlier user message keeps the chunks its text "
                                     "retrieves (a follow-up finds the earlier turns in the prefix cache); false: "
                                     "history as text alone")
    timeout_s: JsonFloat | None = Field(None, gt=0.0, le=MAX_TIMEOUT_S, description="deadline of the whole "
                                        "request (504 past it); else header X-Request-Timeout, else the server's "
                                        "default")

    @model_validator(mode="after")
    def _at_most_one_selection(self) -> QvpicOptions:
        if self.num_given() > 1:
            raise ValueError("give at most one of chunk_ids, doc_ids or top_k")
        if self.retrieval is RetrievalMode.NONE and self.num_given():
            raise ValueError("retrieval none takes no chunk_ids, doc_ids or top_k")
        return self


class StreamOptions(Strict, NullIsDefault):
    include_usage: JsonBool = False


class ChatCompletionRequest(Strict, Decoding, TopK, NullIsDefault):
    """Every parameter of OpenAI's chat-completion request is here: supported, accepted and ignored, or refused
    with a 400 naming it (docs/OPENAI.md has the table; tests/serve/http/test_openai_params.py walks it). A field
    it does not know is a 400 naming it, as OpenAI answers; `null` is any optional field's default, as OpenAI's."""

    model: str = Field(min_length=1, max_length=256)
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: JsonInt | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    max_completion_tokens: JsonInt | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    temperature: JsonFloat = Field(1.0, ge=0.0, le=2.0)  # OpenAI's defaults
    top_p: JsonFloat = Field(1.0, gt=0.0, le=1.0)
    n: JsonInt = Field(1, ge=1, le=128, description=f"choices, up to {MAX_CHOICES}: one prefill, n rows decoded in "
                       "the batch (choice i seeded seed + i)")  # OpenAI's range; past MAX_CHOICES a 400
    seed: JsonInt | None = Field(None, ge=0, le=MAX_SEED)
    stream: JsonBool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256, description="the end user, recorded in the request log; never "
                             "the tenant (that is the API key's)")
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16, description="accepted and ignored: OpenAI keeps it with stored completions; none are")
    safety_identifier: str | None = Field(None, max_length=256, description="OpenAI's successor of `user`: "
                                          "recorded as the end user when `user` is absent")
    prompt_cache_key: str | None = Field(None, max_length=256, description="accepted and ignored: the prefix "
                                         "cache here is keyed by content and tenant, not by a hint")
    store: JsonBool | None = None
    service_tier: Literal["auto", "default"] | None = None  # accepted: one tier here
    modalities: list[Literal["text"]] | None = Field(None, max_length=1)
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS, description="functions the model may call: "
                                        "listed in the system prompt in the model's tool format")
    tool_choice: ToolChoice | None = Field(None, description="none (tools not shown), auto (default with tools), "
                                           "required or a named function: the answer is constrained to a call")
    parallel_tool_calls: JsonBool | None = None  # default true: several calls in one answer
    functions: list[FunctionDef] | None = Field(None, max_length=MAX_TOOLS, description="deprecated by OpenAI: "
                                                "read as `tools`, each a function tool")
    function_call: Literal["none", "auto"] | NamedFunction | None = Field(None, description="deprecated by OpenAI: "
                                                                          "read as `tool_choice`")
    add_generation_prompt: JsonBool = Field(True, description="vLLM's: the template's assistant header closes the "
                                            "prompt; false: the conversation rendered without it")
    continue_final_message: JsonBool = Field(False, description="vLLM's: the answer continues the last message, an "
                                             "assistant one, rendered open; needs add_generation_prompt false")
    qvpic: QvpicOptions = Field(default_factory=QvpicOptions)

    @model_validator(mode="after")
    def _a_conversation(self) -> ChatCompletionRequest:
        check_generation_prompt(self.add_generation_prompt, self.continue_final_message)
        check_conversation(self.messages, self.continue_final_message)
        return self

    @model_validator(mode="after")
    def _legacy_functions(self) -> ChatCompletionRequest:
        """`functions` / `function_call` as the `tools` / `tool_choice` they stand for (before `_refused` checks
        those); either pair, not both."""
        if self.functions is not None:
            if self.tools is not None:
                raise ValueError("functions: give tools or functions, not both")
            self.tools, self.functions = [ToolDef(type="function", function=f) for f in self.functions], None
        if self.function_call is not None:
            if self.tool_choice is not None:
                raise ValueError("function_call: give tool_choice or function_call, not both")
            call, names = self.function_call, [t.function.name for t in self.tools or []]
            if isinstance(call, NamedFunction) and call.name not in names:
                raise ValueError(f"function_call: names {call.name!r}, which is not in functions {names[:16]}")
            self.tool_choice = call if isinstance(call, str) else NamedToolChoice(type="function", function=call)
            self.function_call = None
        return self

    @model_validator(mode="after")
    def _refused(self) -> ChatCompletionRequest:
        """The parameters this server does not implement yet: refused by name, never silently ignored."""
        if self.n > MAX_CHOICES:
            raise ValueError(f"n: at most {MAX_CHOICES} choices per request, got {self.n}")
        if self.store:
            raise ValueError("store: this server stores no completions (store: true is not supported)")
        if not self.tools and self.tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice: 'required' or a named function needs tools")
        if self.structured_outputs is not None and self.tool_choice not in (None, "none", "auto"):
            raise ValueError("structured_outputs: a forced tool call and structured_outputs cannot both constrain "
                             "the answer; give one")
        self.check_min_tokens(self.max_new_tokens)
        try:
            self.tool_use  # noqa: B018  names and the named choice checked here, a 400 naming the field
        except ValidationError as error:
            raise ValueError(str(error.errors()[0]["msg"]).removeprefix("Value error, ")) from None
        return self

    @property
    def tool_use(self) -> ToolUse | None:
        """The native request's tools (ValueError: a tool_choice naming no tool); None without tools."""
        if not self.tools:
            return None
        return ToolUse(tools=self.tools, choice=self.tool_choice or "auto",
                       parallel=True if self.parallel_tool_calls is None else self.parallel_tool_calls)

    @property
    def retrieval_query(self) -> str:
        """What retrieval embeds: `qvpic.retrieval_query`, else the last user message's text (its first
        MAX_QUERY_CHARS characters: the embedder reads far fewer tokens anyway; the prompt is never cut)."""
        if self.qvpic.retrieval_query is not None:
            return self.qvpic.retrieval_query
        return self.messages[last_user_index(self.messages)].text()[:MAX_QUERY_CHARS]

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


class CallFunction(Strict):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


class ResponseToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: CallFunction


class AssistantMessage(Strict):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(Strict):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(Strict):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: ChatUsage
    qvpic: AnswerReport  # extension: routing, timings and cache figures of this answer


class ToolCallDelta(ResponseToolCall):
    index: int  # the call's position in the answer's tool_calls (a client joins deltas by it)


class ChunkDelta(Strict):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(Strict):
    index: int = 0
    delta: ChunkDelta
    finish_reason: FinishReason | None = None
    logprobs: ChoiceLogprobs | None = None  # with logprobs: the entries of this chunk's tokens


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
    max_model_len: int | None = None  # vLLM's field: the context a request's prompt and answer fill


class ModelList(Strict):
    object: Literal["list"] = "list"
    data: list[ModelCard]
