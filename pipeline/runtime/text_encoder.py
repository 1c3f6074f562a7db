"""Token ids of a prompt's text pieces, from any thread, with special-token text parsed or split as asked.

A prompt is tokenised in pieces (pipeline/runtime/conversation.py): the template's own text with special tokens
parsed, a user's content with them split, so a message cannot forge a role marker or an image token. transformers'
fast tokenizer does the latter by setting `encode_special_tokens` on its one Rust backend per call: shared state,
so two threads tokenising at once (the router frames prompts on worker threads, beside the query's embedding)
could each run with the other's setting, or fail with "Already borrowed". `TextEncoder` keeps two copies of the
backend, one per setting, each set once: no call changes shared state, and a call skips transformers' per-call
Python (~0.1-0.2 ms; framing a 4-turn conversation tokenises ~27 pieces). A tokenizer with no Rust backend (a
"slow" one) is called as transformers calls it, one call at a time.
"""

from __future__ import annotations

import threading
import weakref


class TextEncoder:
    """`encode(text, split_special)`: the ids `tokenizer(text, add_special_tokens=False,
    split_special_tokens=split_special).input_ids` gives, safe to call from several threads."""

    def __init__(self, tokenizer):
        self._tokenizer = weakref.ref(tokenizer)  # weak: `text_encoder` keeps one per tokenizer while it lives
        self.default_split = bool(getattr(tokenizer, "split_special_tokens", False))  # what a bare call does
        self._lock = threading.Lock()  # the slow tokenizer's calls only
        backend = getattr(tokenizer, "backend_tokenizer", None)  # a `tokenizers.Tokenizer` (fast tokenizers)
        self._backends = None
        if backend is not None and hasattr(backend, "encode_special_tokens"):
            self._backends = {split: _copy(backend, split) for split in (False, True)}

    def encode(self, text: str, split_special: bool | None = None) -> list[int]:
        """`split_special`: None is the tokenizer's own default (False for every checkpoint here)."""
        split = self.default_split if split_special is None else split_special
        if self._backends is not None:
            return self._backends[split].encode(text, add_special_tokens=False).ids
        with self._lock:
            return self._tokenizer()(text, add_special_tokens=False, split_special_tokens=split).input_ids


    def encode_many(self, texts: list[str], split_special: bool | None = None) -> list[list[int]]:
        """`encode` of each of `texts`, in one call of the Rust backend, which releases the GIL while it runs
        (`encode` holds it: ~40 ms for a 256-message history's ~500 texts, stalling every other thread)."""
        split = self.default_split if split_special is None else split_special
        if not texts:
            return []
        if self._backends is not None:
            return [e.ids for e in self._backends[split].encode_batch(texts, add_special_tokens=False)]
        return [self.encode(text, split) for text in texts]


def _copy(backend, split_special: bool):
    """A private copy of `backend` (its JSON: the vocabulary, merges and added tokens) that never truncates or
    pads, and parses (False) or splits (True) special-token text."""
    copy = type(backend).from_str(backend.to_str())
    copy.no_truncation()
    copy.no_padding()
    copy.encode_special_tokens = split_special
    return copy


_ENCODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ENCODERS_LOCK = threading.Lock()


def text_encoder(tokenizer) -> TextEncoder:
    """The one `TextEncoder` of `tokenizer`, built on first use (copying the backend twice took 20-50 ms for the
    tiny checkpoints' tokenizers here; it grows with the vocabulary) and dropped with the tokenizer."""
    with _ENCODERS_LOCK:
        encoder = _ENCODERS.get(tokenizer)
        if encoder is None:
            encoder = _ENCODERS[tokenizer] = TextEncoder(tokenizer)
        return encoder
