"""A lower bound on a conversation's prompt tokens, for refusing an over-long history before any work on it.

A 256-message history past the context used to cost its whole route before its 400 (docs/RELIABILITY.md
`fairness`): each earlier user message embedded as a retrieval query (history_chunks), the chat template rendered,
every image decoded and the text tokenised. Here the user messages' characters alone prove most such histories too
long. Every character of a user message's text, stripped, reaches the prompt (templates write it as sent, at most
trimmed), after the tokenizer's own normalizer; a token covers at most as many characters as its vocabulary string
is long (byte-level BPE: one string character a byte, and a character is at least one byte; SentencePiece: `▁` a
space). So the prompt holds at least `characters // longest vocabulary string` tokens: never more than it has, and
a request that fits is never refused here. Template markup and images count 0: a floor, not an estimate.
"""

from __future__ import annotations

from schemas.conversation import Message, TextPart
from schemas.errors import ContextLengthError


class TokenFloor:
    def __init__(self, tokenizer):
        self.max_token_chars = max(1, max(len(token) for token in tokenizer.get_vocab()))  # added tokens included
        backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer's normalizer (NFC, …) may
        self._normalizer = getattr(backend, "normalizer", None)  # shorten a text before it is cut into tokens

    def tokens(self, messages: list[Message]) -> int:
        """At most as many tokens as the prompt of `messages` holds (their user messages' text alone)."""
        chars = 0
        for message in messages:
            if message.role != "user" or message.content is None:
                continue
            parts = [message.content] if isinstance(message.content, str) else [
                p.text for p in message.content if isinstance(p, TextPart)]
            chars += sum(len(self._normalized(part.strip())) for part in parts)
        return chars // self.max_token_chars

    def refuse(self, messages: list[Message], max_new_tokens: int, context_tokens: int) -> None:
        """ContextLengthError (400, naming `messages`) when the floor and `max_new_tokens` exceed the context."""
        floor = self.tokens(messages)
        if floor + max_new_tokens > context_tokens:
            raise ContextLengthError(
                f"request needs at least {floor + max_new_tokens} tokens (its user messages' text alone at least "
                f"{floor} + max_new_tokens {max_new_tokens}); the context holds {context_tokens}", counted_tokens=floor)

    def _normalized(self, text: str) -> str:
        return self._normalizer.normalize_str(text) if self._normalizer is not None and text else text
