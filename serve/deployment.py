"""Where and how many: one Serve deployment's replicas and resources (`DeploymentConfig`), as serve/config.py's
`AppConfig` holds one per role and serve/app.py passes `options()` to Serve."""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import Field, model_validator

from schemas.config import Frozen


class Placement(str, Enum):
    """Where a deployment's replicas may run. HEAD: on the Ray head node only, which a cluster cannot lose
    without losing everything (its GCS, the Serve controller, the head-only HTTP proxy): a deployment there
    is no further single point of failure when a worker node dies."""

    ANY = "any"
    HEAD = "head"


HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray gives the head node one unit of it (ray._common.constants)


class DeploymentConfig(Frozen):
    """Replicas and resources of one deployment. CPU deployments take a fraction of a CPU so the whole
    graph fits a 2-core box (Serve's default of 1 CPU per replica would not)."""

    num_replicas: int | None = Field(1, ge=1)
    autoscaling_config: dict[str, Any] | None = None  # Serve AutoscalingConfig fields
    num_cpus: float = Field(0.1, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    max_ongoing_requests: int = Field(16, ge=1)
    # Serve's queue per caller in front of the replicas: bounded, so a flood is answered 503 + Retry-After
    # (BackPressureError) instead of queueing without end (Serve's default, -1, is unbounded)
    max_queued_requests: int = Field(512, ge=1)
    placement: Placement = Placement.ANY
    max_replicas_per_node: int | None = Field(None, ge=1)  # 1: replicas on different nodes (None: no limit)

    @model_validator(mode="after")
    def _replicas_or_autoscaling(self) -> DeploymentConfig:
        if self.autoscaling_config is not None and self.num_replicas not in (None, 1):
            raise ValueError("set either num_replicas or autoscaling_config, not both")
        return self

    def options(self) -> dict[str, Any]:
        scale = ({"autoscaling_config": self.autoscaling_config} if self.autoscaling_config is not None
                 else {"num_replicas": self.num_replicas or 1})
        actor: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.placement is Placement.HEAD:  # a sliver of the head's one unit: any number of replicas fit
            actor["resources"] = {HEAD_NODE_RESOURCE: 0.001}
        spread = {} if self.max_replicas_per_node is None else {"max_replicas_per_node": self.max_replicas_per_node}
        return {**scale, **spread, "max_ongoing_requests": self.max_ongoing_requests,
                "max_queued_requests": self.max_queued_requests, "ray_actor_options": actor}
