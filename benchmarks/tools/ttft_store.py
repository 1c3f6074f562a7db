"""A benchmark store built in-process by the real ingest stages (chunk → render → compile → embed →
publish) without Ray: no cluster to start, so it also runs as-is on a bare GPU machine.

The chunks are consecutive pieces of one synthetic fine-evidence document (`pipeline.eval.synthetic`), one
document per chunk so that a request can name any prefix of them; the chunk holding the evidence of
the document's question is moved to second place, so every request from 2 chunks up contains it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.eval import evidence_chunks, generate
from pipeline.ingest import IngestConfig, open_store
from pipeline.ingest.stages import ChunkStage, compile_in_process
from pipeline.runtime import VLM, Embedder
from schemas.config import ModelSpec
from schemas.corpus import Chunk, Document
from schemas.render import RenderSpec
from schemas.store import StoreSpec

EVIDENCE_POSITION = 1
MIN_DOCUMENT_CHUNKS = 32  # one document size for every request size, so N chunks are a prefix of 2N


class BenchStoreError(ValueError):
    """The benchmark store could not be built as asked."""


@dataclass(frozen=True)
class BenchStore:
    uri: str
    chunk_ids: tuple[str, ...]  # in request order
    query: str
    num_text_tokens: tuple[int, ...]


def chunk_texts(model: ModelSpec, chunk_tokens: int, num_chunks: int, seed: int) -> tuple[list[str], list[int], str]:
    """(texts, token counts, question): `num_chunks` chunks of a synthetic document, evidence second."""
    chunker = ChunkStage(model, chunk_tokens)
    context_words = max(num_chunks, MIN_DOCUMENT_CHUNKS) * chunk_tokens // 2
    for _ in range(6):  # grow the document until it yields enough chunks (tokens per word vary by tokenizer)
        record = generate(1, context_words=context_words, seed=seed)[0]
        rows = chunker.chunks(Document(doc_id="bench", text=record.context, source="synthetic"))
        if len(rows) >= num_chunks:
            break
        context_words *= 2
    else:
        raise BenchStoreError(f"no synthetic document of ≤{context_words} words gives {num_chunks} chunks")
    texts, counts = [r["text"] for r in rows], [r["num_text_tokens"] for r in rows]
    first = evidence_chunks(texts, record.evidence, record.answers[0])[0]
    order = [first] + [i for i in range(len(texts)) if i != first]
    order.insert(EVIDENCE_POSITION, order.pop(0))
    order = order[:num_chunks]
    return [texts[i] for i in order], [counts[i] for i in order], record.input


def build(uri: str, model: ModelSpec, render: RenderSpec, chunk_tokens: int, num_chunks: int,
          seed: int = 0, lazy_high_tier: bool = False) -> BenchStore:
    """Compile every variant of `num_chunks` chunks into a fresh store at `uri` (`lazy_high_tier`: all but
    the highest tier's templated entries, as `qvpic ingest --lazy-high-tier`)."""
    texts, counts, query = chunk_texts(model, chunk_tokens, num_chunks, seed)
    embedder = Embedder()
    cfg = IngestConfig(corpus="(in-process)", store=StoreSpec(uri=uri), model=model, render=render,
                       chunk_tokens=chunk_tokens, lazy_high_tier=lazy_high_tier)
    store, manifest = open_store(cfg)
    chunks = [Chunk.build(f"bench/{i:03d}", 0, text, n) for i, (text, n) in enumerate(zip(texts, counts))]
    errors = compile_in_process(store, manifest, VLM(model), [(c.chunk_key, c.text, None) for c in chunks])
    if errors:
        raise BenchStoreError(f"chunks failed to build: {errors}")
    vectors = embedder.embed(texts)
    store.publish_chunks([{**c.model_dump(), "source": "synthetic", "image_path": None, "embedding": v.tolist()}
                          for c, v in zip(chunks, vectors)])
    return BenchStore(uri, tuple(c.chunk_id for c in chunks), query, tuple(counts))
