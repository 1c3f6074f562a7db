"""cluster.yaml passes Ray's own autoscaler schema and config checks (no cloud needed)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from tests.support.paths import REPO

CLUSTER_YAML = REPO / "cluster.yaml"


@pytest.fixture(scope="module")
def cluster_config() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def test_cluster_yaml_matches_ray_schema(cluster_config):
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(cluster_config, schema)


def test_cluster_yaml_passes_autoscaler_validation(cluster_config):
    validate_config(prepare_config(copy.deepcopy(cluster_config)))


def test_gpu_group_autoscales_and_installs_qvpic(cluster_config):
    nodes = cluster_config["available_node_types"]
    gpu_groups = [n for n in nodes.values() if n["resources"].get("GPU", 0) >= 1]
    assert gpu_groups and all(g["max_workers"] > g["min_workers"] for g in gpu_groups)
    assert nodes[cluster_config["head_node_type"]]["resources"].get("GPU", 0) == 0
    commands = cluster_config["setup_commands"]
    assert any("qvpic" in c and "--no-deps" in c for c in commands)  # nothing resolved from the ranges
    assert any("--require-hashes -r" in c and "requirements-gpu.lock" in c for c in commands)  # torch's CUDA build


def test_broken_config_is_rejected(cluster_config):
    broken = copy.deepcopy(cluster_config)
    broken["available_node_types"]["gpu_worker"]["max_workers"] = "many"
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(broken))


def test_every_node_starts_its_workers_at_niceness_0(cluster_config):
    """As serve/rayservice.yaml: not Ray's default 15, from which the roles' BULK_NICE step stops at 19."""
    starts = [c for key in ("head_start_ray_commands", "worker_start_ray_commands") for c in cluster_config[key]
              if "ray start" in c]
    assert len(starts) == 2 and all(c.startswith("RAY_worker_niceness=0 ray start") for c in starts), starts
