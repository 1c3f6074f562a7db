"""Wire models of vLLM's utility routes, which health probes and tooling written for vLLM call: `/version`,
`/tokenize` and `/detokenize` (`/health` answers schemas/health.py's `Health`, as `/healthz` does).

`/tokenize` takes `prompt` (text, no special tokens added) or `messages` (rendered by the model's chat template, as
a chat request's are, with no store chunks), as vLLM's does, and answers `tokens`, `count` and `max_model_len`.
Every input is bounded (a 400 naming the field and its limit); image parts are refused by name: their vision
tokens come from the processor, which the router does not run.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from schemas.conversation import MAX_MESSAGES, MAX_TEXT_CHARS, Message, check_conversation
from schemas.decoding import MAX_TOKEN_ID
from schemas.wire import JsonInt, NullIsDefault, Strict, Utf8Str

MAX_DETOKENIZE_TOKENS = 131_072  # about the longest context a served family takes


class TokenizeRequest(Strict, NullIsDefault):
    model: str | None = Field(None, max_length=256, description="a served model id, as vLLM takes it; "
                              "any other is a 404")
    prompt: Utf8Str | None = Field(None, max_length=MAX_TEXT_CHARS)
    messages: list[Message] | None = Field(None, min_length=1, max_length=MAX_MESSAGES, description="rendered as "
                                           "a chat request's are, ending with the assistant's header")

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.messages is not None:
            check_conversation(self.messages)
            for i, message in enumerate(self.messages):
                if message.images():
                    raise ValueError(f"messages[{i}].content: image parts are not tokenized here (their vision "
                                     "tokens come from the model's processor)")
        return self


class TokenizeResponse(Strict):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(Strict, NullIsDefault):
    model: str | None = Field(None, max_length=256)
    tokens: list[Annotated[JsonInt, Field(ge=0, le=MAX_TOKEN_ID)]] = Field(max_length=MAX_DETOKENIZE_TOKENS)


class DetokenizeResponse(Strict):
    prompt: str


class Version(Strict):
    version: str  # qvpic's (vLLM answers its own the same way)
