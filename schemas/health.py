"""Wire contract of `GET /readyz`: whether every deployment of the application can take requests.

`GET /healthz` is liveness (the ingress answers at all, schemas/service.py `Health`); readiness says
whether a request would be served now, and when not, which deployment it would wait for and why.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class DeploymentReadiness(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    status: str  # Serve's DeploymentStatus: HEALTHY, UPDATING, UPSCALING, DOWNSCALING, UNHEALTHY, DEPLOY_FAILED
    ready: bool  # a running replica takes requests (or none is wanted)
    running_replicas: int
    target_replicas: int
    replica_states: dict[str, int]  # Serve's ReplicaState -> count, e.g. {"STARTING": 1}
    required_resources: dict[str, float]  # what one replica asks of a node, e.g. {"CPU": 1, "GPU": 1}
    reason: str | None = None  # why it is not ready: what it waits for, in words
    unplaceable: bool = False  # no alive node has what one replica asks for: it waits for a node to join


class Readiness(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ready: bool
    application: str
    status: str  # Serve's ApplicationStatus: DEPLOYING, RUNNING, UNHEALTHY, DEPLOY_FAILED, ...
    pending: list[str] = Field(default_factory=list)  # names of the deployments that are not ready
    deployments: list[DeploymentReadiness] = Field(default_factory=list)
    detail: str | None = None  # one line: what each pending deployment waits for, or why readiness is unknown
