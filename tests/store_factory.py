"""Builds a small, complete store in-process (render → compile → embed → publish) for serving tests.

Every chunk gets TEMPLATE entries at every tier, a PLAIN entry at the lowest tier and a TEXT entry,
which is what every serving mode needs.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import pytest

from pipeline.embed import Embedder
from pipeline.render import Renderer
from pipeline.runtime.model import VLM, model_identity
from pipeline.store import Store
from schemas.config import ModelSpec, RenderSpec, RouterSpec, Variant
from schemas.corpus import Chunk
from schemas.store import Manifest, StoredModel
from serve.generator import Generator
from serve.loader import CacheLoader
from serve.router import Router

DOCUMENTS: dict[str, list[str]] = {
    "invoices": ["Invoice 4471: part XK-4471-B ships on 12 March. The total is $1,093.40.",
                 "Invoice 4472: part QZ-19 ships on 3 April. The total is $88.00."],
    "manual": ["To reset the router, hold the button for ten seconds until the light blinks.",
               "The warranty covers two years of normal use and excludes water damage."],
    "recipes": ["Bake the bread at 220 degrees for thirty minutes, then let it cool."],
}


def build_store(root: Path, vlm: VLM, embedder: Embedder, documents: dict[str, list[str]] = DOCUMENTS,
                render: RenderSpec | None = None) -> Store:
    render = render or RenderSpec()
    store = Store.open(str(root), create=True)
    now = datetime.now(timezone.utc)
    model_id, revision, family, template_prefix = model_identity(vlm.spec)
    manifest = Manifest.create(
        StoredModel(id=model_id, revision=revision, dtype=vlm.spec.dtype, family=family), template_prefix, render=render, variants=(Variant.TEMPLATE, Variant.PLAIN, Variant.TEXT),
        embedder=embedder.model_name, embedding_dim=embedder.dim, created_at=now, updated_at=now, job_ids=("tests",),
    )
    store.write_manifest(manifest)
    renderer = Renderer(render)
    chunks = [Chunk.build(doc_id, order, text, len(vlm.adapter.encode(text)))
              for doc_id, texts in documents.items() for order, text in enumerate(texts)]
    index_rows, compiled = [], set()
    for chunk in chunks:
        if chunk.chunk_key in compiled:
            continue
        compiled.add(chunk.chunk_key)
        entries = [(Variant.TEXT, None, vlm.compile_text(chunk.text, with_template=True), None)]
        for tier in render.tiers:
            pages = renderer.render(chunk.text, tier).pages
            entries.append((Variant.TEMPLATE, tier.name, vlm.compile_images(pages, with_template=True), pages))
            if tier == render.lowest_tier:
                entries.append((Variant.PLAIN, tier.name, vlm.compile_images(pages, with_template=False), pages))
        tensors = {f"{variant.value}.{tier or 'text'}": kv.kv for variant, tier, kv, _ in entries}
        shard = {e.tensor_key: e for e in store.write_shard(tensors)}
        for variant, tier, kv, pages in entries:
            merge = vlm.adapter.merge_size
            index_rows.append(dict(
                chunk_key=chunk.chunk_key, tier=tier, variant=variant.value,
                fingerprint=manifest.entry_fingerprint(variant, tier), kind=kv.kind.value,
                num_tokens=kv.num_tokens, position_span=kv.position_span, compile_start=kv.compile_start,
                grid_thw=[list(g) for g in kv.grid_thw], image_sizes_px=[list(p.size) for p in pages or []],
                vision_tokens=sum(t * h * w // merge**2 for t, h, w in kv.grid_thw),
                **shard[f"{variant.value}.{tier or 'text'}"].index_fields(),
            ))
    store.publish_index(index_rows)
    embeddings = embedder.embed([c.text for c in chunks])
    store.publish_chunks([dict(chunk.model_dump(), embedding=vector.tolist(), source=f"tests/{chunk.doc_id}", image_path=None)
                          for chunk, vector in zip(chunks, embeddings)])
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


@dataclass(frozen=True)
class Roles:
    router: Router
    loader: CacheLoader
    generator: Generator


@pytest.fixture(scope="session")
def roles(serving_store: ServingStore) -> Roles:
    """The three serving roles in-process (no Ray) over `serving_store`."""
    router = Router(serving_store.uri, serving_store.model, RouterSpec(), MAX_CHUNKS, MAX_CONTEXT_TOKENS)
    return Roles(router, CacheLoader(serving_store.uri, 1 << 20), Generator(serving_store.uri, serving_store.model))
