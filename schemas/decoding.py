"""Decoding controls beyond temperature and top-p, as OpenAI's chat API names them: stop strings, presence and
frequency penalties, a logit bias (`Controls`, which legacy completions take too: schemas/completions.py), and a
response format and log-probabilities (`Decoding`). The native `/v1/answer` and the OpenAI-compatible chat request
both take them (schemas/api.py `AnswerRequest`, schemas/chat.py `ChatCompletionRequest`); schemas/sampling.py
`Sampling` is what the engine reads, pipeline/runtime/model.py `adjust_logits` applies the penalties and the bias, and
serve/engine/stops.py matches the stop strings on the decoded text."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from schemas.extras import SamplingExtras
from schemas.schema_checks import schema_chars_error
from schemas.tools import json_grammar
from schemas.wire import JsonBool, JsonFloat, JsonInt

MAX_STOP_STRINGS = 4  # OpenAI's
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS = 1024  # entries (token ids); OpenAI documents no count, only the -100..100 range
MAX_TOKEN_ID = 2**31 - 1
MAX_TOP_LOGPROBS = 20  # OpenAI's
StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = Field(None, max_length=4096)
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: JsonBool | None = None  # always enforced here: decoding is constrained to the schema

    @field_validator("schema_")
    @classmethod
    def _small(cls, schema: dict[str, Any]) -> dict[str, Any]:
        """Its size only; its depth and subschemas are counted after the request is charged (serve/http/checks.py)."""
        if error := schema_chars_error(schema):
            raise ValueError(error)
        return schema


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_when_named(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format: json_schema is given exactly when type is 'json_schema'")
        return self


class Controls(SamplingExtras):
    """The controls both OpenAI request shapes take as they are: chat's and legacy completions'
    (schemas/completions.py `CompletionRequest`, whose `logprobs` is another field), vLLM's extras among them
    (schemas/extras.py)."""

    model_config = ConfigDict(extra="forbid")

    stop: StopString | list[StopString] | None = Field(None, description=(
        f"up to {MAX_STOP_STRINGS} strings: decoding stops at the first one in the answer's text (matched across "
        "token boundaries), which ends before it, finish_reason 'stop'"))
    presence_penalty: JsonFloat = Field(0.0, ge=-2.0, le=2.0, description=(
        "subtracted once from the logit of every token already in the answer (OpenAI's formula)"))
    frequency_penalty: JsonFloat = Field(0.0, ge=-2.0, le=2.0, description=(
        "subtracted from a token's logit once per time it already appears in the answer (OpenAI's formula)"))
    logit_bias: dict[str, JsonFloat] | None = Field(None, max_length=MAX_LOGIT_BIAS, description=(
        "token id (as a string) -> a bias in [-100, 100] added to its logit before sampling; -100 bans it, 100 "
        "all but forces it. Ids past the model's vocabulary are refused (400)"))

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for token, value in (bias or {}).items():
            if not token.isascii() or not token.isdigit() or int(token) > MAX_TOKEN_ID:
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {token[:40]!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"biases must be in [-100, 100], got {value} for token {token}")
        return bias

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def logit_bias_ids(self) -> tuple[tuple[int, float], ...]:
        """The bias as (token id, bias) pairs, by id: what the engine and the response cache's key read."""
        return tuple(sorted((int(token), value) for token, value in (self.logit_bias or {}).items()))


class Decoding(Controls):
    """`Controls` and what OpenAI's chat request adds: a response format and log-probabilities."""

    response_format: ResponseFormat | None = Field(None, description=(
        "text (default), json_object (any JSON object) or json_schema: decoding is constrained to the grammar, so "
        "the answer parses and validates whatever the weights (llguidance)"))
    logprobs: JsonBool | None = Field(None, description=(
        "return the log-probability of each answer token under the model (its raw distribution, before "
        "temperature, penalties or bias: vLLM's default), in OpenAI's choices[].logprobs.content shape"))
    top_logprobs: JsonInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description=(
        "with logprobs: the most likely alternatives at each position, best first"))

    @model_validator(mode="after")
    def _logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise ValueError("structured_outputs: cannot be combined with a response_format schema; give one")
        return self

    @property
    def grammar_text(self) -> str | None:
        """The grammar the answer is constrained to (what the engine compiles and the cache keys), or None."""
        if self.structured_outputs is not None:
            return self.structured_outputs.lark
        if self.response_format is None or self.response_format.type == "text":
            return None
        if self.response_format.type == "json_object":
            return json_grammar(json.dumps({"type": "object"}))
        return json_grammar(json.dumps(self.response_format.json_schema.schema_))

    @property
    def grammar_param(self) -> str:
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    @property
    def logprobs_top(self) -> int | None:
        """None: no log-probabilities; else how many alternatives each position lists."""
        return (self.top_logprobs or 0) if self.logprobs else None


class TopLogprob(BaseModel):
    token: str  # the token's text; `bytes:\\x..` when its bytes are not whole UTF-8 characters
    logprob: float
    bytes: list[int] | None  # the token's UTF-8 bytes


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]  # the most likely tokens at this position, best first


class ChoiceLogprobs(BaseModel):
    """OpenAI's `choices[].logprobs`."""

    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None
