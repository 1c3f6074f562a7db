"""Builds a small, complete store in-process (render → compile → embed → publish) for serving tests.

Every chunk gets every variant's entries (`entry_slots`): templated pages at every tier, plain and
dummy-prefix pages at the lowest, and both text variants — what every serving mode needs.
"""

from __future__ import annotations

import collections
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.ingest import new_manifest
from pipeline.ingest.stages import compile_in_process
from pipeline.runtime import VLM, Embedder
from pipeline.store import Store, publish_generation
from schemas.config import KVQuant, ModelSpec
from schemas.corpus import Chunk
from schemas.modes import Variant
from schemas.render import RenderSpec
from serve import LocalStack, build_local
from serve.config import LoaderConfig
from serve.kv import CacheLoader

ALL_VARIANTS = tuple(Variant)
DOCUMENTS: dict[str, list[str]] = {
    "invoices": ["Invoice 4471: part XK-4471-B ships on 12 March. The total is $1,093.40.",
                 "Invoice 4472: part QZ-19 ships on 3 April. The total is $88.00."],
    "manual": ["To reset the router, hold the button for ten seconds until the light blinks.",
               "The warranty covers two years of normal use and excludes water damage."],
    "recipes": ["Bake the bread at 220 degrees for thirty minutes, then let it cool."],
}


def build_store(root: Path, vlm: VLM, embedder: Embedder, documents: dict[str, list[str]] = DOCUMENTS,
                render: RenderSpec | None = None, variants: tuple[Variant, ...] = ALL_VARIANTS,
                lazy_high_tier: bool = False, legibility: bool = False,
                kv_quant: KVQuant = KVQuant.NONE) -> Store:
    """The ingest job's own render and compile stages, run in-process without Ray."""
    render = render or RenderSpec()
    store = Store.open(str(root), create=True)
    manifest = new_manifest(vlm.spec, render, variants, embedder.model_name, embedder.dim, "tests", lazy_high_tier,
                            kv_quant=kv_quant)
    store.write_manifest(manifest)
    chunks = [Chunk.build(doc_id, order, text, len(vlm.adapter.encode(text)))
              for doc_id, texts in documents.items() for order, text in enumerate(texts)]
    first = {c.chunk_key: c for c in reversed(sorted(chunks, key=lambda c: c.chunk_id))}  # as ingest picks
    errors = compile_in_process(store, manifest, vlm, [(c.chunk_key, c.text, None) for c in first.values()],
                                legibility=legibility)
    assert not errors, errors
    embeddings = embedder.embed([c.text for c in chunks])
    store.publish_chunks([dict(chunk.model_dump(), embedding=vector.tolist(), source=f"tests/{chunk.doc_id}",
                               image_path=None) for chunk, vector in zip(chunks, embeddings)])
    publish_generation(store, "tests")  # as ingest ends: what serving reads
    return store


@dataclass(frozen=True)
class ServingStore:
    uri: str
    model: ModelSpec
    vlm: VLM  # the model the store was compiled with
    embedder: Embedder


@pytest.fixture(scope="session")
def serving_store(tmp_path_factory) -> ServingStore:
    """`DOCUMENTS` compiled for float32 tiny-qwen on CPU, once per test session."""
    model = ModelSpec(path="tiny-qwen", device="cpu")
    vlm, embedder = VLM(model), Embedder()
    root = tmp_path_factory.mktemp("serving-store")
    build_store(root, vlm, embedder)
    return ServingStore(str(root), model, vlm, embedder)


def corrupt_entry(store_root: Path, row: dict) -> None:
    """Flip one byte inside the tensor an index row points at (safetensors: u64 header size, JSON header, data)."""
    path = Path(store_root) / row["shard_path"]
    data = bytearray(path.read_bytes())
    header_nbytes = struct.unpack("<Q", data[:8])[0]
    begin, _ = json.loads(data[8:8 + header_nbytes])[row["tensor_key"]]["data_offsets"]
    data[8 + header_nbytes + begin] ^= 0xFF
    path.write_bytes(bytes(data))


MAX_CHUNKS = 4  # below the store's 5 chunks, so a request can exceed it
MAX_CONTEXT_TOKENS = 1024  # small enough that a request can exceed it


def loader_of(uri: str, max_nbytes: int = 1 << 20) -> CacheLoader:
    """A cache loader over the store at `uri`, as a test builds one in-process."""
    return CacheLoader(LoaderConfig(store=uri, max_nbytes=max_nbytes))


def stack_of(uri: str, model: ModelSpec, max_chunks: int = MAX_CHUNKS, max_context_tokens: int | None = None,
             loader_nbytes: int = 1 << 20, **router: object) -> LocalStack:
    """The serving roles over the store at `uri`, in-process (serve/local.py `build_local`, as eval builds them)."""
    return build_local({"store": uri, "model": model.model_dump(),
                        "router": {"max_chunks": max_chunks, "max_context_tokens": max_context_tokens, **router},
                        "loader": {"max_nbytes": loader_nbytes}, "ingress": {"default_top_k": min(2, max_chunks)}})


@pytest.fixture(scope="session")
def roles(serving_store: ServingStore) -> LocalStack:
    """The three serving roles in-process (no Ray) over `serving_store`."""
    return stack_of(serving_store.uri, serving_store.model, max_context_tokens=MAX_CONTEXT_TOKENS)


def entries_read_each_time(router, monkeypatch) -> None:
    """Plans read every chunk's entries from the catalog, and keep none (serve/routing/retrieval.py `EntryCache`):
    for a test that changes what the catalog holds, which kept entries would hide."""
    cache = router.snapshot.entry_cache
    monkeypatch.setattr(cache, "max_rows", 0)
    monkeypatch.setattr(cache, "_rows", collections.OrderedDict())
