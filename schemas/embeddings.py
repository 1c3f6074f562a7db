"""OpenAI-compatible wire models of `/v1/embeddings`: the store's own embedder, as OpenAI's embeddings API.

Bounded before any work: at most `MAX_INPUTS` texts, each 1..`MAX_QUERY_CHARS` characters (what a query may be
elsewhere), `MAX_TOTAL_CHARS` in all; token-id arrays are refused by name (docs/OPENAI.md).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from schemas.api import MAX_QUERY_CHARS
from schemas.completions import texts_only
from schemas.wire import JsonInt, NullIsDefault, Strict, Utf8Str

MAX_INPUTS = 2048  # OpenAI's
# LangChain's OpenAIEmbeddings tokenises with tiktoken (OpenAI's vocabulary, not this embedder's) and sends ids
LANGCHAIN_HINT = " (LangChain's OpenAIEmbeddings sends token ids unless check_embedding_ctx_length=False)"
MAX_TOTAL_CHARS = 1_000_000
Text = Annotated[Utf8Str, Field(min_length=1, max_length=MAX_QUERY_CHARS)]


class EmbeddingRequest(Strict, NullIsDefault):
    model: str = Field(min_length=1, max_length=256, description="the served model name, or the store's embedder's")
    input: Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: JsonInt | None = Field(None, ge=1, le=65_536, description="must be the embedder's own dimension")
    user: str | None = Field(None, max_length=256, description="the end user, recorded in the request log")

    @field_validator("input", mode="before")
    @classmethod
    def _text_inputs(cls, value: Any) -> Any:
        return texts_only("input", value, MAX_INPUTS, LANGCHAIN_HINT)

    @model_validator(mode="after")
    def _bounded(self) -> EmbeddingRequest:
        total = sum(map(len, self.texts))
        if total > MAX_TOTAL_CHARS:
            raise ValueError(f"input: {total} characters in all; at most {MAX_TOTAL_CHARS} per request")
        return self

    @property
    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


class Embedding(Strict):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: the float32 vector's little-endian bytes


class EmbeddingUsage(Strict):
    prompt_tokens: int  # what the embedder read: its tokenizer's tokens, special ones included, up to its window
    total_tokens: int


class EmbeddingList(Strict):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str  # the embedder's name (the store's manifest records the same)
    usage: EmbeddingUsage
