"""`POST /v1/embeddings` over the in-process roles: the store's own embedder. The expected vectors come from
outside the route: the float32 embeddings the ingest wrote into the store's chunk table for the same texts."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

from pipeline.store import Store
from schemas.embeddings import MAX_INPUTS, MAX_TOTAL_CHARS
from tests.serve.http.test_api import app, call  # noqa: F401  (a fixture)
from tests.serve.http.test_openai_params import SyncASGI
from tests.support.store_factory import roles, serving_store  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def stored(serving_store) -> tuple[list[str], np.ndarray]:
    """The chunk texts and the vectors the ingest stored for them."""
    table = Store.open(serving_store.uri).chunks()
    texts = table["text"].to_pylist()
    return texts, np.asarray(table["embedding"].to_pylist(), dtype=np.float32)


def embed(app, **fields) -> httpx.Response:
    return call(app, "POST", "/v1/embeddings", json={"model": "qvpic", **fields})


def test_the_vectors_are_the_ones_the_store_holds(app, stored):
    texts, vectors = stored
    reply = embed(app, input=texts)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == list(range(len(texts)))
    assert {d["object"] for d in body["data"]} == {"embedding"}
    got = np.asarray([d["embedding"] for d in body["data"]], dtype=np.float32)
    assert got.shape == vectors.shape and np.abs(got - vectors).max() < 1e-6
    assert body["model"] == call(app, "GET", "/v1/store").json()["embedder"]
    single = embed(app, input=texts[1]).json()["data"]  # a string is one input
    assert len(single) == 1 and np.abs(np.asarray(single[0]["embedding"]) - vectors[1]).max() < 1e-6


def test_base64_is_the_same_little_endian_float32s(app, stored):
    texts, vectors = stored
    data = embed(app, input=texts[:2], encoding_format="base64").json()["data"]
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in data])
    assert np.abs(decoded - vectors[:2]).max() < 1e-6


def test_usage_counts_the_embedders_tokens(app, serving_store):
    tokenizer = serving_store.embedder._model.tokenizer
    texts = ["part XK-4471-B", "When does the invoice ship?"]
    expected = sum(len(tokenizer(t)["input_ids"]) for t in texts)  # [CLS] … [SEP], short of the window
    usage = embed(app, input=texts).json()["usage"]
    assert usage == {"prompt_tokens": expected, "total_tokens": expected}
    assert embed(app, input=texts[:1]).json()["usage"]["prompt_tokens"] < expected  # control


def test_the_embedders_own_name_is_a_model_and_others_are_404(app):
    name = call(app, "GET", "/v1/store").json()["embedder"]
    assert embed(app, model=name, input="hi").status_code == 200
    missing = embed(app, model="text-embedding-3-small", input="hi")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_the_openai_client_embeds(app, stored):
    texts, vectors = stored
    client = openai.OpenAI(api_key="none", base_url="http://localhost/v1",
                           http_client=httpx.Client(transport=SyncASGI(app)))
    result = client.embeddings.create(model="qvpic", input=texts[:3])  # the client asks for base64 and decodes it
    got = np.asarray([d.embedding for d in result.data], dtype=np.float32)
    assert np.abs(got - vectors[:3]).max() < 1e-6 and result.usage.prompt_tokens > 0
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model="qvpic", input="hi", dimensions=8)
    assert refused.value.param == "dimensions"


@pytest.mark.parametrize("fields, param, fragment", [
    ({"input": [101, 2023, 102]}, "input", "token-id arrays"),
    ({"input": [[101, 2023]]}, "input", "token-id arrays"),
    ({"input": ["ok"] * (MAX_INPUTS + 1)}, "input", f"at most {MAX_INPUTS}"),
    ({"input": "x" * 8001}, "input", "at most 8000"),
    ({"input": ["x" * 8000] * (MAX_TOTAL_CHARS // 8000 + 1)}, "input", f"at most {MAX_TOTAL_CHARS}"),
    ({"input": ""}, "input", "at least 1"),
    ({"input": []}, "input", "at least 1"),
    ({"input": "hi", "dimensions": 8}, "dimensions", "384"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", ""),
    ({"input": "hi", "truncate": True}, "truncate", "does not take"),
])
def test_bad_inputs_are_400_naming_the_field(app, roles, fields, param, fragment):
    calls = []
    real = roles.router.embed
    roles.router.embed = lambda texts: calls.append(texts) or real(texts)
    try:
        response = embed(app, **fields)
    finally:
        roles.router.embed = real
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    assert calls == []  # refused before any work
