"""Streaming detokenisation: the text each new token adds, in O(1) per token, never a broken character.

A byte-level BPE token (Qwen, GLM) is a run of bytes that may end inside a multi-byte UTF-8
character (one CJK character or emoji is often two or three tokens). Each token's bytes go through
an incremental UTF-8 decoder, which holds back an incomplete character until the bytes that finish
it arrive and drops bytes that can never form one, so no U+FFFD reaches a streamed or final answer.
The concatenated deltas equal `tokenizer.decode(ids, skip_special_tokens=True)` with its U+FFFD
replacement characters removed.

Other tokenizers (sentencepiece and the like) take the generic path: decode a short window of recent
tokens and emit what it adds once it no longer ends in a replacement character.
"""

from __future__ import annotations

import codecs
import functools

from transformers.convert_slow_tokenizer import bytes_to_unicode

_REPLACEMENT = "\ufffd"


@functools.lru_cache(maxsize=8)
def _byte_table(tokenizer, skip_special_tokens: bool = True) -> tuple[bytes, ...] | None:
    """Bytes of every token id (b"" for special tokens when they are skipped, else their text), or None when the
    tokenizer is not byte-level."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return None
    to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
    added = tokenizer.added_tokens_decoder  # id -> AddedToken: special ones are skipped, others are literal text
    table = []
    for token_id, token in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if token_id in added:
            table.append(b"" if added[token_id].special and skip_special_tokens else added[token_id].content.encode())
        elif token is None:
            table.append(b"")
        else:
            table.append(bytes(to_byte[c] for c in token if c in to_byte))
    return tuple(table)


class Detokenizer:
    """Feed token ids one at a time; `add` returns the text they complete (often "")."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens  # vLLM's: false shows special tokens' text
        self.table = _byte_table(tokenizer, skip_special_tokens)
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="ignore")
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0  # generic path: the window [prefix, read) is already emitted

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self.table is not None:
            return self.utf8.decode(self.table[token_id]) if token_id < len(self.table) else ""
        return self._window()

    def flush(self) -> str:
        """What is left at the end: the rest of the window; an unfinished character is dropped."""
        if self.table is not None:
            return self.utf8.decode(b"", final=True)
        emitted = self._decode(self.ids[self.prefix_offset:self.read_offset])
        tail = self._decode(self.ids[self.prefix_offset:])[len(emitted):]
        self.prefix_offset = self.read_offset = len(self.ids)
        return tail.replace(_REPLACEMENT, "")

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _window(self) -> str:
        # Decoding a window (not just the new token) keeps the leading-space and merge rules right.
        emitted = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        if len(text) <= len(emitted) or text.endswith(_REPLACEMENT):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(emitted):].replace(_REPLACEMENT, "")


def token_text(tokenizer, token_id: int) -> tuple[str, list[int] | None]:
    """One token as OpenAI's logprobs show it: its text and its UTF-8 bytes. A byte-level token that is not whole
    UTF-8 characters reads `bytes:\\xe6\\x97` (as OpenAI writes such tokens); elsewhere the tokenizer's decoding."""
    table = _byte_table(tokenizer)
    if table is None:
        text = tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return text, list(text.encode())
    raw = table[token_id] if token_id < len(table) else b""
    try:
        return raw.decode("utf-8"), list(raw)
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)
