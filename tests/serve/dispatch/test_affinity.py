"""The chunk-affinity dispatch policy (serve/dispatch/affinity.py) and the key sketch it reads
(serve/kv/hot_tier.py), with hand-worked cases: which replica each plan must go to, given stated sketches
and in-flight counts, as literals."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import uuid

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.test_utils import FakeRunningReplica

from schemas.modes import ChunkKind, Mode, Variant
from serve.config import AffinityConfig
from serve.dispatch import AffinityDispatcher, Decision, ReplicaView, choose
from serve.kv import HotTierReport, KeySketch, key_hash
from serve.plan import Entry, EntryRow, KVLocation, Plan, PlannedChunk

# Four entries of 100, 200, 400 and 800 stored bytes.
NBYTES = {"k1": 100, "k2": 200, "k3": 400, "k4": 800}
RATIO = AffinityConfig().max_load_ratio  # 1.5


def entries(*keys: str) -> list[tuple[tuple[int, int], int]]:
    return [(key_hash(k), NBYTES[k]) for k in keys]


def report(*keys: str, recorded_at_s: float | None = None) -> HotTierReport:
    return HotTierReport(KeySketch.of(keys), len(keys), time.time() if recorded_at_s is None else recorded_at_s)


def pick(plan: list, replicas: list[ReplicaView], seed: int = 0, ratio: float = RATIO, floor: int = 1):
    """`choose` with the ratio cap alone (`min_in_flight` 1), unless a test says otherwise."""
    return choose(plan, replicas, random.Random(seed), max_load_ratio=ratio, min_in_flight=floor)


def view(name: str, in_flight: int, *keys: str) -> ReplicaView:
    return ReplicaView(name, in_flight, report(*keys))


def test_the_sketch_holds_what_was_added_and_not_what_was_not():
    sketch = KeySketch.of(["k1", "k2", "k3"])
    assert all(sketch.contains(key_hash(k)) for k in ("k1", "k2", "k3"))
    assert not any(sketch.contains(key_hash(k)) for k in ("k4", "k5", "other"))
    assert len(KeySketch.of(f"key{i}" for i in range(1000)).bits) == 1250  # 10 bits per key (docstring)
    # the measured false-positive rate at 10 bits and 7 probes per key: ≈0.8 %, well under 2 %
    wide = KeySketch.of(f"in{i}" for i in range(2000))
    assert sum(wide.contains(key_hash(f"out{i}")) for i in range(5000)) < 100


def test_stats_round_trip_and_garbage_reads_as_none():
    sent = report("k1", "k2", recorded_at_s=12.5)
    back = HotTierReport.from_stats(sent.to_stats())
    assert back == sent
    assert HotTierReport.from_stats({}) is None and HotTierReport.from_stats(None) is None
    assert HotTierReport.from_stats({"hot_tier": {"bits": b"", "num_bits": 64}}) is None  # missing fields
    assert HotTierReport.from_stats({**sent.to_stats(), "hot_tier": {**sent.to_stats()["hot_tier"],
                                                                    "num_bits": 10_000}}) is None  # bits too short


def test_the_replica_holding_most_bytes_wins_not_most_entries():
    # A holds k1 + k2 (2 entries, 300 B), B holds k4 (1 entry, 800 B), C nothing; all idle
    choice = pick(entries("k1", "k2", "k4"), [view("A", 0, "k1", "k2"), view("B", 0, "k4"), view("C", 0)])
    assert choice.decision is Decision.AFFINITY
    assert choice.ranks == (("B",), ("A",), ("C",))
    assert choice.held_nbytes == {"A": 300, "B": 800, "C": 0}


def test_equal_holdings_share_a_rank_least_loaded_first():
    # 2 + 1 in flight + this one = 4, mean 2, cap ⌈1.5 × 2⌉ = 3: both eligible, B the less loaded
    choice = pick(entries("k3"), [view("A", 2, "k3"), view("B", 1, "k3")])
    assert choice.ranks == (("B", "A"),)


def test_the_load_cap_sends_past_the_best_holder():
    # B holds everything but has 3 in flight: 3 + 0 + 0 + this one = 4, mean 4/3, cap ⌈1.5 × 4/3⌉ = 2 < 3 + 1
    replicas = [view("A", 0, "k1"), view("B", 3, "k1", "k2", "k3"), view("C", 0)]
    choice = pick(entries("k1", "k2", "k3"), replicas)
    assert choice.decision is Decision.AFFINITY and choice.ranks == (("A",), ("C",))
    # two replicas, 1 + 2 in flight + this one = 4, mean 2, cap ⌈3⌉ = 3: B may take a third
    two = [view("A", 1, "k1"), view("B", 2, "k1", "k2", "k3")]
    assert pick(entries("k1", "k2", "k3"), two).ranks == (("B",), ("A",))


def test_in_flight_caps_round_up_to_whole_requests():
    # two replicas, 1 + 0 in flight + this one = 2, mean 1: 1.5 × 1 rounds up to 2, so A may take a second
    assert pick(entries("k1"), [view("A", 1, "k1"), view("B", 0)]).ranks == (("A",), ("B",))
    # three: 1 + 0 + 0 + this one = 2, mean 2/3: ⌈1.5 × 2/3⌉ = 1 excludes A at 2
    three = [view("A", 1, "k1"), view("B", 0), view("C", 0)]
    assert pick(entries("k1"), three).decision is Decision.COLD


def test_up_to_min_in_flight_the_holder_keeps_its_requests():
    # the same three replicas: the ratio cap (1) excludes A at 2, the floor of 2 does not
    three = [view("A", 1, "k1"), view("B", 0), view("C", 0)]
    assert pick(entries("k1"), three, floor=AffinityConfig().min_in_flight).ranks == (("A",), ("B", "C"))


def test_the_least_loaded_replica_is_always_eligible():
    # a cap of at least ⌈(in flight + 1) / replicas⌉ exceeds the least loaded's count: it can always take one more
    for loads in itertools.product(range(5), repeat=3):
        replicas = [view(name, n, "k1") for name, n in zip("ABC", loads)]
        least = {r.replica_id for r in replicas if r.in_flight == min(loads)}
        choice = pick(entries("k1"), replicas, ratio=1.0)
        assert least <= {name for rank in choice.ranks for name in rank}, loads


def test_nothing_cached_anywhere_is_power_of_two_choices_among_the_eligible():
    replicas = [view("A", 0, "k4"), view("B", 1), view("C", 3)]  # C over the cap (⌈1.5 × 5/3⌉ = 3 < 4)
    for seed in range(20):
        choice = pick(entries("k1", "k2"), replicas, seed=seed)
        assert choice.decision is Decision.COLD
        assert len(choice.ranks) == 2 and all(len(rank) == 1 for rank in choice.ranks)
        pair = [rank[0] for rank in choice.ranks]
        assert pair == ["A", "B"]  # the only two eligible, the less loaded first


def test_no_fresh_stats_defers_to_the_default_policy():
    replicas = [ReplicaView("A", 0, None), ReplicaView("B", 0, None)]
    assert pick(entries("k1"), replicas).decision is Decision.NO_STATS


# ---- the Serve request router itself, over in-memory replicas -------------------------------------------------

class StatsReplica(FakeRunningReplica):
    def __init__(self, name: str, stats: dict):
        super().__init__(name)
        self.stats = stats

    @property
    def routing_stats(self) -> dict:
        return self.stats


def plan_of(*keys: str) -> Plan:
    def chunk(key: str) -> PlannedChunk:
        stored = KVLocation("shards/x.safetensors", key, 0, NBYTES[key], "0" * 64, (2, 2, 1, 4, 8), "float32")
        entry = Entry(key=key, tier="low", variant=Variant.TEMPLATE, num_tokens=4, vision_tokens=4,
                      position_span=2, row=EntryRow(ChunkKind.IMAGE, 0, ((1, 2, 2),), ((28, 28),), stored))
        return PlannedChunk(key, "doc", 1.0, "low", 4, 4, 2, entry)
    return Plan(mode=Mode.UNIFORM, query="q", chunks=tuple(map(chunk, keys)), prefix_tokens=0, query_tokens=0,
                fallbacks=(), route_ms=0.0)


def pending(plan: Plan) -> PendingRequest:
    request_id = str(uuid.uuid4())
    return PendingRequest(args=[plan], kwargs={}, metadata=RequestMetadata(request_id, request_id))


def affinity_router(replicas: list[StatsReplica]) -> AffinityDispatcher:
    """Built inside a running event loop (a router binds to the loop it is made in)."""
    router = AffinityDispatcher(deployment_id=DeploymentID(name="Generator", app_name="app"),
                                 handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**AffinityConfig(stale_after_s=60.0, min_in_flight=1).model_dump())
    router.update_replicas(replicas)
    return router


async def route(router: AffinityDispatcher, replicas: list[StatsReplica], request: PendingRequest) -> list[list[str]]:
    return [[r.replica_id.unique_id for r in rank] for rank in await router.choose_replicas(replicas, request)]


def test_the_router_sends_a_plan_to_its_holder_and_stale_stats_fall_back_to_power_of_two():
    plan = plan_of("k1", "k2", "k3")
    holder = StatsReplica("A", report("k1", "k2", "k3").to_stats())
    other = StatsReplica("B", report("k4").to_stats())

    async def scenario() -> None:
        router = affinity_router([holder, other])
        assert await route(router, [holder, other], pending(plan)) == [["A"], ["B"]]
        # Negative control: with A's stats an hour old (and B's unreadable) the default policy decides —
        # both candidates in one rank (Serve then takes the less queued), never A alone ahead of B.
        holder.stats = report("k1", "k2", "k3", recorded_at_s=time.time() - 3600).to_stats()
        other.stats = {"hot_tier": "garbage"}
        ranks = await route(router, [holder, other], pending(plan))
        assert len(ranks) == 1 and sorted(ranks[0]) == ["A", "B"]
        # a request that carries no plan (e.g. hot_tier_stats) is routed by the default policy too
        no_plan = PendingRequest(args=[], kwargs={}, metadata=RequestMetadata("x", "x"))
        ranks = await route(router, [holder, other], no_plan)
        assert len(ranks) == 1 and sorted(ranks[0]) == ["A", "B"]
    asyncio.run(scenario())


def test_the_router_counts_in_flight_requests_until_they_complete():
    plan = plan_of("k1", "k2", "k3")
    replicas = [StatsReplica("A", report("k1", "k2", "k3").to_stats()), StatsReplica("B", report().to_stats())]
    by_id = {r.replica_id.unique_id: r for r in replicas}

    async def scenario() -> None:
        router = affinity_router(replicas)
        # in flight (A, B) before each, cap ⌈1.5 × (in flight + 1) / 2⌉: (0,0) cap 1 -> A; (1,0) cap 2 -> A;
        # (2,0) cap 3 -> A; (3,0) cap 3 -> B; (3,1) cap 4 -> B, which now holds the set too (sent to it, in
        # flight: its newer reports cannot cover that request yet) and is the less loaded
        sent = []
        for _ in range(5):
            request = pending(plan)
            target = (await route(router, replicas, request))[0][0]
            router.on_request_routed(request, by_id[target].replica_id, None)
            sent.append((target, request))
            for replica, keys in zip(replicas, (("k1", "k2", "k3"), ())):  # newer reports: B kept nothing
                replica.stats = report(*keys).to_stats()
        assert [target for target, _ in sent] == ["A", "A", "A", "B", "B"]
        router.on_request_completed(by_id["A"].replica_id, sent[0][1].metadata.internal_request_id)
        # (2,2) cap 4: both hold the set (A by its report, B by its requests in flight) at equal load, so one
        # rank, where Serve takes the less queued
        assert sorted((await route(router, replicas, pending(plan)))[0]) == ["A", "B"]
    asyncio.run(scenario())


def test_what_the_router_sent_counts_as_held_until_a_newer_report():
    plan = plan_of("k1", "k2")
    replicas = [StatsReplica("A", report().to_stats()), StatsReplica("B", report().to_stats())]
    by_id = {r.replica_id.unique_id: r for r in replicas}

    async def scenario() -> None:
        router = affinity_router(replicas)
        request = pending(plan)
        ranks = await route(router, replicas, request)  # nothing held anywhere: power of two choices
        assert len(ranks) == 2 and sorted(r[0] for r in ranks) == ["A", "B"]
        target, other = ranks[0][0], ranks[1][0]
        router.on_request_routed(request, by_id[target].replica_id, None)
        router.on_request_completed(by_id[target].replica_id, request.metadata.internal_request_id)
        # before the target reports again, the same set follows the first request
        assert await route(router, replicas, pending(plan)) == [[target], [other]]
        held = {v.replica_id: v.routed for v in router.views(replicas)}
        assert held == {target: frozenset({key_hash("k1"), key_hash("k2")}), other: frozenset()}
        by_id[target].stats = report().to_stats()  # a newer report: it kept none of it
        assert all(not v.routed for v in router.views(replicas))
    asyncio.run(scenario())


def test_a_report_recorded_while_the_request_is_in_flight_does_not_cover_it():
    """The replica has not taken a queued request's misses in yet, so a report recorded meanwhile says
    nothing about them: what was sent stays held until a report recorded after the request completed."""
    plan = plan_of("k1", "k2")
    replicas = [StatsReplica("A", report().to_stats()), StatsReplica("B", report().to_stats())]
    by_id = {r.replica_id.unique_id: r for r in replicas}

    async def scenario() -> None:
        router = affinity_router(replicas)
        request = pending(plan)
        target = (await route(router, replicas, request))[0][0]
        router.on_request_routed(request, by_id[target].replica_id, None)
        time.sleep(0.01)
        by_id[target].stats = report().to_stats()  # newer than the routing, the request still in flight
        assert {v.replica_id: v.routed for v in router.views(replicas)}[target] == {key_hash("k1"), key_hash("k2")}
        time.sleep(0.01)
        router.on_request_completed(by_id[target].replica_id, request.metadata.internal_request_id)
        # completed after that report: still held (the report predates it) ...
        assert {v.replica_id: v.routed for v in router.views(replicas)}[target] == {key_hash("k1"), key_hash("k2")}
        time.sleep(0.01)
        by_id[target].stats = report().to_stats()
        # ... until one recorded after the completion says the replica kept none of it
        assert all(not v.routed for v in router.views(replicas))
    asyncio.run(scenario())


def test_a_conversations_follow_up_goes_where_its_earlier_turn_went():
    """Prefix affinity: the router remembers where a conversation went; a follow-up (its messages extend the
    earlier ones) goes there although no hot tier holds any of its chunks; another tenant's does not."""
    earlier = Plan(mode=Mode.QVPIC, query="q", chunks=(), prefix_tokens=40, query_tokens=8, fallbacks=(),
                   route_ms=0.0, conversation_chain=("m1", "m2"), cache_salt=b"acme")
    follow_up = Plan(mode=Mode.QVPIC, query="q", chunks=(), prefix_tokens=90, query_tokens=8, fallbacks=(),
                     route_ms=0.0, conversation_chain=("m1", "m2", "m3", "m4"), cache_salt=b"acme")
    other_tenant = Plan(mode=Mode.QVPIC, query="q", chunks=(), prefix_tokens=90, query_tokens=8, fallbacks=(),
                        route_ms=0.0, conversation_chain=("m1", "m2", "m3", "m4"), cache_salt=b"globex")
    replicas = [StatsReplica("A", report().to_stats()), StatsReplica("B", report().to_stats())]
    by_id = {r.replica_id.unique_id: r for r in replicas}

    async def scenario() -> None:
        router = affinity_router(replicas)
        request = pending(earlier)
        target = (await route(router, replicas, request))[0][0]
        router.on_request_routed(request, by_id[target].replica_id, None)
        router.on_request_completed(by_id[target].replica_id, request.metadata.internal_request_id)
        assert router.held_prefix(follow_up, replicas) == {target: 48}  # the earlier plan's prompt tokens
        for _ in range(4):
            assert (await route(router, replicas, pending(follow_up)))[0] == [target]
        assert router.held_prefix(other_tenant, replicas) == {}
    asyncio.run(scenario())
