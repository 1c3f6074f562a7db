"""Ray Serve's own cost of a request shaped like qvpic's answer, measured on the cluster qvpic's app runs on.

qvpic's HTTP request goes client → Serve's proxy → ingress replica → router replica and back → generator
replica and back → proxy → client. This app takes the same path with nothing to do at any stop: a FastAPI
ingress that calls one deployment with a request-sized payload, then another with a plan-sized one, each of
which returns what it was given. Deployed beside qvpic's app (the same proxy, Ray processes and cores) and sent
a request after each of qvpic's, so both see the same machine, its HTTP round trip is the least any request of
qvpic's topology costs there before its model work: the part of a linked mode's TTFT that no engine change can
remove (benchmarks/peer/speed.py sets it beside the query-turn prefill alone and the 0.1× target).
"""

# No `from __future__ import annotations`: FastAPI, behind Serve's class ingress, would not resolve the `Request`
# annotation from its string and would ask the client for a `request` query parameter (422).
import time

import httpx
from fastapi import FastAPI, Request
from ray import serve
from ray.serve.handle import DeploymentHandle

APP_NAME = "serve-floor"
ROUTE_PREFIX = "/" + APP_NAME
# Measured on the peer benchmark's reordered request (ray.cloudpickle, 2026-12-06): the AnswerRequest the
# ingress sends the router, ~0.8 KB; the Plan it gets back and sends the generator, ~8 KB. Serialising either
# takes < 0.2 ms, so the sizes matter little; they are kept for the shape.
REQUEST_NBYTES, PLAN_NBYTES = 822, 8189
# the ingress's wall time reading the request's body, of each call, and of the whole request
HOPS = ("body_ms", "route_hop_ms", "generate_hop_ms", "server_ms")

api = FastAPI()


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Echo:
    async def echo(self, payload: bytes, reply_nbytes: int) -> bytes:
        return payload[:reply_nbytes].ljust(reply_nbytes, b"\0")


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class FloorIngress:
    def __init__(self, route: DeploymentHandle, generate: DeploymentHandle, by_reference: bool):
        # Serve's default, as qvpic's ingress calls its router and generator, is True: Ray actor calls whose results
        # go through the object store; False: by value over the replicas' gRPC servers (compared in
        # docs/benchmarks/notes.md; tests/e2e/test_serve_floor.py runs both)
        self.route = route.options(_by_reference=by_reference)
        self.generate = generate.options(_by_reference=by_reference)

    @api.post("/")
    async def answer(self, request: Request) -> dict[str, float]:
        started = time.perf_counter()
        body = await request.body()  # under Serve, the body comes from the proxy when the app asks for it
        read = time.perf_counter()
        plan = await self.route.echo.remote(body.ljust(REQUEST_NBYTES, b"\0"), PLAN_NBYTES)
        routed = time.perf_counter()
        await self.generate.echo.remote(plan, 64)
        done = time.perf_counter()
        return {"body_ms": (read - started) * 1e3, "route_hop_ms": (routed - read) * 1e3,
                "generate_hop_ms": (done - routed) * 1e3, "server_ms": (time.perf_counter() - started) * 1e3,
                "by_reference": float(self.route.handle_options._by_reference)}  # the transport its calls took


def deploy(by_reference: bool = True, name: str = APP_NAME) -> None:
    """The floor app beside the running Serve instance's others (its own name, and route prefix `/<name>`), its
    calls travelling as qvpic's do (`by_reference`: Serve's handle option)."""
    app = FloorIngress.bind(Echo.options(name="FloorRoute").bind(), Echo.options(name="FloorGenerate").bind(),
                            by_reference)
    serve.run(app, name=name, route_prefix="/" + name)


def ask(client: httpx.Client, base_url: str, body: dict, prefix: str = ROUTE_PREFIX) -> tuple[float, dict[str, float]]:
    """One request through the floor app: its HTTP round trip in ms, and the ingress's own account (`HOPS`)."""
    started = time.perf_counter()
    reply = client.post(base_url + prefix + "/", json=body)
    ms = (time.perf_counter() - started) * 1e3
    reply.raise_for_status()
    return ms, reply.json()
