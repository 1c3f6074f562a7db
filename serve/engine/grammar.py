"""Structured outputs and forced tool calls by constrained decoding, with llguidance.

A request's grammar — `response_format`'s JSON schema (`{"type": "object"}` for `json_object`), or a forced tool
call (schemas/tools.py `call_grammar`), both as Lark text of llguidance's dialect — becomes a matcher over the
model's tokenizer. At each step the engine masks the tokens the grammar forbids (`mask`: a bitmask of
`ceil(vocab / 32)` int32 words, applied to the row's logits), then feeds the chosen token back (`advance`); the
answer ends when the grammar is complete (end-of-turn is allowed only where the JSON may end). The answer is
therefore valid JSON of the schema whatever the weights — the property the tests check with `jsonschema`.
"""

from __future__ import annotations

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from schemas.errors import InvalidRequestError


class Grammars:
    """One model's tokenizer as llguidance sees it; `matcher(schema)` per request."""

    def __init__(self, tokenizer, vocab_size: int, end_of_turn_ids: frozenset[int] | set[int]):
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=sorted(end_of_turn_ids))
        self.vocab_size = vocab_size

    def matcher(self, lark: str, param: str) -> llguidance.LLMatcher:
        """A fresh matcher for one answer; a grammar llguidance cannot compile is a 400 naming `param` (the field
        whose schema it came from)."""
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
            matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        except (ValueError, TypeError, RuntimeError) as error:
            raise invalid(param, f"does not compile to a grammar: {str(error)[:300]}") from None
        if matcher.is_error():
            raise invalid(param, f"does not compile to a grammar: {matcher.get_error()[:300]}")
        return matcher

    def mask(self, matcher: llguidance.LLMatcher, row: torch.Tensor) -> torch.Tensor:
        """`row` `[vocab]` with every token the grammar forbids next at -inf (a new tensor, on `row`'s device).

        llguidance writes the bitmask in host memory; its kernel reads logits and bitmask on one device, so the
        bitmask goes to the logits' device — from pinned memory when that is a GPU: an asynchronous copy, queued
        before the kernel on the same stream."""
        bitmask = host_bitmask(self.vocab_size, pinned=row.is_cuda)
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        masked = row.float().clone()  # [vocab]: llguidance views it as one row, in place
        llguidance.torch.apply_token_bitmask_inplace(masked, bitmask.to(row.device, non_blocking=True))
        return masked


def host_bitmask(vocab_size: int, pinned: bool) -> torch.Tensor:
    """A fresh one-row bitmask in host memory, every token allowed; page-locked when bound for a GPU. Fresh per call
    so no copy in flight reads a buffer being refilled: PyTorch's caching host allocator reuses a pinned block only
    once the copies that read it are done."""
    shape = llguidance.torch.get_bitmask_shape(1, vocab_size)
    return torch.full(shape, -1, dtype=torch.int32, pin_memory=pinned)


def advance(matcher: llguidance.LLMatcher, token: int) -> bool:
    """Feed the chosen token; True when the grammar is complete (nothing may follow)."""
    matcher.consume_token(token)
    return matcher.is_stopped()


def invalid(param: str, message: str) -> InvalidRequestError:
    error = InvalidRequestError(f"{param}: {message}")
    error.param = param
    return error
