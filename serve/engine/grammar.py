"""Structured outputs by constrained decoding (OpenAI's `response_format`), with llguidance.

A request's JSON schema (`json_schema`, or `{"type": "object"}` for `json_object`) becomes an llguidance matcher
over the model's tokenizer. At each step the engine masks the tokens the grammar forbids (`mask`: a bitmask of
`ceil(vocab / 32)` int32 words, applied to the row's logits), then feeds the chosen token back (`advance`); the
answer ends when the grammar is complete (end-of-turn is allowed only where the JSON may end). The answer is
therefore valid JSON of the schema whatever the weights — the property the tests check with `jsonschema`.
"""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from schemas.errors import InvalidRequestError

JSON_OBJECT = json.dumps({"type": "object"})
# compact output: no whitespace between tokens of the JSON (a tiny or untrained model would otherwise pad it)
OPTIONS = {"whitespace_flexible": False}


class Grammars:
    """One model's tokenizer as llguidance sees it; `matcher(schema)` per request."""

    def __init__(self, tokenizer, vocab_size: int, end_of_turn_ids: frozenset[int] | set[int]):
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=sorted(end_of_turn_ids))
        self.vocab_size = vocab_size

    def matcher(self, schema_json: str) -> llguidance.LLMatcher:
        """A fresh matcher for one answer; a schema llguidance cannot compile is a 400 naming response_format."""
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_json, overrides=OPTIONS)
            matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        except (ValueError, TypeError, RuntimeError) as error:
            raise invalid(f"the JSON schema does not compile to a grammar: {str(error)[:300]}") from None
        if matcher.is_error():
            raise invalid(f"the JSON schema does not compile to a grammar: {matcher.get_error()[:300]}")
        return matcher

    def mask(self, matcher: llguidance.LLMatcher, row: torch.Tensor) -> torch.Tensor:
        """`row` `[vocab]` with every token the grammar forbids next at -inf (a new tensor)."""
        bitmask = llguidance.torch.allocate_token_bitmask(1, self.vocab_size)
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        masked = row.float().clone()[None]
        llguidance.torch.apply_token_bitmask_inplace(masked, bitmask)
        return masked[0]


def advance(matcher: llguidance.LLMatcher, token: int) -> bool:
    """Feed the chosen token; True when the grammar is complete (nothing may follow)."""
    matcher.consume_token(token)
    return matcher.is_stopped()


def invalid(message: str) -> InvalidRequestError:
    error = InvalidRequestError(f"response_format: {message}")
    error.param = "response_format"
    return error
