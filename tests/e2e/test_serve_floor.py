"""Serve's floor app, which the peer benchmarks time beside qvpic (benchmarks/peer/serve_floor.py), over each
transport of Serve's handles (by value over gRPC, Ray actor calls: compared in docs/benchmarks/notes.md): each arm
answers, accounts for its hops, and its handles took the transport asked for."""

from __future__ import annotations

import pytest

from tests.support.ray_fixtures import ray_session  # noqa: F401  (fixture)

pytestmark = pytest.mark.e2e


def test_the_floor_app_answers_over_each_transport_and_accounts_for_its_hops(ray_session):  # noqa: F811
    import httpx
    from ray import serve

    from benchmarks.peer import serve_floor
    from benchmarks.peer.servers import start_serve

    serve.shutdown()  # a Serve instance left by another module would keep its own HTTP port
    transports = {"grpc": False, "object_ref": True}  # name → Serve's handle option `_by_reference`
    url = start_serve()
    try:
        for name, by_reference in transports.items():  # one Serve application per arm, routed at /floor-<name>
            serve_floor.deploy(by_reference, f"floor-{name}")
        with httpx.Client(timeout=600) as client:  # one warm-up request per arm, then 3
            out = {name: [serve_floor.ask(client, url, {"query": "q"}, f"/floor-{name}") for _ in range(4)][1:]
                   for name in transports}
    finally:
        serve.shutdown()
    assert {name: len(rows) for name, rows in out.items()} == {"grpc": 3, "object_ref": 3}
    for name, rows in out.items():
        for ms, hops in rows:
            assert ms > hops["server_ms"] > hops["route_hop_ms"] + hops["generate_hop_ms"] > 0
            assert hops["by_reference"] == (name == "object_ref")  # gRPC: by value
