"""Issue 60, item 3: a fair generator. A tenant's share of the engine's rows and KV bytes is capped while another
tenant holds some (serve/engine/shares.py, above the engine seam, so qvpic's engine and vLLM's alike); past it the
tenant's requests wait in the generator and then answer exactly as alone."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import yaml

from schemas.errors import DeadlineExceededError, TooLargeError
from schemas.sampling import Sampling
from serve.config import AppConfig
from serve.engine.shares import TenantShares
from tests.serve.engine.test_generator import plan
from tests.support.paths import REPO
from tests.support.store_factory import roles, serving_store  # noqa: F401  (fixtures)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def holder(shares: TenantShares, tenant: bytes, rows: int, nbytes: int, deadline: float | None = None):
    """A task holding `rows` and `nbytes` for `tenant` until its event is set."""
    release = asyncio.Event()

    async def hold() -> None:
        async with shares.hold(tenant, rows, nbytes, deadline):
            await release.wait()
    return asyncio.create_task(hold()), release


def test_a_tenant_past_its_share_waits_while_another_holds_rows_and_alone_it_takes_the_batch():
    async def scenario():
        shares = TenantShares(0.5, 4, 1000)  # 2 rows and 500 bytes of KV a tenant, while another holds some
        b, b_release = holder(shares, b"B", 1, 10)
        await settle()
        a = [holder(shares, b"A", 1, 10) for _ in range(3)]
        await settle()
        assert shares.rows[b"A"] == 2  # the third waits (3 without the cap)
        a[0][1].set()
        await settle()
        assert shares.rows[b"A"] == 2 and a[0][0].done()  # the third joined as the first left
        for _, release in a[1:]:
            release.set()
        await settle()
        assert b"A" not in shares.rows
        dear_first, dear_release = holder(shares, b"A", 1, 400)  # KV: 400 held, 200 more passes 500
        dearer, dearer_release = holder(shares, b"A", 1, 200)
        await settle()
        assert (shares.rows[b"A"], shares.nbytes[b"A"]) == (1, 400)
        dear_release.set()
        await settle()
        assert (shares.rows[b"A"], shares.nbytes[b"A"]) == (1, 200)
        dearer_release.set()
        b_release.set()
        await settle()
        assert not shares.rows  # everyone let go
        alone = [holder(shares, b"A", 1, 10) for _ in range(4)]
        await settle()
        assert shares.rows[b"A"] == 4  # alone, the whole batch
        late, _ = holder(shares, b"B", 1, 10)
        await settle()
        assert shares.rows[b"B"] == 1  # within its own share
        waits, _ = holder(shares, b"A", 1, 10, deadline=0.0)  # over its share while B holds a row, deadline passed
        await settle()
        assert isinstance(waits.exception(), DeadlineExceededError)
        with pytest.raises(TooLargeError, match="max_tenant_share"):
            async with shares.hold(b"A", 3, 10, None):  # n = 3 choices can never fit 2 rows
                pass
        for _task, release in alone:
            release.set()
        late.cancel()
        await settle()
    asyncio.run(scenario())


def test_the_generator_holds_a_tenant_to_its_share_and_answers_exactly(roles, monkeypatch):
    """Tenant B's answer is open (its stream not yet read to the end: its row is held); tenant A sends three
    requests with a share of 2 of 4 rows: at most 2 are in the engine at once, and each answers as it does alone.
    Without the cap (mutation: `_fits` always True) the third joins at once: 3 rows."""
    generator = roles.generator
    monkeypatch.setattr(generator, "shares", TenantShares(0.5, 4, None))
    held: list[dict[bytes, int]] = []  # each tenant's rows as each request reached the engine
    add = generator.engine.add
    monkeypatch.setattr(generator.engine, "add", lambda seq: held.append(dict(generator.shares.rows)) or add(seq))
    queries = [plan(roles, doc_ids=[doc], max_new_tokens=6) for doc in ("manual", "invoices", "recipes")]
    sampling = Sampling(max_new_tokens=6)
    expected = [generator.generate_blocking(dataclasses.replace(q, cache_salt=b"A"), sampling).text for q in queries]
    other = plan(roles, chunk_ids=["recipes#00000"], max_new_tokens=8)
    expected_other = generator.generate_blocking(dataclasses.replace(other, cache_salt=b"B"),
                                                 Sampling(max_new_tokens=8)).text
    held.clear()

    async def scenario():
        stream = generator.stream(dataclasses.replace(other, cache_salt=b"B"), Sampling(max_new_tokens=8))
        first = await anext(stream)  # B's row is held until its stream ends
        answers = await asyncio.gather(*(generator.generate(dataclasses.replace(q, cache_salt=b"A"), sampling)
                                         for q in queries))
        rest = [event async for event in stream]
        return answers, first, rest

    answers, first, rest = asyncio.run(scenario())
    assert [a.text for a in answers] == expected
    assert first + "".join(e for e in rest[:-1]) == expected_other == rest[-1].text
    a_rows = [rows.get(b"A", 0) for rows in held[1:]]  # A's rows once each of its requests is in (its own counted)
    assert len(a_rows) == 3 and max(a_rows) == 2, held
    assert all(rows.get(b"B") == 1 for rows in held[1:])  # B held its row throughout


@pytest.mark.parametrize("name", ["config.yaml", "config-gpu.yaml"])
def test_the_shipped_configs_set_every_fairness_cap(name):
    """Issue 60: each shipped config sets a tenant's share of the generator, its in-flight cap and Serve's bounded
    queues in front of the replicas that take a client's requests; the typed config takes them as written. (Their
    behaviour: the tests above, tests/serve/governance/test_in_flight.py, tests/serve/http/test_fair_charges.py.)"""
    raw = yaml.safe_load((REPO / "serve" / name).read_text())["applications"][0]["args"]
    config = AppConfig.model_validate(raw)
    assert raw["generator"]["engine"]["max_tenant_share"] == config.generator.engine.max_tenant_share == 0.5
    assert raw["ingress"]["governance"]["limits"]["default"]["max_in_flight"] == 32
    assert config.ingress.governance.limits.policy("any-tenant").max_in_flight == 32
    for deployment in ("ingress_deployment", "generator_deployment"):
        assert raw[deployment]["max_queued_requests"] == 512  # written out, not left to a default
        assert getattr(config, deployment).options()["max_queued_requests"] == 512  # what Serve is given
