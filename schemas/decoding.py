"""Decoding controls beyond temperature and top-p, as OpenAI's chat API names them: stop strings, presence and
frequency penalties, a logit bias. The native `/v1/answer` and the OpenAI-compatible request both take them
(schemas/api.py `AnswerRequest`, schemas/chat.py `ChatCompletionRequest`); schemas/sampling.py `Sampling` is what
the engine reads, pipeline/runtime/model.py `adjust_logits` applies the penalties and the bias, and
serve/engine/stops.py matches the stop strings on the decoded text."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from schemas.wire import JsonFloat

MAX_STOP_STRINGS = 4  # OpenAI's
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS = 1024  # entries (token ids); OpenAI documents no count, only the -100..100 range
MAX_TOKEN_ID = 2**31 - 1
StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]


class Decoding(BaseModel):
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
