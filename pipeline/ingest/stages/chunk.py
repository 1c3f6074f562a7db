"""The chunk stage: documents → chunk occurrences (bounded by the VLM tokenizer's token count) and one MARKER each.

A Ray Data callable class (the tokenizer loads once per actor) over pipeline rows (pipeline/ingest/rows.py):
it takes the DOC rows and passes every other row on untouched. A document that yields no chunk is rejected.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from pipeline.ingest.chunker import Chunker
from pipeline.ingest.rows import Kind, not_of_kind, of_kind, require_columns, rows_table
from pipeline.ingest.stages.read import rejected_row
from schemas.config import ModelSpec
from schemas.corpus import Document, MetaKey, Rejection, RejectReason

NEEDS = ("kind", "doc_id", "source", "text", "metadata_json", "order_key", "text_key", "image_path")
ADDS = ("chunk_id", "order", "chunk_key", "num_text_tokens", "collection")


def token_counter(model: ModelSpec) -> Callable[[str], int]:
    """How many tokens the model's tokenizer makes of a text, without special tokens.

    A checkpoint's fast tokenizer (tokenizer.json) is read by the `tokenizers` library itself, the one
    transformers' fast tokenizers call for the same counts: importing transformers (and torch with it) cost
    every chunk actor ~6 CPU-seconds. A checkpoint with only a slow tokenizer goes through transformers."""
    from pipeline.runtime import resolve_path

    path = resolve_path(model)
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        fast = Tokenizer.from_file(str(path / "tokenizer.json"))
        return lambda text: len(fast.encode(text, add_special_tokens=False).ids)
    from transformers import AutoTokenizer

    slow = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return lambda text: len(slow(text, add_special_tokens=False).input_ids)


class ChunkStage:
    """Each document → its chunk occurrences and one MARKER (its whole-text key, for dedup)."""

    def __init__(self, model: ModelSpec, chunk_tokens: int):
        count = token_counter(model)

        # Repeated documents (and repeated pieces) are counted once: a corpus of 10^5 copies of one
        # text would otherwise spend minutes in the tokenizer. Bounded: pieces are at most a few KB.
        self.chunker = Chunker(functools.lru_cache(maxsize=4096)(count), chunk_tokens)

    def chunks(self, doc: Document) -> list[dict[str, Any]]:
        # A page image is one chunk whatever its length: its pixels are what gets compiled.
        pieces = self.chunker.chunk(doc)
        if doc.image_path and pieces:
            pieces = [pieces[0].build(doc.doc_id, 0, doc.text, sum(p.num_text_tokens for p in pieces))]
        return [{"kind": Kind.CHUNK.value, "key": c.chunk_key, **c.model_dump(), "source": doc.source,
                 "image_path": doc.image_path, "collection": doc.collection} for c in pieces]

    def __call__(self, batch: pa.Table) -> pa.Table:
        require_columns(batch, NEEDS, "chunk")
        rows: list[dict[str, Any]] = []
        for row in of_kind(batch, Kind.DOC).to_pylist():
            doc = Document.from_row(row)
            chunks = self.chunks(doc)
            if not chunks:
                rows.append(rejected_row(Rejection(source=doc.source, doc_id=doc.doc_id, reason=RejectReason.EMPTY_TEXT,
                                                   detail="no chunk left after chunking")))
                continue
            rows += chunks
            rows.append({"kind": Kind.MARKER.value, "key": row["text_key"], "doc_id": doc.doc_id, "source": doc.source,
                         "order_key": row["order_key"], "text_key": row["text_key"],
                         "image_phash": doc.metadata.get(MetaKey.IMAGE_PHASH.value), "image_path": doc.image_path})
        return pa.concat_tables([not_of_kind(batch, Kind.DOC), rows_table(rows)])
