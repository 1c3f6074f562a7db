"""OpenAI-compatible wire models of `/v1/completions` (legacy completions), beside schemas/chat.py's chat models.

A prompt is the text of one user message: `CompletionRequest.chat` makes the chat request it stands for, so
retrieval, the `qvpic` extension and every shared control mean what they mean on `/v1/chat/completions`
(docs/OPENAI.md has the table; tests/serve/http/test_openai_params.py walks it). Every list and string is bounded.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from schemas.api import MAX_NEW_TOKENS, MAX_SEED, FinishReason
from schemas.chat import ChatCompletionRequest, ChatUsage, QvpicOptions, StreamOptions
from schemas.conversation import MAX_TEXT_CHARS, Message
from schemas.decoding import ChoiceLogprobs, Controls
from schemas.extras import TopK
from schemas.report import AnswerReport
from schemas.sampling import MAX_CHOICES
from schemas.wire import JsonBool, JsonFloat, JsonInt, NullIsDefault, Strict, Utf8Str

MAX_PROMPTS = 64  # prompts of one request: each is its own governed turn, answered in order
MAX_LEGACY_LOGPROBS = 5  # OpenAI's
LEGACY_MAX_TOKENS = 16  # OpenAI's default for legacy completions
Prompt = Annotated[Utf8Str, Field(max_length=MAX_TEXT_CHARS)]


def texts_only(field: str, value: Any, max_items: int, hint: str = "") -> Any:
    """A list of token ids (or of such lists) where text is expected, or too many texts: refused by name with
    the limit (pydantic would name the union's other member, a string, instead); `hint`: what sends them."""
    if isinstance(value, list) and any(isinstance(v, (int, list)) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{field}: token-id arrays are not supported here; send the text (a string or a list of "
                         f"strings){hint}")
    if isinstance(value, list) and not value:
        raise ValueError(f"{field}: an empty list; give at least 1 text")
    if isinstance(value, list) and len(value) > max_items:
        raise ValueError(f"{field}: {len(value)} items; at most {max_items} per request")
    return value


class CompletionRequest(Strict, Controls, TopK, NullIsDefault):
    """OpenAI's legacy completion request: each parameter supported, or refused with a 400 naming it."""

    model: str = Field(min_length=1, max_length=256)
    prompt: Prompt | Annotated[list[Prompt], Field(min_length=1, max_length=MAX_PROMPTS)] = Field(description=(
        f"a string, or up to {MAX_PROMPTS} strings (one choice each, in order); each is the text of one user "
        "message rendered by the model's chat template, not continued raw"))
    suffix: str | None = Field(None, max_length=256, description="refused: no insertion")
    max_tokens: JsonInt | None = Field(LEGACY_MAX_TOKENS, ge=1, le=MAX_NEW_TOKENS, description=(
        f"{LEGACY_MAX_TOKENS} when absent or null (OpenAI's legacy default)"))
    temperature: JsonFloat = Field(1.0, ge=0.0, le=2.0)
    top_p: JsonFloat = Field(1.0, gt=0.0, le=1.0)
    n: JsonInt = Field(1, ge=1, le=128)
    best_of: JsonInt | None = Field(None, ge=1, le=20)
    seed: JsonInt | None = Field(None, ge=0, le=MAX_SEED)
    stream: JsonBool = False
    stream_options: StreamOptions | None = None
    logprobs: JsonInt | None = Field(None, ge=0, le=MAX_LEGACY_LOGPROBS, description=(
        "each answer token's log-probability and this many alternatives (legacy shape: tokens, token_logprobs, "
        "top_logprobs, text_offset)"))
    echo: JsonBool | None = None
    user: str | None = Field(None, max_length=256, description="the end user, recorded in the request log")
    qvpic: QvpicOptions = Field(default_factory=QvpicOptions)

    @field_validator("prompt", mode="before")
    @classmethod
    def _text_prompts(cls, prompt: Any) -> Any:
        return texts_only("prompt", prompt, MAX_PROMPTS)

    @model_validator(mode="after")
    def _refused(self) -> CompletionRequest:
        if self.n > MAX_CHOICES:
            raise ValueError(f"n: at most {MAX_CHOICES} choices per prompt, got {self.n}")
        if self.best_of is not None and self.best_of > 1:
            raise ValueError(f"best_of: only 1 is supported, got {self.best_of}")
        if self.echo:
            raise ValueError("echo: not supported (the prompt is rendered by the chat template, not continued)")
        if self.suffix is not None:
            raise ValueError("suffix: insertion is not supported")
        if self.logprobs is not None and self.stream:
            raise ValueError("logprobs: not supported with stream yet (ask without stream)")
        self.check_min_tokens(self.max_tokens or LEGACY_MAX_TOKENS)
        return self

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    def chat(self, prompt: str) -> ChatCompletionRequest:
        """The chat request `prompt` stands for: one user message, this request's controls."""
        return ChatCompletionRequest(
            model=self.model, messages=[Message(role="user", content=prompt)],
            max_tokens=self.max_tokens or LEGACY_MAX_TOKENS, temperature=self.temperature, top_p=self.top_p,
            seed=self.seed, top_k=self.top_k, stream=self.stream, stream_options=self.stream_options, user=self.user,
            logprobs=True if self.logprobs is not None else None, top_logprobs=self.logprobs, qvpic=self.qvpic,
            **self.model_dump(include=set(Controls.model_fields)))


class CompletionLogprobs(Strict):
    """The legacy `choices[].logprobs`: per answer token, its text, log-probability, best alternatives and
    offset in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]

    @classmethod
    def of(cls, chat: ChoiceLogprobs | None) -> CompletionLogprobs | None:
        if chat is None:
            return None
        entries = chat.content or []
        offsets, at = [], 0
        for entry in entries:
            offsets.append(at)
            at += len(entry.token)
        tops = []
        for entry in entries:
            top: dict[str, float] = {}
            for alternative in entry.top_logprobs:  # best first: two tokens of the same text keep the better
                top.setdefault(alternative.token, alternative.logprob)
            tops.append(top)
        return cls(tokens=[e.token for e in entries], token_logprobs=[e.logprob for e in entries], top_logprobs=tops,
                   text_offset=offsets)


class CompletionChoice(Strict):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None = None


class Completion(Strict):
    """A completion, or (with `usage` absent until the last) one chunk of a streamed one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: ChatUsage | None = None
    qvpic: list[AnswerReport] | None = None  # extension: each choice's routing, timings and cache figures
