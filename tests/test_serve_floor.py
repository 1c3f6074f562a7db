"""Serve's floor app, which the peer benchmarks time beside qvpic (benchmarks/peer/serve_floor.py), over each
transport that benchmarks/serve_transport.py compares: each arm answers, accounts for its hops, and its handles
took the transport asked for."""

from __future__ import annotations

import pytest

from tests.ray_fixtures import ray_session  # noqa: F401  (fixture)

pytestmark = pytest.mark.e2e


def test_the_floor_app_answers_over_each_transport_and_accounts_for_its_hops(ray_session):  # noqa: F811
    from ray import serve

    from benchmarks import serve_transport

    serve.shutdown()  # a Serve instance left by another module would keep its own HTTP port
    out = serve_transport.run(requests=3, warmup=1)
    assert {name: len(rows) for name, rows in out.items()} == {"grpc": 3, "object_ref": 3}
    for name, rows in out.items():
        for ms, hops in rows:
            assert ms > hops["server_ms"] > hops["route_hop_ms"] + hops["generate_hop_ms"] > 0
            assert hops["by_reference"] == (name == "object_ref")  # gRPC: by value
    table = serve_transport.report(out, 3)
    assert "| grpc |" in table and table.count("1.00×") >= 1
