"""Readiness of the Serve application, and requests that fail fast while it is not ready.

A Serve handle queues a request until its deployment has a running replica: on a cluster that cannot
place one (a generator asking for a GPU that no node has), forever. So the ingress asks the Serve
controller (at most once per `refresh_s`) which deployments have a running replica. While one has
none, `GET /readyz` answers 503 naming it and what it waits for, and every request whose route uses it answers
503 at once, with `Retry-After` (the inspector's routes use only the Inspector, every other route all the rest:
an answer never waits for the inspector page, nor the page for a generator). `GET /healthz` stays liveness: 200 whenever
the ingress itself answers.

What a pending deployment waits for, in words: a node with what one replica asks for (none alive has
it; an autoscaler may add one), resources that other work holds, or its replicas to finish starting
(loading a model). Serve's own message about it, when it has one, is appended.

That detail (deployment names, node resources, Serve's messages, which may quote a host path or an exception)
is for an operator: with API keys configured, `GET /readyz` without a valid key answers only ready or not (the
status code and `ready`/`status`: all a probe reads), and the gate's 503 says only "not ready" (it answers before
the key check, so an unauthenticated request must not read the reasons there either).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from schemas.health import DeploymentReadiness, Readiness
from serve.governance.auth import Authenticator
from serve.http.guards import error_response

# Routes the ingress answers alone: they never wait for another deployment, so they are not gated.
INGRESS_ONLY_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect",
                                "/redoc", "/v1/models"})
RETRY_AFTER_S = 5
UNKNOWN = "UNKNOWN"  # application status when the controller could not be asked
MAX_SERVE_MESSAGE_CHARS = 300
KEY_FOR_DETAIL = "send an API key for the detail"


def resources(demand: Mapping[str, float], have: Mapping[str, float]) -> str:
    """`CPU 1, GPU 0`: what `have` holds of each resource `demand` names."""
    return ", ".join(f"{name} {have.get(name, 0):g}" for name in sorted(demand)) or "nothing"


def fits(demand: Mapping[str, float], node: Mapping[str, float]) -> bool:
    return all(node.get(name, 0.0) >= amount for name, amount in demand.items())


def waiting_for(demand: Mapping[str, float], nodes: list[Mapping[str, float]], free: Mapping[str, float],
                replica_states: Mapping[str, int]) -> tuple[str, bool]:
    """What a deployment with no running replica waits for, and whether no alive node could ever host one."""
    if not any(fits(demand, node) for node in nodes):
        total = {name: sum(node.get(name, 0.0) for node in nodes) for name in demand}
        return (f"one replica needs {resources(demand, demand)} on one node and no node has that (the cluster has "
                f"{resources(demand, total)}); it waits until such a node joins (an autoscaler may add one)"), True
    if not fits(demand, free):
        needs, available = resources(demand, demand), resources(demand, free)
        return f"one replica needs {needs}; other work holds it (free: {available})", False
    states = ", ".join(f"{count} {state.lower()}" for state, count in sorted(replica_states.items())) or "none yet"
    return f"replicas starting ({states})", False


def deployment_readiness(details, nodes: list[Mapping[str, float]], free: Mapping[str, float]) -> DeploymentReadiness:
    """`details`: Serve's `DeploymentDetails`; `nodes`: total resources of each alive node; `free`: the cluster's."""
    states: dict[str, int] = {}
    for replica in details.replicas:
        states[replica.state.value] = states.get(replica.state.value, 0) + 1
    running = states.get("RUNNING", 0)
    demand = {name: float(amount) for name, amount in details.required_resources.items() if amount}
    status = details.status.value
    ready = running > 0 or (details.target_num_replicas == 0 and status == "HEALTHY")
    reason, unplaceable = None, False
    if not ready:
        if status in ("DEPLOY_FAILED", "UNHEALTHY"):
            reason = f"{status.lower().replace('_', ' ')}"
        else:
            reason, unplaceable = waiting_for(demand, nodes, free, states)
        if details.message:
            reason += f" [Serve: {details.message[:MAX_SERVE_MESSAGE_CHARS]}]"
    return DeploymentReadiness(name=details.name, status=status, ready=ready, running_replicas=running,
                               target_replicas=details.target_num_replicas, replica_states=states,
                               required_resources=demand, reason=reason, unplaceable=unplaceable)


def app_readiness(app_name: str, application, nodes: list[Mapping[str, float]],
                  free: Mapping[str, float]) -> Readiness:
    """`application`: Serve's `ApplicationDetails` of `app_name`, or None when it is not deployed."""
    if application is None:
        return Readiness(ready=False, application=app_name, status="NOT_STARTED",
                         detail=f"application {app_name!r} is not deployed")
    deployments = [deployment_readiness(d, nodes, free) for _, d in sorted(application.deployments.items())]
    pending = [d.name for d in deployments if not d.ready]
    status = application.status.value
    reasons = [f"{d.name}: {d.reason}" for d in deployments if not d.ready]
    if status == "DELETING":
        reasons.insert(0, "the application is being deleted (draining in-flight requests)")
    if application.message and status != "RUNNING":
        reasons.append(f"[Serve: {application.message[:MAX_SERVE_MESSAGE_CHARS]}]")
    ready = bool(deployments) and not pending and status not in ("DELETING", "NOT_STARTED", "DEPLOY_FAILED")
    return Readiness(ready=ready, application=app_name, status=status, pending=pending, deployments=deployments,
                     detail="; ".join(reasons) or (None if ready else "deploying"))


def fetch_readiness(app_name: str) -> Readiness:
    """Ask the Serve controller and the GCS (blocking: call it off the event loop)."""
    import ray
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeInstanceDetails

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return Readiness(ready=False, application=app_name, status="NOT_STARTED", detail="Serve is not running")
    details = ServeInstanceDetails(**client.get_serve_details())  # what `serve.status()` reads, with resources
    application = details.applications.get(app_name)
    nodes, free = [], {}
    if application is not None and any(all(r.state.value != "RUNNING" for r in d.replicas)
                                       for d in application.deployments.values()):  # only then ask the GCS
        nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
        free = ray.available_resources()
    return app_readiness(app_name, application, nodes, free)


def all_healthy(overview) -> bool:
    """`overview`: Serve's `StatusOverview` of one application. Every deployment HEALTHY (its running replicas
    are its target) in a RUNNING application: exactly what `app_readiness` would call ready, read from the
    controller's cached statuses instead of its whole instance details."""
    return (overview.app_status.status.value == "RUNNING" and bool(overview.deployment_statuses)
            and all(d.status.value == "HEALTHY" for d in overview.deployment_statuses))


def fetch_gate_readiness(app_name: str) -> Readiness:
    """What the gate needs, cheaply: while every deployment is healthy, Serve's status overview (~2 ms) says so;
    only otherwise the full report (`fetch_readiness`). The full one costs the controller `get_serve_details` and
    the caller ~40 ms of parsing with the GIL held (measured on a 2-core machine): the gate asks once a second under
    traffic, in the ingress's process. A healthy report carries no per-deployment detail (`GET /readyz` fetches
    the full one)."""
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is not None and all_healthy(overview := client.get_serve_status(app_name)):
        return Readiness(ready=True, application=app_name, status=overview.app_status.status.value)
    return fetch_readiness(app_name)  # it answers "Serve is not running" itself


class ReadinessProbe:
    """The latest readiness, fetched by one caller at a time and at most every `refresh_s`. A stale report
    that said ready is returned at once while a fresh one is fetched behind it (traffic never waits on the
    controller); a stale report that said not ready is refreshed before it is returned."""

    def __init__(self, app_name: str, fetch: Callable[[str], Readiness] = fetch_readiness, refresh_s: float = 1.0):
        self.app_name, self.fetch, self.refresh_s = app_name, fetch, refresh_s
        self._report: Readiness | None = None
        self._fetched_at = float("-inf")
        self._lock = asyncio.Lock()
        self._background: asyncio.Task | None = None

    def _fresh(self) -> bool:
        return time.monotonic() - self._fetched_at < self.refresh_s

    async def get(self) -> Readiness:
        if self._report is not None and (self._fresh() or self._report.ready):
            if not self._fresh() and (self._background is None or self._background.done()):
                self._background = asyncio.create_task(self._refresh())
            return self._report
        await self._refresh()
        return self._report

    async def _refresh(self) -> None:
        async with self._lock:
            if self._fresh():
                return
            try:
                self._report = await asyncio.to_thread(self.fetch, self.app_name)
            except Exception as error:  # noqa: BLE001  a controller hiccup must not take traffic down
                self._report = Readiness(ready=False, application=self.app_name, status=UNKNOWN,
                                         detail=f"cannot ask the Serve controller: {type(error).__name__}: {error}")
            self._fetched_at = time.monotonic()


def route_path(scope: Scope) -> str:
    """The path inside the application (Serve may mount it under a route prefix)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


INSPECTOR = "Inspector"  # the inspector page's deployment (serve/app.py): only `/ui` routes use it
UI_PREFIX = "/ui"


def uses(path: str, deployment: str) -> bool:
    """Whether a request to `path` waits for `deployment`: the inspector's routes for the Inspector alone, every
    other route for every deployment but the Inspector (an answer never waits for the inspector page)."""
    return (deployment == INSPECTOR) == (path == UI_PREFIX or path.startswith(UI_PREFIX + "/"))


def holding_back(report: Readiness, path: str) -> str | None:
    """Why a request to `path` cannot be served now (None: it can): a deployment it uses has no running replica,
    or the application is not there (deleting, not started). A deployment with fewer replicas than its target
    but one running is serving."""
    if report.ready or report.status == UNKNOWN:
        return None
    if report.status in ("DELETING", "NOT_STARTED"):
        return report.detail or report.status.lower()
    reasons = [f"{d.name}: {d.reason}" for d in report.deployments if not d.ready and uses(path, d.name)]
    return "; ".join(reasons) or None


class ReadinessGate:
    """503 with `Retry-After` for a request that would wait for a deployment with no running replica (only the
    deployments its route uses: `holding_back`). Readiness that cannot be fetched lets requests through (a
    monitoring failure is not an outage)."""

    def __init__(self, app: ASGIApp, probe: ReadinessProbe, on_error: Callable[[Request, int], None],
                 ungated: frozenset[str] = INGRESS_ONLY_PATHS, auth: Authenticator | None = None):
        self.app, self.probe, self.on_error, self.ungated, self.auth = app, probe, on_error, ungated, auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and route_path(scope) not in self.ungated:
            reason = holding_back(await self.probe.get(), route_path(scope))
            if reason is not None:
                request = Request(scope, receive)
                self.on_error(request, 503)
                if self.auth is not None and not self.auth.admits(request.headers):
                    reason = KEY_FOR_DETAIL
                detail = f"not ready: {reason}; retry later (GET /readyz tells when)"
                await error_response(request, 503, detail, {"Retry-After": str(RETRY_AFTER_S)})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def summary(report: Readiness) -> Readiness:
    """What `GET /readyz` tells a caller without a key: ready or not, nothing about why."""
    return Readiness(ready=report.ready, application=report.application, status=report.status,
                     detail=None if report.ready else KEY_FOR_DETAIL)


def install_readiness(app: FastAPI, probe: ReadinessProbe, on_error: Callable[[Request, int], None],
                      detailed: ReadinessProbe | None = None, auth: Authenticator | None = None) -> None:
    """Add `GET /readyz` and the gate to `app`; `on_error(request, status)` sees every 503 the gate sends. The gate
    asks `probe` before each request; `GET /readyz` asks `detailed` (default: `probe`), which may cost more (it is
    asked only when a client calls it). With `auth` requiring keys, the detail goes only to a valid key."""
    detailed = detailed or probe

    @app.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
    async def readyz(request: Request) -> JSONResponse:
        """200 once every deployment has a running replica; else 503 naming what is pending and why (the why only
        to a valid API key, when keys are configured)."""
        report = await detailed.get()
        if auth is not None and not auth.admits(request.headers):
            report = summary(report)
        return JSONResponse(report.model_dump(mode="json"), status_code=200 if report.ready else 503)

    app.add_middleware(ReadinessGate, probe=probe, on_error=on_error, auth=auth)
