"""Decoding parameters of one request: the one type every surface builds them into."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Protocol

MAX_CHOICES = 8  # `n`: choices decoded from one prefill, each a row of the batch


class SamplingFields(Protocol):
    """What a request carries about decoding (the native and the OpenAI-compatible request both do)."""

    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop_strings: tuple[str, ...]
    presence_penalty: float
    frequency_penalty: float
    logit_bias_ids: tuple[tuple[int, float], ...]
    logprobs_top: int | None
    grammar_text: str | None
    grammar_param: str
    sampling_top_k: int  # vLLM's extras (schemas/extras.py)
    min_p: float
    repetition_penalty: float
    min_tokens: int
    stop_token_id_tuple: tuple[int, ...]
    ignore_eos: bool
    skip_special_tokens: bool
    include_stop_str_in_output: bool


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # matched on the decoded text (serve/engine/stops.py)
    presence_penalty: float = 0.0  # OpenAI's penalties, over the tokens decoded so far
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), sorted by id
    logprobs: int | None = None  # None: none; k: each token's log-probability and its k best alternatives
    # the answer is constrained to this Lark grammar (llguidance's dialect: a JSON schema's, or a forced tool
    # call's; serve/engine/grammar.py); `grammar_param` is the request field a grammar that does not compile names
    grammar: str | None = None
    grammar_param: str = "response_format"
    n: int = 1  # choices: one prefill, then n rows decoded in the batch (serve/engine/qvpic/engine.py forks)
    # vLLM's extras (schemas/extras.py says what each does; pipeline/runtime/sampling.py applies them in vLLM's order)
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over the prompt's known tokens and the answer's
    min_tokens: int = 0  # end-of-turn and stop_token_ids masked before this many answer tokens
    stop_token_ids: tuple[int, ...] = ()  # end the answer as end-of-turn does
    ignore_eos: bool = False  # end-of-turn is an ordinary token: delivered, and decoding goes on
    skip_special_tokens: bool = True  # the text leaves special tokens out
    include_stop_str_in_output: bool = False  # a matched stop string stays at the end of the text

    def __post_init__(self) -> None:
        if (self.max_new_tokens < 1 or not math.isfinite(self.temperature) or self.temperature < 0
                or not 0 < self.top_p <= 1 or not -2 <= self.presence_penalty <= 2
                or not -2 <= self.frequency_penalty <= 2 or any(not -100 <= b <= 100 for _, b in self.logit_bias)
                or not 1 <= self.n <= MAX_CHOICES or self.top_k < -1 or not 0 <= self.min_p <= 1
                or not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty))
                or not 0 <= self.min_tokens <= self.max_new_tokens or any(t < 0 for t in self.stop_token_ids)):
            raise ValueError(f"invalid sampling parameters {self}")

    @property
    def adjusts_logits(self) -> bool:
        """Whether a token's logits depend on more than the model: a penalty or a bias is set."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0)

    def choice(self, index: int) -> Sampling:
        """Choice `index`'s own decoding: one row, seeded `seed + index` (choice 0 decodes as the same request with
        n = 1 would; each choice is reproducible on its own). Greedy choices are alike, as OpenAI's and vLLM's."""
        seed = None if self.seed is None else (self.seed + index) % 2**64
        return replace(self, n=1, seed=seed)

    @classmethod
    def of(cls, request: SamplingFields) -> Sampling:
        return cls(request.max_new_tokens, request.temperature, request.top_p, request.seed, request.stop_strings,
                   request.presence_penalty, request.frequency_penalty, request.logit_bias_ids,
                   request.logprobs_top, request.grammar_text, request.grammar_param,
                   top_k=request.sampling_top_k, min_p=request.min_p, repetition_penalty=request.repetition_penalty,
                   min_tokens=request.min_tokens, stop_token_ids=request.stop_token_id_tuple,
                   ignore_eos=request.ignore_eos, skip_special_tokens=request.skip_special_tokens,
                   include_stop_str_in_output=request.include_stop_str_in_output)
