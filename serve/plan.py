"""The data that travels between the serving roles: router → loader → generator → ingress.

A request's plan, its loaded KV and its answer, as plain frozen dataclasses. This module imports
nothing heavy (no torch, no transformers, no Ray), so the ingress and governance can hold and cache
these types without loading the model stack. KV travels as numpy (bf16 as a uint16 view, see
serve/kv/wire.py): Ray moves numpy buffers zero-copy. An entry carries the part of its index row the
serving path reads, typed (`EntryRow`, built by `entry_of`): a plan is pickled at every hop between
deployments, and a row dict pickled every key name and the columns nothing reads. The rows are named
tuples, not slotted dataclasses: those pickle through Python-level `__getstate__`/`__setstate__`, which
made a 16-chunk plan 2.5x slower to pickle than with dicts; tuples pickle in C.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from schemas.api import FinishReason
from schemas.config import DType, KVQuant
from schemas.decoding import ChoiceLogprobs, TokenLogprob
from schemas.modes import ChunkKind, Mode, Variant
from schemas.prompt import PromptLayout
from schemas.report import AnswerReport, CacheReport, FallbackReport, KVOrigin, TierReason
from schemas.store import CacheKey

Pages = tuple[tuple[int, ...], ...]  # one tuple per page: [t, h, w] grids, [width, height] sizes


class KVLocation(NamedTuple):
    """Where a compiled entry's KV lies in the store, and what its bytes must be (checked on every read)."""

    shard_path: str  # relative to the store root
    tensor_key: str
    byte_offset: int
    nbytes: int
    checksum: str  # sha256 hex of the stored bytes
    shape: tuple[int, ...]  # [layers, 2, kv_heads, tokens, head_dim], also of a quantised record's KV
    dtype: str  # DType value, or the KVQuant format of a quantised record


class EntryRow(NamedTuple):
    """What the serving path reads of an entry's index row besides `Entry`'s own fields (its chunk key and
    fingerprint are in the entry's cache key)."""

    kind: ChunkKind
    compile_start: int  # first position the KV was compiled at
    grid_thw: Pages  # [t, h, w] per page; empty for text
    image_sizes_px: Pages  # [width, height] per page; empty for text
    stored: KVLocation | None  # None: not in the store (pending, or compiled and not written back)
    legibility: float | None = None  # OCR score of the pages, where ingest measured it
    pending: bool = False  # planned before it exists: a lazily compiled tier's entry (serve/kv/pending.py)


@dataclass(frozen=True)
class Entry:
    """One stored KV entry: what the loader fetches and the generator places."""

    key: str  # CacheKey string
    tier: str | None
    variant: Variant
    num_tokens: int
    vision_tokens: int
    position_span: int
    row: EntryRow

    @property
    def cache_key(self) -> CacheKey:
        return CacheKey.parse(self.key)


def entry_of(row: Mapping[str, Any]) -> Entry:
    """The one way an index row (INDEX_SCHEMA, as the catalog or the store reads it) becomes an `Entry`."""
    variant = Variant(row["variant"])
    key = CacheKey(row["chunk_key"], row["tier"], variant, row["fingerprint"]).to_str()
    stored = KVLocation(shard_path=row["shard_path"], tensor_key=row["tensor_key"], byte_offset=row["byte_offset"],
                        nbytes=row["nbytes"], checksum=row["checksum"], shape=tuple(row["shape"]), dtype=row["dtype"])
    typed = EntryRow(kind=ChunkKind(row["kind"]), compile_start=row["compile_start"],
                     grid_thw=tuple(map(tuple, row["grid_thw"])),
                     image_sizes_px=tuple(map(tuple, row["image_sizes_px"])), stored=stored,
                     legibility=row.get("legibility"))
    return Entry(key=key, tier=row["tier"], variant=variant, num_tokens=row["num_tokens"],
                 vision_tokens=row["vision_tokens"], position_span=row["position_span"], row=typed)


@dataclass(frozen=True)
class PlannedChunk:
    chunk_id: str
    doc_id: str
    relevance: float
    tier: str | None  # tier of the pages in context; None for text
    num_tokens: int
    vision_tokens: int
    position_span: int
    entry: Entry | None  # KV to link; None in the online (full_*) modes
    fallback: Entry | None = None  # low-tier entry the loader uses when `entry`'s shard is unreadable
    text: str | None = None  # source text, carried for the full_* modes (and linked ones when recompute is on)
    image_path: str | None = None  # full_image of a scanned page: its original image, as ingest compiled it
    tier_reason: TierReason = TierReason.MODE  # why placement gave it `tier` (the inspector shows it)
    group: int = 0  # which group of the prompt it sits in (plan.layout: one per user message of a conversation)


@dataclass(frozen=True)
class Plan:
    mode: Mode
    query: str  # what the chunks were scored against (and, without a query_prompt, the text after them)
    chunks: tuple[PlannedChunk, ...]
    prefix_tokens: int  # before the chunks: the chat-template prefix and the instruction
    query_tokens: int  # after the chunks: the query prompt and the assistant header
    fallbacks: tuple[FallbackReport, ...]
    route_ms: float
    query_embedding: np.ndarray | None = None  # [dim], unit norm: what the l2 response cache compares
    generation: int = 0  # the store's serving generation every entry of the plan comes from
    instruction: str = ""  # prefilled after the chat-template prefix, before the chunks
    query_prompt: str | None = None  # prefilled after the chunks in place of `query`
    # What the model reads around the chunks: `[layout.before][chunks][layout.after]` as token ids and images (the
    # chat template over the conversation, or the template prefix + instruction and the query prompt + turn end)
    layout: PromptLayout | None = None
    conversation: str = ""  # sha256 of the messages (the response cache keys on it); empty without messages
    cache_salt: bytes = b""  # the tenant's prefix-cache salt, set by the server after governance (never the client)
    conversation_chain: tuple[str, ...] = ()  # sha256 of messages[:1], messages[:2], …: prefix affinity's keys

    @property
    def prompt_tokens(self) -> int:
        return self.prefix_tokens + sum(c.num_tokens for c in self.chunks) + self.query_tokens

    @property
    def text_after_chunks(self) -> str:
        return self.query if self.query_prompt is None else self.query_prompt


@dataclass(frozen=True)
class LoadedKV:
    """One chunk's KV as it travels to the generator, with what is needed to place it."""

    array: np.ndarray  # [layers, 2, kv_heads, tokens, head_dim], or a quantised entry's uint8 record
    dtype: DType | KVQuant  # a KVQuant: `array` is the record of a KV of shape entry.row.stored.shape
    entry: Entry  # the entry actually served (the fallback's when one was used)

    @property
    def compile_start(self) -> int:
        return self.entry.row.compile_start

    @property
    def kind(self) -> ChunkKind:
        return self.entry.row.kind

    @property
    def grid_thw(self) -> list[tuple[int, int, int]]:
        return list(self.entry.row.grid_thw)


@dataclass(frozen=True)
class Unreadable:
    """A planned entry whose shard could not be read (missing, torn, or failing its checksum)."""

    position: int  # in plan.chunks
    entry: Entry
    reason: str
    backup: LoadedKV | None  # the chunk's low-tier entry, when it has one and it loaded


@dataclass(frozen=True)
class LoadResult:
    kvs: tuple[LoadedKV | None, ...]  # aligned with plan.chunks; None where no KV is linked or it was unreadable
    fallbacks: tuple[FallbackReport, ...]
    cache: CacheReport
    load_ms: float
    unreadable: tuple[Unreadable, ...] = ()
    # aligned with kvs: HOST or STORE for what was read, None where kvs is None (an unreadable entry's backup
    # is at `Unreadable.backup`, its source here); the generator marks what it rebuilds COMPILED
    sources: tuple[KVOrigin | None, ...] = ()


class TextDelta(str):
    """A streamed piece of answer text (a `str`, so every consumer of text deltas reads it as one) carrying, when
    log-probabilities were asked, the entries of the tokens decoded since the previous piece (`logprobs`; a piece
    may hold several tokens, or none when a tail of the text was held back), and its choice's `index`."""

    logprobs: tuple[TokenLogprob, ...] = ()
    index: int = 0  # the choice it belongs to (n > 1)


@dataclass(frozen=True)
class Choice:
    """One more answer to the same prompt (`n` > 1): choices 1..n-1 beside the `Answer`'s own text, choice 0."""

    text: str
    finish_reason: FinishReason
    completion_tokens: int
    logprobs: ChoiceLogprobs | None = None


@dataclass(frozen=True)
class Answer:
    """What the generator returns: the answer text and the report of how it was made."""

    text: str
    report: AnswerReport  # its usage counts every choice's completion tokens; its finish_reason is choice 0's
    logprobs: ChoiceLogprobs | None = None  # with `logprobs` asked: each answer token's, in OpenAI's shape
    choices: tuple[Choice, ...] = ()  # with n > 1: the other choices, in order (index 1..n-1)

    @property
    def every_choice(self) -> tuple[Choice, ...]:
        """All n choices in order: choice 0 from this answer's own text, finish reason and logprobs, then the rest."""
        first_tokens = self.report.usage.completion_tokens - sum(c.completion_tokens for c in self.choices)
        return (Choice(self.text, self.report.finish_reason, first_tokens, self.logprobs), *self.choices)


@dataclass(frozen=True)
class Embedded:
    """Texts as the router's embedder embeds them: what `POST /v1/embeddings` answers."""

    vectors: np.ndarray  # float32 [n, dim], unit rows: the vectors retrieval compares
    prompt_tokens: int  # the embedder's tokens read, over all texts


@dataclass(frozen=True)
class Tokenized:
    """What `POST /tokenize` answers: the router's tokens of a prompt, and the context it fills."""

    tokens: list[int]
    max_model_len: int
