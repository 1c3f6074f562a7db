"""qvpic on a real 3-node Ray cluster (tests/cluster_fixtures.py): ingest submitted to the job server spreads
its compile actors over both GPU nodes and builds the store a one-node run builds; `qvpic serve --address`
puts a generator on each GPU node and the rest on the head; a recompile lands while the app serves; and a
lost generator node costs no request that had not streamed yet."""

from __future__ import annotations

import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from pipeline.store import Store
from schemas.store import StoreSpec
from tests.cluster_fixtures import LOOPBACK, REPO, RayCluster, ray_cluster, s3_server  # noqa: F401  (fixtures)
from tests.ray_fixtures import free_port
from tests.store_factory import DOCUMENTS

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]
QUERY = "When does part XK-4471-B ship?"
EXPECTED_CHUNK = "invoices#00000"  # the paragraph that answers QUERY
# Rows that must not depend on where or how batched an entry compiled; created_at, shard paths and
# checksums do (a batch's padding moves the KV within float tolerance).
ROW_COLUMNS = ("chunk_key", "tier", "variant", "fingerprint", "kind", "num_tokens", "position_span", "compile_start",
               "grid_thw", "image_sizes_px", "vision_tokens", "dtype", "shape")
KV_ATOL = 1e-4  # float32 tiny-qwen: one chunk alone vs in a padded batch of others (tests/test_batched_compile.py)
# The template variant only (what the default mode serves): a third of the compile work of every variant.
INGEST_ARGS = ("--model", "tiny-qwen", "--chunk-tokens", "50", "--variants", "template", "--compile-batch-size", "1",
               "--json")


def summary_of(stdout: str) -> dict:
    """The job's `--json` summary: the last JSON object in its output (Ray's job lines surround it)."""
    start = stdout.rindex("\n{") + 1 if "\n{" in stdout else stdout.index("{")
    return json.JSONDecoder().raw_decode(stdout[start:])[0]


Entries = tuple[list[dict], list[torch.Tensor]]


def entries(store: Store) -> Entries:
    """Every index row's ROW_COLUMNS and its KV, in a placement-free order."""
    rows = store.index().sort_by([(c, "ascending") for c in ("chunk_key", "variant", "tier")])
    return rows.select(list(ROW_COLUMNS)).to_pylist(), store.load_many(rows.to_pylist())


def differing(a: Entries, b: Entries) -> list[int]:
    """Positions whose ROW_COLUMNS differ or whose KV differs by more than KV_ATOL (all of them when the
    two hold different numbers of entries)."""
    (rows_a, kv_a), (rows_b, kv_b) = a, b
    if len(rows_a) != len(rows_b):
        return list(range(max(len(rows_a), len(rows_b))))
    return [i for i, (ra, rb, ka, kb) in enumerate(zip(rows_a, rows_b, kv_a, kv_b))
            if ra != rb or ka.shape != kb.shape or not torch.allclose(ka.float(), kb.float(), atol=KV_ATOL, rtol=0)]


# Distinct one-paragraph documents beside the suite's five chunks, none about QUERY: enough blocks of work
# that both compile actors get some (Ray Data hands a block to whichever actor is free, so five chunks can
# all go to the first one ready).
FILLER = {f"note-{k}": [f"Note {k}: the {colour} bin in hall {k} is emptied every {day} morning."]
          for k, (colour, day) in enumerate(zip(("red", "blue", "green", "grey", "white", "black") * 2,
                                                ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday",
                                                 "Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday")))}
NUM_CHUNKS = 5 + len(FILLER)  # one chunk per paragraph at 50 tokens: DOCUMENTS has five, each filler note one


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("corpus")
    lines = [json.dumps({"doc_id": doc_id, "text": "\n\n".join(texts)})
             for doc_id, texts in {**DOCUMENTS, **FILLER}.items()]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return str(root)


@pytest.fixture(scope="module")
def bucket(ray_cluster: RayCluster) -> str:
    return ray_cluster.s3.new_bucket()


@pytest.fixture(scope="module")
def ingested(ray_cluster: RayCluster, corpus: str, bucket: str) -> dict:
    """The corpus ingested by a job submitted to the cluster, two compile actors of one GPU each."""
    done = ray_cluster.submit("jobs.ingest", "--corpus", corpus, "--store", ray_cluster.store_uri(bucket),
                              "--s3-endpoint", ray_cluster.s3.endpoint_url, "--compile-workers", "2",
                              "--gpus-per-worker", "1", *INGEST_ARGS)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return summary_of(done.stdout)


def store_on(cluster: RayCluster, bucket: str, prefix: str = "store") -> Store:
    return Store.open(StoreSpec(uri=cluster.store_uri(bucket, prefix), endpoint_url=cluster.s3.endpoint_url))


def test_ingest_job_compiles_on_both_gpu_nodes_only(ray_cluster, ingested):
    kinds = ray_cluster.node_kinds()
    assert ingested["balanced"] and ingested["num_chunks"] == NUM_CHUNKS and not ingested["quarantined"]
    per_node = ingested["per_node"]
    assert {kinds[node] for node in per_node} == {"gpu"} and len(per_node) == 2, (per_node, kinds)
    assert all(n["entries"] > 0 for n in per_node.values())
    assert sum(n["entries"] for n in per_node.values()) == sum(g["entries"] for g in ingested["groups"].values())


def test_ingest_across_nodes_builds_what_one_node_builds(ray_cluster, bucket, ingested, tmp_path):
    """The reference: the spread store's chunk texts compiled under its own manifest in this process (one
    node, no Ray; the pipeline's render and compile stages, one chunk per forward) into a local store."""
    from pipeline.ingest.stages import compile_in_process
    from pipeline.runtime import VLM
    from schemas.config import ModelSpec

    spread_store = store_on(ray_cluster, bucket)
    manifest = spread_store.load_manifest_or_raise()
    one_node = Store.open(StoreSpec(uri=str(tmp_path / "one-node")), create=True)
    one_node.write_manifest(manifest)
    chunks = spread_store.chunks().select(["chunk_key", "text", "image_path"]).to_pylist()
    vlm = VLM(ModelSpec(path="tiny-qwen", device="cpu"))
    assert compile_in_process(one_node, manifest, vlm, [tuple(c.values()) for c in chunks], batch_size=1) == {}
    spread, single = entries(spread_store), entries(one_node)
    assert len(spread[0]) == sum(g["entries"] for g in ingested["groups"].values())
    assert differing(spread, single) == []
    # Negative controls: one token count off, or one KV value moved by 10× the tolerance, is seen.
    rows, kv = single
    assert differing(spread, ([{**rows[0], "num_tokens": rows[0]["num_tokens"] + 1}, *rows[1:]], kv)) == [0]
    moved = kv[-1].float().clone()
    moved.view(-1)[0] += 10 * KV_ATOL
    assert differing(spread, (rows, [*kv[:-1], moved])) == [len(kv) - 1]


# ---- serving across the nodes ---------------------------------------------------------------------------
GPU_CONFIG = REPO / "serve" / "config-gpu.yaml"


def app_config(cluster: RayCluster, bucket: str):
    """serve/config-gpu.yaml's app args over this cluster's store, as `qvpic serve --config … --store …` reads them."""
    import yaml

    from serve.config import AppConfig

    args = yaml.safe_load(GPU_CONFIG.read_text())["applications"][0]["args"]
    args["store"] = {"uri": cluster.store_uri(bucket), "endpoint_url": cluster.s3.endpoint_url}
    return AppConfig.model_validate(args)


@pytest.fixture(scope="module")
def served(ray_cluster: RayCluster, ingested: dict, bucket: str) -> str:
    port = free_port()
    done = ray_cluster.qvpic("serve", "--address", ray_cluster.address, "--detach", "--config", str(GPU_CONFIG),
                             "--store", ray_cluster.store_uri(bucket), "--endpoint-url", ray_cluster.s3.endpoint_url,
                             "--generator-replicas", "2", "--host", LOOPBACK, "--port", str(port))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return f"http://{LOOPBACK}:{port}"


def ask(url: str, query: str = QUERY, timeout_s: float = 60, **fields) -> httpx.Response:
    body = {"query": query, "max_new_tokens": 8, "top_k": 2, "timeout_s": timeout_s, **fields}
    return httpx.post(f"{url}/v1/answer", json=body, timeout=timeout_s + 15)  # the client outwaits the deadline


def replica_nodes() -> dict[str, list[str]]:
    """Deployment name → the Ray node id of each live replica."""
    from ray.util.state import list_actors

    nodes: dict[str, list[str]] = {}
    for actor in list_actors(filters=[("state", "=", "ALIVE")], limit=10_000):
        if actor.class_name.startswith("ServeReplica:qvpic:"):
            nodes.setdefault(actor.class_name.rsplit(":", 1)[-1], []).append(actor.node_id)
    return nodes


def reference_answer(cluster: RayCluster, bucket: str, query: str) -> str:
    """The same request answered by the three roles in this process (no Ray) over the same store."""
    import asyncio

    from schemas.api import AnswerRequest
    from schemas.sampling import Sampling
    from serve.engine import Generator
    from serve.http import InProcessBackend
    from serve.kv import CacheLoader
    from serve.routing import Router

    app = app_config(cluster, bucket)
    request = AnswerRequest(query=query, max_new_tokens=8, top_k=2)

    router, loader = Router(app.router), CacheLoader(app.loader)

    async def answer() -> str:
        backend = InProcessBackend(router, loader, Generator(app.generator))
        plan = await backend.route(request, app.ingress.governance.limits.default.token_budget, frozenset({"public"}))
        return (await backend.generate(plan, Sampling.of(request))).text

    try:
        return asyncio.run(answer())
    finally:  # their pollers and lease heartbeats would outlive the test, reading S3 until the session ends
        router.close()
        loader.close()


def test_serve_puts_a_generator_on_each_gpu_node_and_the_rest_on_the_head(ray_cluster, served, bucket):
    kinds, nodes = ray_cluster.node_kinds(), replica_nodes()
    assert sorted(kinds[n] for n in nodes["Generator"]) == ["gpu", "gpu"] and len(set(nodes["Generator"])) == 2
    for role in ("Ingress", "Router"):
        assert {kinds[n] for n in nodes[role]} == {"head"}, (role, nodes[role], kinds)
    assert "CacheLoader" not in nodes  # loader_placement in_generator: each generator has its own
    ready = httpx.get(f"{served}/readyz", timeout=10)
    assert ready.status_code == 200, ready.text
    response = ask(served)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["chunks"][0]["chunk_id"] == EXPECTED_CHUNK
    assert body["answer"] == reference_answer(ray_cluster, bucket, QUERY)


def test_recompile_while_serving_switches_every_replica(ray_cluster, served, bucket):
    """The app holds CPUs on every node and both GPUs: the job sizes its CPU stages to what is free
    (pipeline/ingest/resources.py) and compiles on the CPU (`--gpus-per-worker 0`), so it never waits on them."""
    from pipeline.store import current_generation_number
    from pipeline.store.leases import read_leases

    store = store_on(ray_cluster, bucket)
    before = current_generation_number(store)
    done = ray_cluster.submit("jobs.recompile", "--store", ray_cluster.store_uri(bucket), "--s3-endpoint",
                              ray_cluster.s3.endpoint_url, "--gpus-per-worker", "0", "--json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    after = current_generation_number(store)
    assert after is not None and before is not None and after > before
    deadline, serving = time.monotonic() + 60, {}
    # Routers poll `current.json` every reload.poll_s (2 s) and name the generation in each plan; loaders and
    # generators serve the plan's (a loader's lease names what it last read, so it is no switch signal).
    while time.monotonic() < deadline:
        serving = {lease.holder: max(lease.generations, default=0) for lease in read_leases(store)
                   if lease.holder.startswith("router-")}
        answered = ask(served, f"{QUERY} after recompile").json().get("generation")
        if answered == after and serving and set(serving.values()) == {after}:
            break
        time.sleep(1)
    assert set(serving.values()) == {after} and answered == after, (serving, answered, after)
    assert len(serving) >= len(replica_nodes()["Router"])  # every router replica holds a lease (a restarted
    # replica's old lease may linger until it expires; the set check above says none names an old generation)


def test_losing_a_generator_node_loses_no_request_that_had_not_streamed(ray_cluster, served, bucket):
    """In-flight requests when a GPU node dies: those that had streamed nothing are retried on the other
    generator (serve/http/backend.py), a stream already under way ends with an error event, none hangs."""

    def plain(i: int) -> int | str:
        try:
            return ask(served, f"{QUERY} ({i})", max_new_tokens=24).status_code
        except httpx.HTTPError as error:  # a reset connection or a hang past the deadline
            return type(error).__name__

    def stream() -> str:
        body = {"query": f"{QUERY} (stream)", "max_new_tokens": 48, "top_k": 2, "timeout_s": 60, "stream": True}
        last = ""
        with httpx.stream("POST", f"{served}/v1/answer", json=body, timeout=75) as response:
            for line in response.iter_lines():
                last = line or last
        return json.loads(last.removeprefix("data: "))["type"]

    with ThreadPoolExecutor(9) as pool:
        plains = [pool.submit(plain, i) for i in range(8)]
        streamed = pool.submit(stream)
        time.sleep(1.5)  # the requests are in the generators' batches
        ray_cluster.remove_worker(ray_cluster.workers[0])
        statuses = Counter(f.result() for f in plains)
        last_event = streamed.result()
    assert statuses == Counter({200: 8}), statuses
    assert last_event in ("done", "error")
    assert ask(served, f"{QUERY} after the loss").status_code == 200
    verify = ray_cluster.qvpic("verify", "--store", ray_cluster.store_uri(bucket), "--s3-endpoint",
                               ray_cluster.s3.endpoint_url)
    assert verify.returncode == 0, verify.stdout[-3000:]
