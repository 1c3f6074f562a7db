"""What a running Serve application's replicas are doing, read from outside them: the tests that kill a generator
replica under load (tests/cluster/test_cluster.py on qvpic's engine across nodes, tests/serve/engine/vllm/
test_vllm_faults.py on both engines in one Ray) use these to pick the replica to lose and to count the retries."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable

import httpx


@dataclasses.dataclass(frozen=True)
class Replica:
    name: str
    namespace: str
    node_id: str
    pid: int  # the replica's actor process: SIGKILL of it is the replica's (its node's) loss

    def ongoing_requests(self) -> int:
        """Requests in flight in this replica, as it counts them (Serve's `ReplicaActor.get_num_ongoing_requests`,
        Ray-internal: checked on 2.60; Serve turns Ray's task events off on its actors, so
        `ray.util.state.list_tasks` lists none)."""
        import ray

        return ray.get(ray.get_actor(self.name, namespace=self.namespace).get_num_ongoing_requests.remote(),
                       timeout=30)


def live_replicas(app: str, deployment: str) -> list[Replica]:
    """The live replica actors of `app`'s `deployment`, from the GCS's actor table (`ray.util.state` would ask the
    dashboard, which the suite's local Ray does not start)."""
    import ray
    from ray._private.state import actors

    namespaces = {a["name"]: a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)}
    return [Replica(actor["Name"], namespaces[actor["Name"]], actor["Address"]["NodeID"], actor["Pid"])
            for actor in actors().values()
            if actor["State"] == "ALIVE" and actor["ActorClassName"] == f"ServeReplica:{app}:{deployment}"
            and actor["Name"] in namespaces]


def replicas_running(app: str, deployment: str) -> int:
    """`deployment`'s RUNNING replicas, as the Serve controller counts them."""
    from ray import serve

    return serve.status().applications[app].deployments[deployment].replica_states.get("RUNNING", 0)


def replica_retries(url: str) -> Counter[str]:
    """`qvpic_replica_retries_total` by call, from the ingress's `GET /metrics`."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return Counter({sample.labels["call"]: sample.value for family in text_string_to_metric_families(text)
                    for sample in family.samples if sample.name == "qvpic_replica_retries_total"})


def wait_for(condition: Callable[[], bool], timeout_s: float, poll_s: float = 0.5) -> bool:
    """Whether `condition()` held within `timeout_s` (a bound on a wait, not a measurement)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True
