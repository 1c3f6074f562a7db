"""The KubeRay manifests (serve/rayservice.yaml, jobs/ingest-rayjob.yaml, jobs/recompile-raycronjob.yaml) against
KubeRay's own CRD schemas (v1.7.0's `openAPIV3Schema`, in tests/data/kuberay/ with their source), and the
RayService's Serve config against serve/config-gpu.yaml: one topology whatever the entry point.

Refresh the schemas: `git show v<X>:ray-operator/config/crd/bases/ray.io_<kind>s.yaml` from ray-project/kuberay,
keep `spec.versions[v1].schema.openAPIV3Schema` (see the `source` field of each file)."""

from __future__ import annotations

import copy
import gzip
import json
import sys

import jsonschema
import pytest
import yaml

from serve.config import AppConfig
from serve.governance.auth import exposure, key_digest
from tests.support.paths import REPO

ROOT = REPO
SCHEMAS = ROOT / "tests" / "data" / "kuberay"
MANIFESTS = {"RayService": ROOT / "serve" / "rayservice.yaml", "RayJob": ROOT / "jobs" / "ingest-rayjob.yaml",
             "RayCronJob": ROOT / "jobs" / "recompile-raycronjob.yaml"}


def crd_schema(kind: str) -> dict:
    with gzip.open(SCHEMAS / f"{kind}-v1.json.gz", "rt") as f:
        record = json.load(f)
    assert record["kind"] == kind and record["kuberay_version"] == "v1.7.0"
    return record["openAPIV3Schema"]


def manifest(kind: str) -> dict:
    (document,) = [d for d in yaml.safe_load_all(MANIFESTS[kind].read_text()) if d and d["kind"] == kind]
    return document


def unknown_fields(value, schema: dict, path: str = "") -> list[str]:
    """Fields the schema does not define: Kubernetes prunes them silently, so a misspelt one would vanish."""
    if isinstance(value, dict) and "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        found = [f"{path}.{k}" for k in value if k not in schema["properties"]]
        return found + [f for k, v in value.items() if k in schema["properties"]
                        for f in unknown_fields(v, schema["properties"][k], f"{path}.{k}")]
    if isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        return [f for k, v in value.items() for f in unknown_fields(v, schema["additionalProperties"], f"{path}.{k}")]
    if isinstance(value, list) and "items" in schema:
        return [f for i, v in enumerate(value) for f in unknown_fields(v, schema["items"], f"{path}[{i}]")]
    return []


@pytest.mark.parametrize("kind", sorted(MANIFESTS))
def test_manifests_validate_against_kuberays_crd_schema(kind):
    document = manifest(kind)
    assert document["apiVersion"] == "ray.io/v1"
    jsonschema.validate(document, crd_schema(kind))
    assert unknown_fields(document, crd_schema(kind)) == []


@pytest.mark.parametrize("kind", sorted(MANIFESTS))
def test_the_schema_check_can_fail(kind):
    """Control: a misspelt field the CRD types (an integer where it wants a string) is refused."""
    document = copy.deepcopy(manifest(kind))
    spec = document["spec"].get("jobTemplate", document["spec"])
    cluster = spec.get("rayClusterSpec") or spec["rayClusterConfig"]
    cluster["workerGroupSpecs"][0]["replicas"] = "four"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(document, crd_schema(kind))
    cluster["workerGroupSpecs"][0]["replicas"] = 4
    cluster["workerGroupSpecs"][0]["replicaz"] = 4  # a misspelling Kubernetes would prune without a word
    assert [f for f in unknown_fields(document, crd_schema(kind)) if f.endswith("replicaz")]


def test_the_rayservice_runs_the_shipped_gpu_topology_with_auth(tmp_path):
    serve_config = yaml.safe_load(manifest("RayService")["spec"]["serveConfigV2"])
    shipped = yaml.safe_load((ROOT / "serve" / "config-gpu.yaml").read_text())
    app, reference = serve_config["applications"][0], shipped["applications"][0]
    assert serve_config["proxy_location"] == shipped["proxy_location"]
    # the documented differences: where the store and the checkpoint are, and the keys from the Secret
    allowed = {"store", "model"}
    assert {k for k in app["args"] if app["args"][k] != reference["args"][k]} - {"ingress"} <= allowed
    ingress, reference_ingress = app["args"]["ingress"], reference["args"]["ingress"]
    assert {k: v for k, v in ingress.items() if k != "governance"} == \
        {k: v for k, v in reference_ingress.items() if k != "governance"}
    assert {k: v for k, v in ingress["governance"].items() if k != "auth"} == reference_ingress["governance"]
    config = AppConfig.model_validate(app["args"])  # what the app would validate at start
    assert config.ingress.governance.auth.api_key_sha256_file is not None
    keys = tmp_path / "api-keys"  # the Secret as mounted: one key, so the open bind is no refusal
    keys.write_text(f"{key_digest('key-acme-1')} acme\n")
    mounted = config.ingress.governance.auth.model_copy(update={"api_key_sha256_file": keys})
    assert exposure(serve_config["http_options"]["host"], mounted) is None
    volumes = {v["name"]: v for v in manifest("RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]
               ["template"]["spec"]["volumes"]}
    assert volumes["api-keys"]["secret"]["secretName"] == "qvpic-api-keys"


def network_policies() -> list[dict]:
    return [d for d in yaml.safe_load_all(MANIFESTS["RayService"].read_text()) if d and d["kind"] == "NetworkPolicy"]


def selects(policy: dict, labels: dict) -> bool:
    wanted = policy["spec"]["podSelector"].get("matchLabels", {})
    return all(labels.get(k) == v for k, v in wanted.items())


def open_ports(labels: dict) -> set[int] | None:
    """Ports of a pod with `labels` that any source may reach (a rule with no `from`); None: no policy selects it,
    so everything is open."""
    chosen = [p for p in network_policies() if selects(p, labels) and "Ingress" in p["spec"]["policyTypes"]]
    if not chosen:
        return None
    return {port["port"] for p in chosen for rule in p["spec"].get("ingress", []) if "from" not in rule
            for port in rule.get("ports", [{"port": "every"}])}


def test_network_policies_cover_head_and_workers_and_scope_the_operator_to_its_namespace():
    """The head opens serve's port alone to anyone; a worker opens nothing to anyone (its dashboard agent and Ray's
    managers are unauthenticated); a peer from another namespace is admitted only from one named namespace."""
    port = yaml.safe_load(manifest("RayService")["spec"]["serveConfigV2"])["http_options"]["port"]
    head = {"ray.io/node-type": "head", "ray.io/is-ray-node": "yes"}  # the labels KubeRay puts on its pods
    worker = {"ray.io/node-type": "worker", "ray.io/is-ray-node": "yes"}
    assert open_ports(head) == {port}
    assert open_ports(worker) == set()
    peers = [peer for p in network_policies() for rule in p["spec"].get("ingress", []) for peer in rule.get("from", [])]
    assert peers and not any("ipBlock" in peer for peer in peers)
    for peer in peers:  # absent: the policy's own namespace; present: one namespace, by its immutable name label
        if "namespaceSelector" in peer:
            assert set(peer["namespaceSelector"].get("matchLabels", {})) == {"kubernetes.io/metadata.name"}, peer
            assert "matchExpressions" not in peer["namespaceSelector"]
    operator = [peer for peer in peers if "kuberay-operator" in peer.get("podSelector", {}).get("matchLabels", {})
                .get("app.kubernetes.io/name", "")]
    assert operator and all("namespaceSelector" in peer for peer in operator)  # it runs in a namespace of its own


def test_the_network_policy_check_can_fail(monkeypatch):
    """Control: the policy as it was (any namespace's pod labelled kuberay-operator; workers unselected) fails."""
    documents = network_policies()
    loose = copy.deepcopy(documents[0])
    loose["spec"]["ingress"][1]["from"][0]["namespaceSelector"] = {}
    monkeypatch.setattr(sys.modules[__name__], "network_policies", lambda: [loose])
    assert open_ports({"ray.io/node-type": "worker", "ray.io/is-ray-node": "yes"}) is None  # nothing guards a worker
    with pytest.raises(AssertionError):
        test_network_policies_cover_head_and_workers_and_scope_the_operator_to_its_namespace()


def test_every_ray_container_of_the_rayservice_starts_its_workers_at_niceness_0():
    """Ray's workers start at niceness 15 by default; the roles' client-sized work runs BULK_NICE (10) steps lower,
    which from 15 stops at 19 (pipeline/priority.py). The head's and every worker group's containers say 0."""
    cluster = manifest("RayService")["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]] + [group["template"] for group in cluster["workerGroupSpecs"]]
    containers = [c for pod in pods for c in pod["spec"]["containers"]]
    assert len(containers) == 1 + len(cluster["workerGroupSpecs"])
    for container in containers:
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert env.get("RAY_worker_niceness") == "0", container["name"]
