"""Chunk-affinity dispatch across generator replicas: a Ray Serve request router (Ray's `RequestRouter`) for the
Generator.

A request here is a *set* of position-independent chunk entries in any order (its plan), not a prefix,
so the prefix-matching routers (Ray Serve LLM's `PrefixCacheAffinityRouter`, SGLang's, Dynamo's)
do not apply. Each generator replica reports what its device hot tier holds as a Bloom filter of
entry keys (serve/kv/hot_tier.py: 1.25 MB at 1M resident entries) through Serve's routing stats
(`Generator.record_routing_stats`, collected every `AffinityConfig.stats_period_s` and pushed to every
handle with the replica list), so dispatching a request reads local state only — no round trip.

The policy (`choose`): sum, per replica, the stored bytes of the plan's entries it holds — in its filter, or
sent to it by this router and not covered by that filter (a report covers a request recorded after it completed:
the replica then said what it kept; while it is in flight no report does, since its misses are not in yet), so a
burst for one chunk set keeps together before the next report arrives; send the request to the replica holding the most,
among those it would not put above `max_load_ratio` × the mean in-flight requests (counting it, rounded up to a
whole request; up to `min_in_flight` always allowed); ties go to the less loaded. When no eligible replica holds
any of them, power of two choices among the eligible; when no replica has fresh stats (none reported yet, or
older than `stale_after_s`), Serve's own power of two choices, unchanged. Bad stats degrade that way too, never
to an error. A replica without fresh stats holds nothing as far as the router knows (a new replica starts cold;
a removed one's stats leave with it).

Conversations add prefix affinity: a follow-up turn's prompt begins with the earlier turn's whole conversation,
whose KV (prompt and answer) the replica that served it keeps in its prefix cache. This router remembers, per
conversation prefix (sha256 of the tenant salt and of messages[:k], `Plan.conversation_chain`), the replica it
sent that conversation to and its prompt tokens; a request whose longest remembered prefix is held there counts
those tokens (at the plan's KV bytes per token) as held bytes on that replica, under the same load cap. The
replica's own prefix cache may have evicted them since: nothing reports it, so this is a bounded LRU guess.

In-flight requests are counted by this router (routed, not yet completed), so with several ingress
replicas each caps its own share. What it predicted for the replica it chose is exported per target
replica (`qvpic_routed_predicted_hit_bytes` / `qvpic_routed_plan_bytes`), beside the hit the replica
then had (`qvpic_hot_tier_bytes`): docs/DEPLOY.md reads them.
"""

from __future__ import annotations

import enum
import hashlib
import math
import random
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from serve.config import AffinityConfig
from serve.kv import HotTierReport, key_hash
from serve.metrics import serve_metrics
from serve.plan import Plan

MAX_REMEMBERED_CHOICES = 4096  # choices of requests not (yet) routed; a cancelled one is never popped
MAX_REMEMBERED_PREFIXES = 65536  # conversations (their whole message list) and where they were sent


class Decision(str, enum.Enum):
    AFFINITY = "affinity"  # to the replicas holding the most of the plan's bytes, under the load cap
    COLD = "cold"  # no eligible replica holds any: power of two choices among the eligible
    NO_STATS = "no_stats"  # no replica has fresh stats: Serve's power of two choices


@dataclass(frozen=True)
class ReplicaView:
    """What the router knows of one replica when a request arrives."""

    replica_id: str
    in_flight: int  # requests this router sent it that have not completed
    report: HotTierReport | None  # None: none, unreadable or stale
    routed: frozenset[tuple[int, int]] = frozenset()  # key hashes sent to it since its report was recorded

    def holds(self, hashed: tuple[int, int]) -> bool:
        return hashed in self.routed or (self.report is not None and self.report.sketch.contains(hashed))


@dataclass(frozen=True)
class ReplicaRanking:
    ranks: tuple[tuple[str, ...], ...]  # replica ids, most preferred rank first; empty for NO_STATS
    decision: Decision
    held_nbytes: dict[str, int]  # per replica: plan bytes its filter holds


PlanEntries = Sequence[tuple[tuple[int, int], int]]  # (key_hash, stored bytes) per linked entry


def plan_entries(plan: Plan) -> list[tuple[tuple[int, int], int]]:
    """The plan's linked entries as the policy weighs them: a pending (not yet stored) entry weighs 0."""
    return [(key_hash(c.entry.key), c.entry.row.stored.nbytes if c.entry.row.stored is not None else 0)
            for c in plan.chunks if c.entry is not None]


def prefix_keys(plan: Plan) -> list[bytes]:
    """One key per prefix of the plan's conversation (messages[:1] … all), salted with the tenant's salt."""
    return [hashlib.sha256(plan.cache_salt + b"\x00" + digest.encode()).digest() for digest in plan.conversation_chain]


def bytes_per_token(plan: Plan) -> float:
    """The plan's stored KV bytes per token (1 when it links none): the unit prefix tokens are weighed in."""
    stored = [c for c in plan.chunks if c.entry is not None and c.entry.row.stored is not None and c.num_tokens]
    tokens = sum(c.num_tokens for c in stored)
    return sum(c.entry.row.stored.nbytes for c in stored) / tokens if tokens else 1.0


def choose(entries: PlanEntries, replicas: Sequence[ReplicaView], rng: random.Random, *, max_load_ratio: float,
           min_in_flight: int, prefix: dict[str, int] | None = None) -> ReplicaRanking:
    """Which replicas a plan should go to, most preferred first (the pure policy; the module docstring).
    `prefix`: per replica, the bytes of the plan's conversation prefix it is known to hold."""
    prefix = prefix or {}
    if not any(r.report is not None for r in replicas) and not prefix:
        return ReplicaRanking((), Decision.NO_STATS, {})
    held = {r.replica_id: sum(n for h, n in entries if r.holds(h)) + prefix.get(r.replica_id, 0) for r in replicas}
    # In-flight counts are whole requests: the cap rounds up (with 4 in flight over 3 replicas, 1.5 × the mean
    # is 2; a fractional cap of 2.5 would send a chunk set's next request away from the replica holding it at 3).
    cap = max(min_in_flight, math.ceil(max_load_ratio * (sum(r.in_flight for r in replicas) + 1) / len(replicas)))
    least = min(r.in_flight for r in replicas)
    eligible = [r for r in replicas if r.in_flight + 1 <= cap] or [r for r in replicas if r.in_flight == least]
    if max(held[r.replica_id] for r in eligible) == 0:
        pair = sorted(rng.sample(eligible, min(2, len(eligible))), key=lambda r: r.in_flight)
        return ReplicaRanking(tuple((r.replica_id,) for r in pair), Decision.COLD, held)
    ranked = sorted(eligible, key=lambda r: (-held[r.replica_id], r.in_flight))
    ranks: list[tuple[str, ...]] = []
    for r in ranked:  # one rank per distinct held amount: Serve picks the least queued within a rank
        if ranks and held[ranks[-1][0]] == held[r.replica_id]:
            ranks[-1] += (r.replica_id,)
        else:
            ranks.append((r.replica_id,))
    return ReplicaRanking(tuple(ranks), Decision.AFFINITY, held)


def fresh_report(stats: dict | None, now_s: float, stale_after_s: float) -> HotTierReport | None:
    report = HotTierReport.from_stats(stats)
    return report if report is not None and now_s - report.recorded_at_s <= stale_after_s else None


class AffinityDispatcher(LocalityMixin, MultiplexMixin, RequestRouter):
    """Serve's request router for the Generator deployment (`request_router_config`, serve/app.py);
    `request_router_kwargs` are `AffinityConfig` fields. Not FIFO: a choice made for one plan must serve
    that plan, not whichever request waits longest."""

    def initialize_state(self, **spec) -> None:
        self._spec = AffinityConfig.model_validate(spec)
        self._rng = random.Random()
        self._in_flight: dict[ReplicaID, int] = {}
        # internal request id → (replica, its plan's key hashes), until it completes
        self._routed: dict[str, tuple[ReplicaID, tuple[tuple[int, int], ...]]] = {}
        # key hash → when the last request that sent it there completed (time.time()); inf while one is in flight
        self._sent: dict[ReplicaID, dict[tuple[int, int], float]] = {}
        self._choices: OrderedDict[str, ReplicaRanking] = OrderedDict()
        # conversation prefix key → (the replica its whole conversation was sent to, that plan's prompt tokens)
        self._prefixes: OrderedDict[bytes, tuple[ReplicaID, int]] = OrderedDict()
        self._metrics = serve_metrics()

    def held_prefix(self, plan: Plan, candidates: Sequence[RunningReplica]) -> dict[str, int]:
        """The longest prefix of the plan's conversation this router sent to a live candidate: {replica: bytes}."""
        live = {r.replica_id for r in candidates}
        for key in reversed(prefix_keys(plan)):
            found = self._prefixes.get(key)
            if found is not None and found[0] in live:
                self._prefixes.move_to_end(key)
                return {found[0].unique_id: int(found[1] * bytes_per_token(plan))}
        return {}

    def views(self, replicas: Sequence[RunningReplica]) -> list[ReplicaView]:
        now_s, views = time.time(), []
        for r in replicas:
            report = fresh_report(r.routing_stats, now_s, self._spec.stale_after_s)
            # what a newer report covers is dropped: the replica has said what it kept (LRU may have evicted it)
            since_s = report.recorded_at_s if report is not None else now_s - self._spec.stale_after_s
            sent = {h: at for h, at in self._sent.get(r.replica_id, {}).items() if at > since_s}
            self._sent[r.replica_id] = sent
            views.append(ReplicaView(r.replica_id.unique_id, self._in_flight.get(r.replica_id, 0), report,
                                     frozenset(sent)))
        return views

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        plan = None if pending_request is None else next((a for a in pending_request.args if isinstance(a, Plan)),
                                                         None)
        if plan is None or not candidate_replicas:  # not a generation request (e.g. hot_tier_stats)
            return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
        choice = choose(plan_entries(plan), self.views(candidate_replicas), self._rng,
                        max_load_ratio=self._spec.max_load_ratio, min_in_flight=self._spec.min_in_flight,
                        prefix=self.held_prefix(plan, candidate_replicas))
        self._choices[pending_request.metadata.internal_request_id] = choice
        while len(self._choices) > MAX_REMEMBERED_CHOICES:
            self._choices.popitem(last=False)
        if choice.decision is Decision.NO_STATS:
            return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[i] for i in rank] for rank in choice.ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        request_id = pending_request.metadata.internal_request_id
        self._in_flight[replica_id] = self._in_flight.get(replica_id, 0) + 1
        choice = self._choices.pop(request_id, None)
        if choice is None:
            self._routed[request_id] = (replica_id, ())
            return
        target = replica_id.unique_id
        plan = next(a for a in pending_request.args if isinstance(a, Plan))
        if plan.conversation_chain:  # its follow-up will begin with this whole conversation
            self._prefixes[prefix_keys(plan)[-1]] = (replica_id, plan.prompt_tokens)
            self._prefixes.move_to_end(prefix_keys(plan)[-1])
            while len(self._prefixes) > MAX_REMEMBERED_PREFIXES:
                self._prefixes.popitem(last=False)
        entries = plan_entries(plan)
        hashes = tuple(h for h, _ in entries)
        self._routed[request_id] = (replica_id, hashes)
        sent = self._sent.setdefault(replica_id, {})
        for hashed in hashes:
            sent[hashed] = math.inf
        self._metrics.routed.inc(target=target, decision=choice.decision.value)
        self._metrics.routed_plan_bytes.inc(sum(n for _, n in entries), target=target)
        self._metrics.routed_predicted_bytes.inc(choice.held_nbytes.get(target, 0), target=target)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        routed = self._routed.pop(internal_request_id, None)
        if routed is None:
            return
        self._in_flight[replica_id] -= 1
        sent, now_s = self._sent.get(replica_id, {}), time.time()
        for hashed in routed[1]:  # from now on a newer report says whether the replica kept them
            if hashed in sent:
                sent[hashed] = now_s

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        self._in_flight = {r: n for r, n in self._in_flight.items() if r in live}  # a removed replica's count goes
        self._routed = {q: routed for q, routed in self._routed.items() if routed[0] in live}
        self._sent = {r: sent for r, sent in self._sent.items() if r in live}
