"""vLLM's sampling extras, as vLLM's OpenAI-compatible server takes them beside OpenAI's own fields: `top_k`,
`min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`, `ignore_eos`, `skip_special_tokens`,
`include_stop_str_in_output` and `structured_outputs` (regex, choice or grammar). Ranges are vLLM's
(vllm/sampling_params.py `_verify_args`): a value vLLM refuses is a 400 naming the field here too.
schemas/decoding.py `Controls` takes them; schemas/sampling.py `Sampling` carries them to both engines."""

from __future__ import annotations

import json
from typing import Annotated

from pydantic import BaseModel, Field, StringConstraints, model_validator

from schemas.wire import JsonBool, JsonFloat, JsonInt, NullIsDefault, Strict

MAX_STOP_TOKEN_IDS = 64
MAX_TOKEN_ID = 2**31 - 1
MAX_PATTERN_CHARS = 4096  # a regex's or a grammar's text
MAX_CHOICE_STRINGS = 64
Choice = Annotated[str, StringConstraints(min_length=1, max_length=256)]


def lark_regex(pattern: str) -> str:
    """`pattern` as a Lark grammar of llguidance's dialect: one regex literal `/…/` matching the whole answer. An
    unescaped `/` would end the literal, a raw newline the line: both are escaped (what llguidance's own
    `grammar_from("regex", …)` writes, and vLLM's guidance backend runs)."""
    out, escaped = [], False
    for char in pattern:
        if escaped:
            out.append(char)
            escaped = False
        elif char == "\\":
            out.append(char)
            escaped = True
        else:
            out.append({"/": "\\/", "\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(char, char))
    return f"start: /{''.join(out)}/\n"


class StructuredOutputs(Strict, NullIsDefault):
    """vLLM's `structured_outputs`: exactly one of a regex, a list of choices or a Lark grammar the answer must match
    (decoded through the same llguidance matcher as `response_format`)."""

    regex: str | None = Field(None, min_length=1, max_length=MAX_PATTERN_CHARS, description=(
        "the whole answer matches this regular expression"))
    choice: list[Choice] | None = Field(None, min_length=1, max_length=MAX_CHOICE_STRINGS, description=(
        "the answer is exactly one of these strings"))
    grammar: str | None = Field(None, min_length=1, max_length=MAX_PATTERN_CHARS, description=(
        "the answer matches this Lark grammar (llguidance's dialect; its `start` rule)"))

    @model_validator(mode="after")
    def _one_kind(self) -> StructuredOutputs:
        given = [name for name in ("regex", "choice", "grammar") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of regex, choice or grammar, got {given or 'none'}")
        return self

    @property
    def lark(self) -> str:
        if self.regex is not None:
            return lark_regex(self.regex)
        if self.choice is not None:  # JSON string literals are Lark's (llguidance reads JSON escapes)
            return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice) + "\n"
        return self.grammar


class SamplingExtras(BaseModel):
    """The extras every OpenAI-compatible request shape takes (and the native `/v1/answer`, whose `top_k` is
    retrieval's: there the sampling one is `sampling_top_k`, schemas/api.py)."""

    min_p: JsonFloat = Field(0.0, ge=0.0, le=1.0, description=(
        "after temperature, tokens whose probability is below min_p times the most likely token's are dropped "
        "(0: off; sampling only)"))
    repetition_penalty: JsonFloat = Field(1.0, gt=0.0, description=(
        "vLLM's / HF's: the logit of every token in the prompt or the answer so far is divided by it when positive, "
        "multiplied when negative (1: off). qvpic's engine counts the prompt's text tokens; a linked chunk's KV "
        "carries no token ids, so its tokens are not counted there"))
    min_tokens: JsonInt = Field(0, ge=0, description=(
        "end-of-turn and stop_token_ids are masked until this many answer tokens are decoded (at most max_tokens)"))
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]] | None = Field(
        None, max_length=MAX_STOP_TOKEN_IDS, description=(
            "token ids that end the answer like end-of-turn (finish_reason stop; the token is not in the text). "
            "Ids past the model's vocabulary are refused (400)"))
    ignore_eos: JsonBool = Field(False, description=(
        "end-of-turn does not end the answer: decoding runs to max_tokens (a stop string or stop_token_ids still "
        "end it)"))
    skip_special_tokens: JsonBool = Field(True, description=(
        "special tokens (end-of-turn with ignore_eos, template markers) are left out of the text; false: shown"))
    include_stop_str_in_output: JsonBool = Field(False, description=(
        "a matched stop string ends the text (it is kept), instead of the text ending before it"))
    structured_outputs: StructuredOutputs | None = Field(None, description=(
        "vLLM's: regex, choice or grammar (exactly one); decoding is constrained to it as to response_format "
        "(llguidance), with which it cannot be combined"))

    @property
    def stop_token_id_tuple(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.stop_token_ids or ())))

    def check_min_tokens(self, max_new_tokens: int) -> None:
        if self.min_tokens > max_new_tokens:
            raise ValueError(f"min_tokens: {self.min_tokens} is more than max_tokens ({max_new_tokens})")


class TopK(BaseModel):
    """vLLM's `top_k` on the OpenAI-compatible requests (the native request's is `sampling_top_k`)."""

    top_k: JsonInt = Field(0, ge=-1, description=(
        "sample from the k most likely tokens only, after temperature (0 or -1: all, vLLM's off; 1: greedy at any "
        "temperature)"))

    @property
    def sampling_top_k(self) -> int:
        return self.top_k
