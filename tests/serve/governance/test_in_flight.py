"""Per-tenant in-flight cap (`limits.*.max_in_flight`): past it a tenant's request is 429 with Retry-After, other
tenants are unaffected, and a slot comes back however its request ends (answered, failed, or abandoned)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from serve.app import api_spec
from serve.config import AppConfig
from serve.governance import Governor
from serve.http import make_api
from serve.local import InProcessBackend
from tests.support.store_factory import MAX_CHUNKS, roles, serving_store  # noqa: F401  (fixtures)

BODY = {"query": "When does part XK-4471-B ship?", "chunk_ids": ["manual#00000"], "max_new_tokens": 2}
NO_CACHE = {"Cache-Control": "no-cache"}


class Held(InProcessBackend):
    """Generation waits on `gate`: a request stays in flight until the test lets it go."""

    gate: asyncio.Event
    fail = False

    async def generate(self, plan, loaded, sampling):
        await self.gate.wait()
        if self.fail:
            raise RuntimeError("generator crashed")
        return await super().generate(plan, loaded, sampling)


@pytest.fixture
def served(roles, serving_store):
    args = AppConfig(store={"uri": serving_store.uri}, model=serving_store.model, router={"max_chunks": MAX_CHUNKS},
                     ingress={"default_top_k": 2, "governance": {"limits": {"default": {"max_in_flight": 1}}}})
    settings = api_spec(args)
    backend = Held(roles.router, roles.loader, roles.generator)
    governor = Governor(args.ingress.governance, settings.store)
    return make_api(backend, settings, governor), backend, governor


def test_a_tenant_past_its_cap_waits_and_others_do_not(served):
    app, backend, governor = served

    async def scenario():
        backend.gate = asyncio.Event()
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=60) as client:
            def ask(tenant):
                return client.post("/v1/answer", json=BODY, headers={**NO_CACHE, "X-Tenant": tenant})
            first = asyncio.create_task(ask("acme"))
            while governor.in_flight["acme"] < 1:
                await asyncio.sleep(0.01)
            refused = await ask("acme")
            assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
            assert "max_in_flight" in refused.json()["detail"]
            other = asyncio.create_task(ask("globex"))  # its own slot
            while governor.in_flight["globex"] < 1:
                await asyncio.sleep(0.01)
            backend.gate.set()
            assert (await first).status_code == 200 and (await other).status_code == 200
            assert (await ask("acme")).status_code == 200  # the slot came back
            backend.fail = True  # a failed request gives its slot back too
            assert (await ask("acme")).status_code == 500
            backend.fail, backend.gate = False, asyncio.Event()
            abandoned = asyncio.create_task(ask("acme"))
            while governor.in_flight["acme"] < 1:
                await asyncio.sleep(0.01)
            abandoned.cancel()  # the client went away mid-request
            with pytest.raises(asyncio.CancelledError):
                await abandoned
            for _ in range(200):
                if not governor.in_flight["acme"]:
                    break
                await asyncio.sleep(0.01)
            assert governor.in_flight["acme"] == 0
    asyncio.run(scenario())
