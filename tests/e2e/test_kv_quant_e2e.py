"""A store ingested with `--kv-quant int8` through the real job, then recompiled to fp8, serving throughout."""

from __future__ import annotations

import asyncio
import json

import pytest

from jobs.ingest import main as ingest_main
from pipeline.ingest import IngestConfig, RecompileConfig, ingest, recompile
from pipeline.store import Store, entry_slots
from schemas.api import AnswerRequest
from schemas.config import KVQuant, ModelSpec
from schemas.modes import Variant
from schemas.sampling import Sampling
from schemas.store import StoreSpec
from serve.config import GeneratorConfig, LoaderConfig, RouterConfig
from serve.engine import Generator
from serve.kv import CacheLoader, LocalLoader
from serve.routing import Router
from tests.support.ray_fixtures import ray_session  # noqa: F401  (pytest fixture)

pytestmark = pytest.mark.e2e
DOCS = [("atlas", "The Atlas pump ships with part XK-4471-B. Its warranty lasts 36 months."),
        ("dune", "Dune Labs keeps the vault 7 access code, QX-5581-K, in room 114.")]
VARIANTS = (Variant.TEMPLATE, Variant.TEXT)


def answer(uri: str) -> str:
    model = ModelSpec(device="cpu")
    router = Router(RouterConfig(store=uri, model=model, max_chunks=4))
    loader = CacheLoader(LoaderConfig(store=uri, max_nbytes=1 << 24))
    generator = Generator(GeneratorConfig(store=uri, model=model))
    plan = asyncio.run(router.plan(AnswerRequest(query="Where is the vault code?", top_k=2, max_new_tokens=4)))
    return generator.generate_blocking(plan, Sampling(max_new_tokens=4), source=LocalLoader(loader)).text


def formats(store: Store) -> set[str]:
    manifest = store.load_manifest_or_raise()
    index = store.index()
    wanted = {manifest.entry_fingerprint(v, t) for t, v in entry_slots(manifest, manifest.variants)}
    assert set(index["fingerprint"].to_pylist()) == wanted  # nothing of another format is left to serve
    return set(index["dtype"].to_pylist())


def test_the_cli_refuses_an_unknown_format(tmp_path, capsys):
    with pytest.raises(SystemExit):
        ingest_main(["--corpus", str(tmp_path), "--store", str(tmp_path / "s"), "--kv-quant", "int4"])
    assert "int4" in capsys.readouterr().err


def test_int8_ingest_serves_and_a_recompile_to_fp8_rebuilds_every_entry(ray_session, tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("\n".join(json.dumps({"doc_id": d, "text": t}) for d, t in DOCS) + "\n")
    spec = StoreSpec(uri=str(tmp_path / "store"))
    summary = ingest(IngestConfig(corpus=str(corpus), store=spec, chunk_tokens=64, variants=VARIANTS,
                                  kv_quant=KVQuant.INT8))
    assert summary.indexed == 2
    store = Store.open(spec)
    assert store.load_manifest_or_raise().kv_quant is KVQuant.INT8 and formats(store) == {"int8"}
    assert answer(spec.uri)

    with pytest.raises(ValueError, match="recompile --kv-quant fp8"):  # a second format would mix into the store
        ingest(IngestConfig(corpus=str(corpus), store=spec, chunk_tokens=64, variants=VARIANTS, kv_quant=KVQuant.FP8))

    entries = store.index().num_rows
    result = recompile(RecompileConfig(store=spec, kv_quant=KVQuant.FP8, orphan_grace_s=0.0))
    assert result.num_failed == 0 and result.num_entries_dropped == entries  # every int8 entry replaced
    store = Store.open(spec)
    assert store.load_manifest_or_raise().kv_quant is KVQuant.FP8 and formats(store) == {"fp8"}
    assert store.index().num_rows == entries
    assert answer(spec.uri)
