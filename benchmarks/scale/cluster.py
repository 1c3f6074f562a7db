"""Node loss under load and generator autoscaling on a real 3-node Ray cluster (tests/support/cluster_fixtures.py).

    python -m benchmarks.scale.cluster                   # tiny-qwen, the test corpus; ≈6 min on 2 cores

One cluster (a GPU-less head, two workers declaring one GPU each, the store on S3) and one store for
every scenario; Serve's HTTP proxy on the head only. Clients send distinct non-streaming `/v1/answer`
requests in a loop (no response cache, no limits), each with a deadline; a client error is a reset
connection, a client timeout past the deadline a hang.
  - **node loss**: two generators, one per GPU node; `LOSS_AT_S` into the load one worker node is killed
    (`Cluster.remove_node`, no drain). Per loader topology — `head` (`loader_placement: deployment`:
    ingress, router and two loaders on the head), `any` (the config before issue 22: one loader wherever
    Ray put it) and `in generator` (`loader_placement: in_generator`: a loader in each generator replica,
    ingress and router on the head) — the worker killed is the one holding a generator ("generator node")
    and, where the loader is on a worker, the one holding it ("loader node"). Then the node is replaced for
    the next run.
  - **autoscaling**: the generator with `autoscaling_config` min 1, max 2, Serve's delays shortened
    (`GENERATOR_AUTOSCALING` of tests/support/cluster_fixtures.py, as tests/cluster/test_cluster.py runs it: upscale
    after 2 s, downscale after 15 s, 12 s look-back); one client for `CALM_S`, then `BUSY_CLIENTS` until the
    second replica runs and `BUSY_AFTER_S` more, then none. The time to the second replica is split in
    two: to Serve's decision (the deployment turns UPSCALING) and from it to the replica RUNNING
    (scheduling, its worker process, the model and the store opened).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import yaml

from pipeline.eval import markdown_table, write_section
from tests.support.cluster_fixtures import (
    GENERATOR_AUTOSCALING,
    LOOPBACK,
    REPO,
    Load,
    Outcome,
    RayCluster,
    start_cluster,
)
from tests.support.fixtures_s3 import running_s3
from tests.support.ray_fixtures import free_port
from tests.support.store_factory import DOCUMENTS

QUERY = "When does part XK-4471-B ship?"
DEADLINE_S = 60.0
LOSS_AT_S, LOSS_RUN_S = 8.0, 30.0
CALM_S, BUSY_CLIENTS, BUSY_AFTER_S, IDLE_WAIT_S, UPSCALE_WAIT_S = 10.0, 6, 15.0, 120.0, 300.0


def app_args(cluster: RayCluster, bucket: str, loader: str, generator: dict) -> dict:
    args = yaml.safe_load((REPO / "serve" / "config-gpu.yaml").read_text())["applications"][0]["args"]
    args["store"] = {"uri": cluster.store_uri(bucket), "endpoint_url": cluster.s3.endpoint_url}
    args["model"]["dtype"] = "float32"  # the store's (tiny-qwen's default); the shipped bfloat16 is a GPU's
    args["generator"]["engine"]["kind"] = "qvpic"  # the shipped vLLM engine is not in this venv
    args["ingress"].pop("governance")  # no limits, no response cache: every request is served
    args["loader_placement"] = "in_generator" if loader == "in generator" else "deployment"
    if loader == "head":
        args["loader_deployment"] = {"num_cpus": 0.25, "num_replicas": 2, "placement": "head"}
    if loader == "any":  # the shipped config before issue 22: one loader wherever Ray puts it
        args["loader_deployment"] = {"num_cpus": 0.25, "num_replicas": 1}
    args["generator_deployment"] = {**{k: v for k, v in args["generator_deployment"].items()
                                       if k != "autoscaling_config"}, **generator}
    return args


def deploy(args: dict) -> None:
    from ray import serve

    from serve.app import build_app

    serve.run(build_app(args), name="qvpic", route_prefix="/")


def deployment_status(deployment: str) -> tuple[str, int]:
    """(`deployment`'s status, its RUNNING replicas)."""
    from ray import serve

    overview = serve.status().applications["qvpic"].deployments[deployment]
    return str(overview.status.value), overview.replica_states.get("RUNNING", 0)


def replicas_running(deployment: str) -> int:
    return deployment_status(deployment)[1]


def node_of(deployment: str) -> set[str]:
    from ray.util.state import list_actors

    return {a.node_id for a in list_actors(filters=[("state", "=", "ALIVE")], limit=10_000)
            if a.class_name == f"ServeReplica:qvpic:{deployment}"}


def loss_row(loader: str, kind: str, outcomes: list[Outcome], lost_at_s: float) -> list:
    results = Counter(o.result for o in outcomes)
    failed_after = [o for o in outcomes if o.result != 200 and o.ended_s >= lost_at_s]
    recovery_s = max((o.started_s for o in failed_after), default=lost_at_s) - lost_at_s
    other_5xx = sum(n for r, n in results.items() if isinstance(r, int) and r >= 500 and r != 503)
    resets = sum(n for r, n in results.items() if isinstance(r, str) and r != "ReadTimeout")
    return [loader, kind, len(outcomes), results[200], results[503], other_5xx, resets, results["ReadTimeout"],
            round(recovery_s, 1)]


def victim(cluster: RayCluster, kind: str):
    """The worker node to kill: one holding a generator (not the loader, where one does not), or the one
    holding the loader; None when no worker holds one."""
    head = {n for n, k in cluster.node_kinds().items() if k == "head"}
    loaders = node_of("CacheLoader") - head
    wanted = (node_of("Generator") - loaders or node_of("Generator")) if kind == "generator node" else loaders
    return next((node for node in cluster.workers if node.node_id in wanted), None)


def wait_generators(count: int, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while replicas_running("Generator") < count and time.monotonic() < deadline:
        time.sleep(0.5)


def node_loss(cluster: RayCluster, url: str, bucket: str) -> list[list]:
    from ray import serve

    rows: list[list] = []
    for loader in ("head", "any", "in generator"):
        for kind in ("generator node", "loader node"):
            deploy(app_args(cluster, bucket, loader, {"num_replicas": 2}))
            wait_generators(2)  # whole again after the last run's loss
            node = victim(cluster, kind)
            if node is None:
                rows.append([loader, kind, "no worker holds one", *[None] * 6])
                continue
            load = Load(url, QUERY, max_new_tokens=8, deadline_s=DEADLINE_S)
            load.add_clients(4)
            time.sleep(LOSS_AT_S)
            lost_at = time.monotonic() - load.t0
            cluster.remove_worker(node)
            time.sleep(LOSS_RUN_S - LOSS_AT_S)
            rows.append(loss_row(loader, kind, load.finish(), lost_at))
            cluster.add_gpu_worker(f"gpu-{len(rows) + 2}")
        serve.delete("qvpic")
    return rows


def autoscaling(cluster: RayCluster, url: str, bucket: str) -> list[list]:
    deploy(app_args(cluster, bucket, "head", {"num_replicas": None, "autoscaling_config": GENERATOR_AUTOSCALING}))
    load = Load(url, QUERY, max_new_tokens=8, deadline_s=DEADLINE_S)

    def watch(for_s: float, until: Callable[[str, int], bool] = lambda status, running: False) -> float | None:
        """Samples the Generator's status every 0.25 s for `for_s`; the time `until` first held, else None."""
        deadline = time.monotonic() + for_s
        while time.monotonic() < deadline:
            if until(*deployment_status("Generator")):
                return time.monotonic() - load.t0
            time.sleep(0.25)
        return None

    load.add_clients(1)
    watch(CALM_S)
    ramp_at = time.monotonic() - load.t0
    load.add_clients(BUSY_CLIENTS - 1)
    # The time to the second replica in two steps: Serve's decision (the deployment turns UPSCALING) and the
    # new replica's start (scheduled on the free GPU node, its worker process, the model and store opened).
    decided_at = watch(UPSCALE_WAIT_S, lambda status, running: status == "UPSCALING" or running >= 2)
    second_at = None if decided_at is None else watch(ramp_at + UPSCALE_WAIT_S - decided_at,
                                                      lambda status, running: running >= 2)
    if second_at is None:
        load.finish()
        raise RuntimeError(f"the generator did not reach 2 replicas within {UPSCALE_WAIT_S:g} s of the ramp "
                           f"(Serve decided to scale up: {decided_at is not None})")
    dropped_at = watch(BUSY_AFTER_S, lambda status, running: running < 2)  # Serve judged one replica enough
    watch(max(0.0, second_at + BUSY_AFTER_S - (time.monotonic() - load.t0)))  # the rest of the busy window
    outcomes = load.finish()
    idle_at = time.monotonic() - load.t0
    if dropped_at is not None:
        down = f"under load, {dropped_at - second_at:.1f} s after the 2nd"
    else:
        down_at = watch(IDLE_WAIT_S, lambda status, running: running <= 1)
        down = f"{down_at - idle_at:.1f}" if down_at is not None else f"not within {IDLE_WAIT_S:g}"

    def latency_ms(lo: float, hi: float) -> float | None:
        picked = [1e3 * (o.ended_s - o.started_s) for o in outcomes if lo <= o.started_s < hi and o.result == 200]
        return statistics.median(picked) if picked else None

    meanwhile = Counter(o.result for o in outcomes if ramp_at <= o.started_s < second_at)
    return [[round(decided_at - ramp_at, 1), round(second_at - decided_at, 1), sum(meanwhile.values()),
             meanwhile[200], latency_ms(0, ramp_at), latency_ms(ramp_at, second_at),
             latency_ms(second_at, idle_at), down]]


def corpus(root: Path) -> str:
    import json

    lines = [json.dumps({"doc_id": doc_id, "text": "\n\n".join(texts)}) for doc_id, texts in DOCUMENTS.items()]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return str(root)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    from ray import serve

    from pipeline.ingest import IngestConfig, ingest
    from pipeline.ingest.resources import CompileResources
    from schemas.config import ModelSpec
    from schemas.store import StoreSpec

    with running_s3() as s3, tempfile.TemporaryDirectory() as scratch:
        cluster = start_cluster(s3, Path(scratch))
        try:
            bucket = s3.new_bucket()
            ingest(IngestConfig(corpus=corpus(Path(scratch)), chunk_tokens=50, model=ModelSpec(path="tiny-qwen"),
                                store=StoreSpec(uri=cluster.store_uri(bucket), endpoint_url=s3.endpoint_url),
                                resources=CompileResources(workers=2, gpus_per_worker=1)))
            port = free_port()
            serve.start(proxy_location="HeadOnly", http_options={"host": LOOPBACK, "port": port},
                        logging_config={"log_level": "WARNING", "enable_access_log": False})
            url = f"http://{LOOPBACK}:{port}"
            losses = node_loss(cluster, url, bucket)
            scaling = autoscaling(cluster, url, bucket)
        finally:
            serve.shutdown()
            import ray

            ray.shutdown()
            cluster.cluster.shutdown()
    body = (
        "Node loss, 4 clients, one worker node killed "
        f"{LOSS_AT_S:g} s into a {LOSS_RUN_S:g} s run (recovery: from the loss to the start of the last request "
        "that was not answered 200):\n\n"
        + markdown_table(["loader on", "node lost", "sent", "answered", "503", "other 5xx", "resets", "hangs",
                          "recovery s"], losses)
        + "\n\nGenerator autoscaling (min 1, max 2; Serve's delays shortened for the run: "
        f"{GENERATOR_AUTOSCALING}), one client for {CALM_S:g} s, then {BUSY_CLIENTS}:\n\n"
        + markdown_table(["s to Serve's decision", "s to start the replica", "sent meanwhile",
                          "answered meanwhile", "p50 ms calm", "p50 ms ramp", "p50 ms 2 replicas",
                          "scale-down: s after idle"], scaling)
        + "\n\nAll nodes share this machine's 2 cores: the counts are the figures, the timings are ratios."
    )
    print(body)
    write_section("cluster", "The cluster: node loss and autoscaling (issue 22)", "python -m benchmarks.scale.cluster",
                  body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
