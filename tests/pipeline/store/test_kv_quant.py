"""Quantised KV entries: round-trip error bounds (KIVI axes), the shard record, identity, serving."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pipeline.ingest import new_manifest
from pipeline.runtime import ChunkKV, stored_format
from pipeline.store import QuantizedKV, ShardCorruptError, ShardReader, Store, check_device, dequantize, write_shard
from pipeline.store.kv_quant import absmax_scale, quantize, record_nbytes, to_payload
from schemas.api import AnswerRequest
from schemas.config import DType, KVQuant
from schemas.modes import Variant
from schemas.render import RenderSpec
from schemas.store import Manifest
from serve.config import GeneratorConfig, RouterConfig
from serve.engine import Generator
from serve.kv import LocalLoader, kv_tensor
from serve.routing import Router
from tests.support.store_factory import build_store, loader_of, serving_store, stack_of  # noqa: F401  (fixture)

QUANTS = (KVQuant.INT8, KVQuant.FP8)
# Worst relative L2 error of any key channel / value token (over its own axis): int8's step is absmax/127,
# fp8 e4m3 keeps 3 mantissa bits (≤ 2^-4 relative per element).
BOUND = {KVQuant.INT8: 0.01, KVQuant.FP8: 0.05}


def realistic_kv(layers=2, heads=2, tokens=64, head_dim=16, seed=0) -> torch.Tensor:
    """KV with what KIVI's axes are for: a few key channels 30x larger than the rest (post-RoPE key
    outliers), a few value tokens 30x larger than the rest."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(layers, 2, heads, tokens, head_dim, generator=g)
    kv[:, 0, :, :, :2] *= 30.0  # outlier key channels
    kv[:, 1, :, :3, :] *= 30.0  # outlier value tokens
    return kv


def worst_errors(approx: torch.Tensor, kv: torch.Tensor) -> tuple[float, float]:
    """(worst key channel, worst value token) relative L2 error."""
    err = (approx.float() - kv.float())
    keys = err[:, 0].norm(dim=2) / kv[:, 0].norm(dim=2)  # over tokens: per (layer, head, channel)
    values = err[:, 1].norm(dim=3) / kv[:, 1].norm(dim=3)  # over channels: per (layer, head, token)
    return float(keys.max()), float(values.max())


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_is_within_the_bound_on_every_key_channel_and_value_token(quant, dtype):
    kv = realistic_kv().to(dtype)
    back = dequantize(quantize(kv, quant), dtype)
    assert back.dtype == dtype and back.shape == kv.shape
    key_err, value_err = worst_errors(back, kv.float())
    assert key_err < BOUND[quant] and value_err < BOUND[quant], (key_err, value_err)
    assert key_err > 0  # it is lossy: the test measures something


def test_negative_control_wrong_axis_scales_fail_the_bound():
    """Keys scaled per token and values per channel (the axes swapped): each outlier then sets the scale of
    every other element of its token (keys) or channel (values), and ordinary channels/tokens lose their bits.
    int8 only: fp8's payload is floating point, so its relative step barely depends on the scale (swapped
    axes measure 0.036 / 0.039 here, inside fp8's own bound) — the axes are what int8 needs."""
    quant = KVQuant.INT8
    kv = realistic_kv()
    keys, values = kv[:, 0], kv[:, 1]
    key_scale, value_scale = absmax_scale(keys, 3, quant), absmax_scale(values, 2, quant)  # swapped axes
    back = torch.stack((to_payload(keys, key_scale, quant).float() * key_scale.float(),
                        to_payload(values, value_scale, quant).float() * value_scale.float()), 1)
    key_err, value_err = worst_errors(back, kv)
    assert key_err > BOUND[quant] and value_err > BOUND[quant], (key_err, value_err)


@pytest.mark.parametrize("quant", QUANTS)
def test_negative_control_dropping_the_scales_fails_the_bound(quant):
    kv = realistic_kv()
    key_err, value_err = worst_errors(quantize(kv, quant).payload.float(), kv)
    assert key_err > BOUND[quant] and value_err > BOUND[quant]


def test_the_device_probe_passes_here_and_names_the_format_when_a_cast_is_missing(monkeypatch):
    for quant in KVQuant:
        check_device(quant, "cpu")
    import pipeline.store.kv_quant as kv_quant

    def no_fp8(*_args, **_kwargs):
        raise NotImplementedError("\"copy_\" not implemented for 'Float8_e4m3fn'")
    monkeypatch.setattr(kv_quant, "to_payload", no_fp8)
    with pytest.raises(ValueError, match="fp8 KV is not supported on cpu"):
        check_device(KVQuant.FP8, "cpu")


def test_zero_kv_round_trips_exactly():
    kv = torch.zeros(1, 2, 1, 4, 8)
    assert torch.equal(dequantize(quantize(kv, KVQuant.INT8), torch.float32), kv)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_a_record_is_half_of_bf16_plus_its_scales(head_dim):
    shape = (28, 2, 4, 1000, head_dim)  # a 1000-token entry of a Qwen2.5-VL-7B-shaped model at 128
    bf16 = torch.Size(shape).numel() * 2
    ratio = record_nbytes(shape, KVQuant.INT8) / bf16
    assert 0.5 < ratio <= 0.5 + 1 / head_dim + 1 / 1000  # value scales: 2 B per head_dim B; key scales per entry


def test_a_record_refuses_a_wrong_size_or_format():
    record = quantize(realistic_kv(), KVQuant.INT8)
    with pytest.raises(ValueError):
        QuantizedKV(KVQuant.INT8, (2, 2, 2, 63, 16), record.record)  # another shape's bytes
    with pytest.raises(ValueError):
        QuantizedKV(KVQuant.NONE, record.shape, record.record)
    with pytest.raises(ValueError):
        stored_format("none")
    assert stored_format("int8") is KVQuant.INT8 and stored_format("bfloat16") is DType.BFLOAT16


# ---- the shard record ------------------------------------------------------------------------------
@pytest.mark.parametrize("quant", QUANTS)
def test_shard_round_trip_keeps_the_record_and_checks_it(tmp_path, quant):
    store = Store.open(str(tmp_path), create=True)
    kv = realistic_kv()
    packed = quantize(kv, quant)
    entries = write_shard(store.blobs, {"q": packed, "plain": kv.to(torch.bfloat16)})
    rows = {e.tensor_key: e.index_fields() for e in entries}
    assert rows["q"]["dtype"] == quant.value and rows["q"]["shape"] == list(kv.shape)
    assert rows["q"]["nbytes"] == record_nbytes(kv.shape, quant) < rows["plain"]["nbytes"] * 0.6
    loaded, plain = ShardReader(store.blobs).load_many([rows["q"], rows["plain"]])
    assert isinstance(loaded, QuantizedKV) and torch.equal(loaded.record, packed.record)
    assert torch.equal(plain, kv.to(torch.bfloat16))
    with pytest.raises(ShardCorruptError):  # the record's bytes read as a float tensor: refused, never served
        ShardReader(store.blobs).load_many([{**rows["q"], "dtype": "bfloat16"}])
    with pytest.raises(ShardCorruptError):  # bf16 bytes read as an int8 record: refused
        ShardReader(store.blobs).load_many([{**rows["plain"], "dtype": quant.value}])


# ---- identity ----------------------------------------------------------------------------------------
def manifest(kv_quant: KVQuant) -> Manifest:
    from schemas.config import ModelSpec
    return new_manifest(ModelSpec(device="cpu"), RenderSpec(), (Variant.TEMPLATE, Variant.TEXT), "minilm", 384, "t",
                        kv_quant=kv_quant)


def test_every_entry_fingerprint_depends_on_the_kv_format_and_unquantised_ones_are_unchanged():
    none, int8, fp8 = (manifest(q) for q in (KVQuant.NONE, KVQuant.INT8, KVQuant.FP8))
    for tier, variant in (("low", Variant.TEMPLATE), ("high", Variant.TEMPLATE), (None, Variant.TEXT)):
        prints = {m.entry_fingerprint(variant, tier) for m in (none, int8, fp8)}
        assert len(prints) == 3
    old = Manifest.from_json(none.model_dump_json(exclude={"kv_quant"}))  # a manifest written before the field
    assert (old.kv_quant is KVQuant.NONE
            and old.entry_fingerprint(Variant.TEXT, None) == none.entry_fingerprint(Variant.TEXT, None))


def test_ingest_keeps_a_stores_format_and_refuses_to_mix_two(tmp_path):
    from pipeline.ingest import IngestConfig, open_store
    from schemas.config import ModelSpec
    from schemas.store import StoreSpec
    spec, model = StoreSpec(uri=str(tmp_path)), ModelSpec(device="cpu")
    _, first = open_store(IngestConfig(corpus="-", store=spec, model=model, kv_quant=KVQuant.INT8))
    _, again = open_store(IngestConfig(corpus="-", store=spec, model=model))  # no flag: the store's own
    assert first.kv_quant is again.kv_quant is KVQuant.INT8
    with pytest.raises(ValueError, match="recompile --kv-quant none"):
        open_store(IngestConfig(corpus="-", store=spec, model=model, kv_quant=KVQuant.NONE))


def test_recompile_to_another_format_needs_every_entry_again():
    from pipeline.ingest import RecompileConfig
    from pipeline.ingest.recompile_job import target_manifest
    from schemas.store import StoreSpec
    old = manifest(KVQuant.INT8)
    kept, _ = target_manifest(old, RecompileConfig(store=StoreSpec(uri="x")))
    changed, _ = target_manifest(old, RecompileConfig(store=StoreSpec(uri="x"), kv_quant=KVQuant.FP8))
    assert kept.kv_quant is KVQuant.INT8 and changed.kv_quant is KVQuant.FP8
    slots = (("low", Variant.TEMPLATE), ("high", Variant.TEMPLATE), (None, Variant.TEXT))
    assert all(kept.entry_fingerprint(v, t) == old.entry_fingerprint(v, t) for t, v in slots)
    assert not {old.entry_fingerprint(v, t) for t, v in slots} & {changed.entry_fingerprint(v, t) for t, v in slots}


# ---- serving ------------------------------------------------------------------------------------------
LOGIT_BOUND = 0.05  # relative L2 of the query's logits, int8 vs the unquantised entries (float32 tiny-qwen)


def test_an_int8_store_serves_int8_entries_whose_logits_are_close_to_unquantised(serving_store, tmp_path):
    build_store(tmp_path, serving_store.vlm, serving_store.embedder, kv_quant=KVQuant.INT8)
    store = Store.open(str(tmp_path))
    index = store.index()
    assert set(index["dtype"].to_pylist()) == {"int8"}
    plain_index = Store.open(serving_store.uri).index()
    assert sum(index["nbytes"].to_pylist()) < 0.3 * sum(plain_index["nbytes"].to_pylist())  # of float32

    model, uri = serving_store.model, str(tmp_path)
    quant = stack_of(uri, model, max_chunks=4, loader_nbytes=1 << 24)
    plain = stack_of(serving_store.uri, model, max_chunks=4, loader_nbytes=1 << 24)
    request = AnswerRequest(query="When does part XK-4471-B ship?", chunk_ids=["invoices#00000", "manual#00001"],
                            tau=1.0, max_new_tokens=8)
    from schemas.sampling import Sampling
    reply = quant.generator.generate_blocking(asyncio.run(quant.router.plan(request)), Sampling(max_new_tokens=8))
    assert reply.report.usage.completion_tokens > 0 and reply.report.cache.nbytes_from_store > 0
    assert quant.loader.stats().nbytes == reply.report.cache.nbytes_from_store  # the LRU keeps the records
    from schemas.store import StoreSpec
    from serve.app import api_spec
    from serve.config import AppConfig
    assert api_spec(AppConfig(store=StoreSpec(uri=uri))).store.kv_quant is KVQuant.INT8  # GET /v1/store says so

    vlm = serving_store.vlm
    logits = {}
    for name, roles in (("int8", quant), ("none", plain)):
        planned = asyncio.run(roles.router.plan(request))
        loaded = roles.loader.load(planned)
        assert {kv.dtype for kv in loaded.kvs} == ({KVQuant.INT8} if name == "int8" else {DType.FLOAT32})
        chunks = [ChunkKV(kv_tensor(kv, vlm.device, vlm.dtype, copy=False), kv.entry.position_span, kv.compile_start,
                          kv.kind, kv.grid_thw) for kv in loaded.kvs]
        logits[name] = vlm.prefill_query(vlm.assemble(chunks), request.query).logits[0, -1].float()
    gap = float((logits["int8"] - logits["none"]).norm() / logits["none"].norm())
    assert 0 < gap < LOGIT_BOUND, gap


def test_a_lazy_int8_store_writes_back_int8_and_serves_the_same_answer_from_it(serving_store, tmp_path):
    """A lazily compiled tier's first promotion is written back in the store's format, and the request that
    compiled it is served what the store now keeps: the answer equals the one served from the written-back entry."""
    from pipeline.store import written_back
    from schemas.modes import Mode
    from schemas.sampling import Sampling
    from schemas.store import CacheKey
    from serve.kv import is_pending
    build_store(tmp_path, serving_store.vlm, serving_store.embedder, lazy_high_tier=True, kv_quant=KVQuant.INT8)
    uri, model = str(tmp_path), serving_store.model
    router = Router(RouterConfig(store=uri, model=model, max_chunks=4))
    request = AnswerRequest(query="When does part XK-4471-B ship?", chunk_ids=["invoices#00000", "manual#00001"],
                            mode=Mode.QVPIC, tau=0.5, max_high_res=1, max_new_tokens=6)
    plan = asyncio.run(router.plan(request))
    (pending,) = [c.entry for c in plan.chunks if is_pending(c.entry)]
    first = Generator(GeneratorConfig(store=uri, model=model))
    compiled = first.generate_blocking(plan, Sampling(max_new_tokens=6), source=LocalLoader(loader_of(uri)))
    row = written_back(Store.open(uri), CacheKey.parse(pending.key))
    assert row is not None and row["dtype"] == "int8"
    other = Generator(GeneratorConfig(store=uri, model=model))  # another replica reads the written-back entry
    from_store = other.generate_blocking(plan, Sampling(max_new_tokens=6), source=LocalLoader(loader_of(uri)))
    assert other.repairer.lazy.stats.from_store == 1 and from_store.text == compiled.text
