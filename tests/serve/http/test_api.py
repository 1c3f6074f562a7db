"""The HTTP surface without Ray: FastAPI app over the in-process roles, through httpx.ASGITransport."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import jsonschema
import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from jobs import run_server
from schemas.api import AnswerRequest
from schemas.config import ModelSpec
from schemas.errors import UnservableError
from schemas.service import CacheStats
from schemas.store import ManifestError
from serve.app import api_spec, preflight
from serve.config import AppConfig
from serve.http import make_api
from serve.kv import store_row
from serve.local import InProcessBackend
from tests.support.paths import REPO
from tests.support.store_factory import MAX_CHUNKS, corrupt_entry, loader_of, roles, serving_store  # noqa: F401  (fixtures)

QUERY = "When does part XK-4471-B ship?"


@pytest.fixture(scope="module")
def app(roles, serving_store):
    args = AppConfig(store={"uri": serving_store.uri}, model=serving_store.model, router={"max_chunks": MAX_CHUNKS},
                     ingress={"default_top_k": 2})
    return make_api(InProcessBackend(roles.router, roles.loader, roles.generator), api_spec(args))


def call(app, method: str, path: str, **kwargs) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as client:
            return await client.request(method, path, **kwargs)
    return asyncio.run(go())


def conforms(spec: dict, schema_name: str, body: dict) -> None:
    """Validate `body` against a component of the served OpenAPI document."""
    schema = {"$ref": f"#/components/schemas/{schema_name}", "components": spec["components"]}
    jsonschema.Draft202012Validator(schema).validate(body)


def sse_events(text: str) -> list:
    return [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("body, fragment", [
    ({"query": QUERY}, "exactly one of chunk_ids"),
    ({"query": QUERY, "top_k": 2, "doc_ids": ["manual"]}, "exactly one of chunk_ids"),
    ({"query": QUERY, "top_k": 2, "store_uri": "/etc"}, "Extra inputs"),
    ({"query": "", "top_k": 2}, "at least 1 character"),
    ({"query": "x" * 8001, "top_k": 2}, "at most 8000"),
    ({"query": QUERY, "top_k": 2, "max_new_tokens": 5000}, "less than or equal to 4096"),
    ({"query": QUERY, "top_k": 2, "temperature": -1}, "greater than or equal to 0"),
    ({"query": QUERY, "top_k": 2, "mode": "fastest"}, "Input should be"),
    ({"query": QUERY, "chunk_ids": ["bad\nid"]}, "should match pattern"),
])
def test_malformed_bodies_are_422(app, body, fragment):
    response = call(app, "POST", "/v1/answer", json=body)
    assert response.status_code == 422 and fragment in response.text


def test_unknown_ids_are_404_and_limits_are_413(app):
    missing = call(app, "POST", "/v1/answer", json={"query": QUERY, "chunk_ids": ["invoices#00000", "nope"]})
    assert missing.status_code == 404 and missing.json() == {"detail": "unknown chunk_ids: ['nope']"}
    too_many = call(app, "POST", "/v1/answer", json={"query": QUERY, "top_k": MAX_CHUNKS + 1})
    assert too_many.status_code == 413 and f"at most {MAX_CHUNKS}" in too_many.json()["detail"]
    too_long = call(app, "POST", "/v1/answer", json={"query": QUERY, "top_k": 2, "max_new_tokens": 4000})
    assert too_long.status_code == 413 and "the context holds 1024" in too_long.json()["detail"]


def test_answer_matches_its_openapi_schema(app):
    spec = call(app, "GET", "/openapi.json").json()
    assert {"/v1/answer", "/v1/chat/completions", "/v1/models", "/v1/store", "/healthz"} <= set(spec["paths"])
    response = call(app, "POST", "/v1/answer", json={"query": QUERY, "doc_ids": ["invoices"], "max_new_tokens": 6})
    assert response.status_code == 200
    conforms(spec, "AnswerResponse", response.json())
    assert [c["chunk_id"] for c in response.json()["chunks"]] == ["invoices#00000", "invoices#00001"]
    conforms(spec, "StoreStatus", call(app, "GET", "/v1/store").json())
    conforms(spec, "ModelList", call(app, "GET", "/v1/models").json())
    conforms(spec, "Health", call(app, "GET", "/healthz").json())
    error = call(app, "POST", "/v1/answer", json={"query": QUERY, "doc_ids": ["ghost"]})
    assert "404" in spec["paths"]["/v1/answer"]["post"]["responses"]
    conforms(spec, "ErrorBody", error.json())


def test_streamed_answer_is_sse_and_adds_up(app):
    body = {"query": QUERY, "chunk_ids": ["invoices#00000"], "max_new_tokens": 8}
    plain = call(app, "POST", "/v1/answer", json=body).json()
    streamed = call(app, "POST", "/v1/answer", json={**body, "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    *deltas, done = [json.loads(e) for e in sse_events(streamed.text)]
    assert {d["type"] for d in deltas} == {"delta"} and done["type"] == "done"
    assert "".join(d["text"] for d in deltas) == done["response"]["answer"] == plain["answer"]


def test_chat_completions(app):
    spec = call(app, "GET", "/openapi.json").json()
    body = {"model": "qvpic", "messages": [{"role": "user", "content": QUERY}], "max_tokens": 6, "temperature": 0,
            "qvpic": {"chunk_ids": ["invoices#00000"]}}
    response = call(app, "POST", "/v1/chat/completions", json=body)
    assert response.status_code == 200
    completion = response.json()
    conforms(spec, "ChatCompletion", completion)
    native = call(app, "POST", "/v1/answer",
                  json={"query": QUERY, "chunk_ids": ["invoices#00000"], "max_new_tokens": 6}).json()
    assert completion["choices"][0]["message"]["content"] == native["answer"]
    usage = completion["usage"]
    assert usage["prompt_tokens"] == native["usage"]["context_tokens"] + native["usage"]["query_tokens"]
    chunk_tokens = sum(c["num_tokens"] for c in completion["qvpic"]["chunks"])
    assert usage["prompt_tokens_details"]["cached_tokens"] >= chunk_tokens  # linked: the chunks' KV came from the store
    again = call(app, "POST", "/v1/chat/completions", json=body, headers={"Cache-Control": "no-cache"}).json()
    assert again["choices"][0]["message"]["content"] == native["answer"]  # computed again, from the prefix cache
    # all of it, and the logits after its last token (schemas.config.PrefixCacheSpec.final_logits): no forward
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]

    # a one-token answer ends at its prefill, before it joins the batch: its prompt is kept all the same
    one = {**body, "max_tokens": 1, "messages": [{"role": "user", "content": QUERY + " In one token."}]}
    call(app, "POST", "/v1/chat/completions", json=one, headers={"Cache-Control": "no-cache"})
    repeat = call(app, "POST", "/v1/chat/completions", json=one, headers={"Cache-Control": "no-cache"}).json()
    assert repeat["usage"]["prompt_tokens_details"]["cached_tokens"] == repeat["usage"]["prompt_tokens"]

    retrieved = call(app, "POST", "/v1/chat/completions", json={**body, "qvpic": {"mode": "full_text"}}).json()
    # online: only the template start before the chunks is shared with the prompts above (the prefix cache)
    assert len(retrieved["qvpic"]["chunks"]) == 2
    online_cached = retrieved["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < online_cached <= native["usage"]["context_tokens"] - chunk_tokens

    streamed = call(app, "POST", "/v1/chat/completions",
                    json={**body, "stream": True, "stream_options": {"include_usage": True}})
    events = sse_events(streamed.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert (all(c["object"] == "chat.completion.chunk" for c in chunks)
            and chunks[0]["choices"][0]["delta"]["role"] == "assistant")
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == native["answer"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    # the response cache's copy (nothing computed: its whole prompt counts as cached)
    assert chunks[-1]["choices"] == [] and chunks[-2]["qvpic"]["response_cache"]["level"] == "l1"
    assert chunks[-1]["usage"] == usage | {"prompt_tokens_details": {"cached_tokens": usage["prompt_tokens"]}}


@pytest.mark.parametrize("body, status, fragment", [
    ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "not served here"),
    ({"model": "qvpic", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]},
     400, "must end with a user or tool message"),
    ({"model": "qvpic", "messages": []}, 400, "at least 1 item"),
    ({"model": "qvpic", "messages": [{"role": "user", "content": "hi"}], "n": 9}, 400, "at most 8 choices"),
    ({"model": "qvpic", "messages": [{"role": "user", "content": "hi"}], "qvpic": {"top_k": 1, "doc_ids": ["a"]}},
     400, "at most one of"),
    ({"model": "qvpic", "messages": [{"role": "user", "content": "hi"}], "qvpic": {"doc_ids": ["ghost"]}},
     404, "ghost"),
])
def test_chat_errors_in_openai_shape(app, body, status, fragment):
    spec = call(app, "GET", "/openapi.json").json()
    response = call(app, "POST", "/v1/chat/completions", json=body)
    assert response.status_code == status and fragment in response.json()["error"]["message"]
    conforms(spec, "OpenAIErrorBody", response.json())


def test_store_compiled_for_another_model_is_refused(serving_store):
    preflight(AppConfig(store={"uri": serving_store.uri}, model=serving_store.model))
    for other in (ModelSpec(path="tiny-qwen", dtype="bfloat16"), ModelSpec(path="tiny-glm")):
        with pytest.raises(ManifestError, match=rf"refusing to serve {other.path}@\w+ \({other.dtype.value}\)"):
            preflight(AppConfig(store={"uri": serving_store.uri}, model=other))
    assert run_server.main(["--store", serving_store.uri, "--dtype", "bfloat16"]) == 2


def test_server_flags_override_the_serve_config():
    config = yaml.safe_load((REPO / "serve" / "config.yaml").read_text())
    assert ServeDeploySchema.model_validate(config).applications[0].import_path == "serve.app:build_app"
    ns = run_server.parser().parse_args(["--config", str(REPO / "serve" / "config.yaml"), "--store", "/data/store",
                                         "--tau", "0.25", "--generator-gpus", "0"])
    args = run_server.app_args(ns)
    assert (args.store.uri == "/data/store" and args.router.defaults.tau == 0.25
            and args.router.defaults.max_high_res == 4)
    assert args.generator_deployment.num_gpus == 0 and args.generator_deployment.autoscaling_config["max_replicas"] == 8
    assert run_server.main(["--store", "/data/store", "--top-k", "100"]) == 2  # default_top_k above max_chunks
    assert run_server.main(["--store", "/data/store", "--detach"]) == 2  # nothing to detach from


def test_a_local_cpu_serve_without_a_config_shares_the_machines_cores_among_its_generators(monkeypatch):
    """The default 0.1-CPU generator would run its forwards on one thread; a local CPU run gives them the cores
    this process may use (4 here), split among fixed replicas. A config file, a cluster or a GPU keep the replica's
    reservation (rounded up, serve/engine/generator.py); the flag wins over all."""
    monkeypatch.setattr(run_server.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})

    def threads(*flags: str) -> int | None:
        return run_server.app_args(run_server.parser().parse_args(["--store", "/s", *flags])).generator.engine \
            .forward.threads

    assert threads() == 4 and threads("--generator-replicas", "2") == 2 and threads("--generator-replicas", "8") == 1
    assert threads("--address", "auto") is None and threads("--generator-gpus", "1") is None
    assert threads("--config", str(REPO / "serve" / "config.yaml")) is None
    assert threads("--forward-threads", "3") == 3 and threads("--address", "auto", "--forward-threads", "2") == 2



def test_each_flag_lands_in_its_role_and_shared_fields_are_set_once():
    ns = run_server.parser().parse_args([
        "--store", "/s", "--model", "tiny-glm", "--cache-nbytes", "1024", "--max-chunks", "9", "--top-k", "3",
        "--max-context-tokens", "512", "--router-search-threads", "2", "--max-batch-size", "4",
        "--request-timeout-s", "7", "--served-model-name", "m", "--hybrid", "--recompute", "leading"])
    args = run_server.app_args(ns)
    assert (args.loader.max_nbytes, args.router.max_chunks, args.router.max_context_tokens) == (1024, 9, 512)
    assert (args.router.scan.search_threads, args.generator.engine.max_batch_size) == (2, 4)
    assert (args.ingress.default_top_k, args.ingress.request_timeout_s, args.ingress.served_model_name) == (3, 7, "m")
    assert args.router.defaults.hybrid.enabled and args.router.carry_sources  # carry_sources follows recompute
    for role in (args.router, args.loader, args.generator):  # the shared fields, copied from the top
        assert role.store == args.store and getattr(role, "model", args.model) == args.model
    assert args.router.reload == args.loader.reload == args.reload
    for bad in ({"router": {"store": "/t"}}, {"generator": {"model": {"path": "tiny-glm"}}},
                {"router": {"carry_sources": True}},
                {"cache_max_nbytes": 1}, {"max_chunks": 4}, {"engine": {}}, {"governance": {}}):  # flat keys: gone
        with pytest.raises(ValidationError):
            AppConfig.model_validate({"store": "/s", **bad})

def test_unreadable_kv_is_503_and_an_error_event_once_streaming(roles, serving_store, tmp_path, monkeypatch):
    def cannot_rebuild(chunk, entry):  # e.g. a scanned page whose image this replica cannot read
        raise UnservableError(f"page image of chunk {chunk.chunk_id} is not readable on this replica")

    monkeypatch.setattr(roles.generator.repairer, "recompile", cannot_rebuild)
    root = tmp_path / "store"
    shutil.copytree(serving_store.uri, root)
    planned = asyncio.run(roles.router.plan(AnswerRequest(query=QUERY, chunk_ids=["recipes#00000"], mode="text_pic")))
    corrupt_entry(root, store_row(planned.chunks[0].entry.row))
    args = AppConfig(store={"uri": str(root)}, model=serving_store.model, router={"max_chunks": MAX_CHUNKS},
                     ingress={"default_top_k": 2})
    loader = loader_of(str(root))
    broken = make_api(InProcessBackend(roles.router, loader, roles.generator), api_spec(args))
    body = {"query": QUERY, "chunk_ids": ["recipes#00000"], "mode": "text_pic"}
    plain = call(broken, "POST", "/v1/answer", json=body)
    assert plain.status_code == 503 and "recipes#00000" in plain.json()["detail"]
    streamed = call(broken, "POST", "/v1/answer", json={**body, "stream": True})
    (event,) = [json.loads(e) for e in sse_events(streamed.text)]
    assert event["type"] == "error" and event["status_code"] == 503 and "checksum" in event["detail"]
    # the corrupt shard's path is the server's: the answers carry a stable code (docs/SECURITY.md)
    assert "[checksum_mismatch]" in plain.json()["detail"] and "[checksum_mismatch]" in event["detail"]
    assert str(root) not in plain.text + streamed.text and ".safetensors" not in plain.text + streamed.text
    chat = call(broken, "POST", "/v1/chat/completions", json={
        "model": "qvpic", "messages": [{"role": "user", "content": QUERY}], "stream": True,
        "qvpic": {"chunk_ids": ["recipes#00000"], "mode": "text_pic"}})
    events = sse_events(chat.text)
    assert json.loads(events[-2])["error"]["code"] == "service_unavailable" and events[-1] == "[DONE]"


def test_cache_stats_are_live(app):
    before = CacheStats(**call(app, "GET", "/v1/store").json()["cache"])
    call(app, "POST", "/v1/answer",
         json={"query": QUERY, "chunk_ids": ["manual#00000"], "mode": "image_pic", "max_new_tokens": 2})
    after = CacheStats(**call(app, "GET", "/v1/store").json()["cache"])
    assert after.hits + after.misses == before.hits + before.misses + 1
    assert after.nbytes <= after.max_nbytes
