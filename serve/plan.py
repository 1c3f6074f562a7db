"""The data that travels between the serving roles: router → loader → generator → ingress.

A request's plan, its loaded KV and its answer, as plain frozen dataclasses. This module imports
nothing heavy (no torch, no transformers, no Ray), so the ingress and governance can hold and cache
these types without loading the model stack. KV travels as numpy (bf16 as a uint16 view, see
serve/kv/loader.py): Ray moves numpy buffers zero-copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from schemas.api import AnswerReport, CacheReport, FallbackReport
from schemas.config import ChunkKind, DType, KVQuant, Mode, Variant


@dataclass(frozen=True)
class Entry:
    """One stored KV entry: what the loader fetches and the generator places."""

    key: str  # CacheKey string
    tier: str | None
    variant: Variant
    num_tokens: int
    vision_tokens: int
    position_span: int
    row: dict  # the index row (shard_path, tensor_key, nbytes, checksum, compile_start, kind, grid_thw, dtype)


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

    @property
    def text_after_chunks(self) -> str:
        return self.query if self.query_prompt is None else self.query_prompt


@dataclass(frozen=True)
class LoadedKV:
    """One chunk's KV as it travels to the generator, with what is needed to place it."""

    array: np.ndarray  # [layers, 2, kv_heads, tokens, head_dim], or a quantised entry's uint8 record
    dtype: DType | KVQuant  # a KVQuant: `array` is the record of a KV of shape entry.row["shape"]
    entry: Entry  # the entry actually served (the fallback's when one was used)

    @property
    def compile_start(self) -> int:
        return self.entry.row["compile_start"]

    @property
    def kind(self) -> ChunkKind:
        return ChunkKind(self.entry.row["kind"])

    @property
    def grid_thw(self) -> list[tuple[int, int, int]]:
        return [tuple(g) for g in self.entry.row["grid_thw"]]


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


@dataclass(frozen=True)
class Answer:
    """What the generator returns: the answer text and the report of how it was made."""

    text: str
    report: AnswerReport
