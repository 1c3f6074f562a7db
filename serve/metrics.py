"""Prometheus metrics of the serving path, recorded to two sinks at once.

- Ray (`ray.serve.metrics`): every replica's values reach the node's metrics agent, which exports them
  on the node's metrics port (`ray.nodes()[i]["MetricsExportPort"]`, fixed with
  `ray start --metrics-export-port`) with a `ray_` prefix and Serve's deployment/replica tags, about
  every 10 s. This is what a cluster's Prometheus scrapes and what docs/grafana-dashboard.json reads.
- prometheus_client: a registry local to this process, served by the ingress at `GET /metrics` in
  Prometheus text format (no prefix). It shows this replica only (the ingress's own metrics; the
  loader's corrupt-shard count lives in the loader's process) but needs no Ray, so it also works
  in-process and answers at once.

Labels never carry tenants or queries (unbounded cardinality); per-tenant attribution is the request
log's job (serve/governance/request_log.py). Metrics are created once per process, inside the replica (so Ray
adds the replica's tags): call `serve_metrics()`. A process without Ray (an engine run bare, as the device check
runs it: benchmarks/gpu_check) keeps the Prometheus sink alone.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import prometheus_client

try:
    from ray.serve import metrics as ray_metrics
except ImportError:  # no Ray in this process: the Prometheus registry alone
    ray_metrics = None


class Unsent:
    """The Ray sink of a process without Ray: each value goes to the Prometheus registry only."""

    def __init__(self, *args, **kwargs):
        pass

    def inc(self, *args, **kwargs) -> None:
        pass

    observe = set = inc


def ray_metric(kind: str):
    return getattr(ray_metrics, kind) if ray_metrics is not None else Unsent

MS_BUCKETS = (1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0, 30000.0, 60000.0)
TOKEN_BUCKETS = tuple(float(2**p) for p in range(6, 18))  # 64 .. 131072 context tokens


class Counter:
    def __init__(self, name: str, description: str, labels: Sequence[str],
                 registry: prometheus_client.CollectorRegistry):
        self.name, self.labels = name, tuple(labels)
        self._ray = ray_metric("Counter")(name, description=description, tag_keys=self.labels)
        self._prom = prometheus_client.Counter(name, description, self.labels, registry=registry)

    def inc(self, value: float = 1.0, **labels: str) -> None:
        if value <= 0:
            return  # Ray rejects zero increments; Prometheus counters never go down
        self._ray.inc(value, tags=labels)
        (self._prom.labels(**labels) if self.labels else self._prom).inc(value)


class Histogram:
    def __init__(self, name: str, description: str, labels: Sequence[str], buckets: Sequence[float],
                 registry: prometheus_client.CollectorRegistry):
        self.name, self.labels = name, tuple(labels)
        self._ray = ray_metric("Histogram")(name, description=description, boundaries=list(buckets),
                                            tag_keys=self.labels)
        self._prom = prometheus_client.Histogram(name, description, self.labels, buckets=buckets, registry=registry)

    def observe(self, value: float, **labels: str) -> None:
        self._ray.observe(value, tags=labels)
        (self._prom.labels(**labels) if self.labels else self._prom).observe(value)


class Gauge:
    def __init__(self, name: str, description: str, registry: prometheus_client.CollectorRegistry):
        self.name, self.labels = name, ()
        self._ray = ray_metric("Gauge")(name, description=description)
        self._prom = prometheus_client.Gauge(name, description, registry=registry)

    def set(self, value: float) -> None:
        self._ray.set(value)
        self._prom.set(value)


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = prometheus_client.CollectorRegistry()

        def counter(name: str, description: str, *labels: str) -> Counter:
            return Counter(name, description, labels, self.registry)

        def histogram(name: str, description: str, buckets: Sequence[float], *labels: str) -> Histogram:
            return Histogram(name, description, labels, buckets, self.registry)

        def gauge(name: str, description: str) -> Gauge:
            return Gauge(name, description, self.registry)

        self.requests = counter("qvpic_requests", "Governed requests received, by route and mode", "route", "mode")
        self.errors = counter("qvpic_errors", "Responses with an error status, by route and status", "route", "status")
        self.ttft_ms = histogram("qvpic_ttft_ms", "Time to first answer token at the ingress (ms)", MS_BUCKETS,
                                 "mode", "cache")
        self.latency_ms = histogram("qvpic_latency_ms", "End-to-end latency at the ingress (ms)", MS_BUCKETS,
                                    "mode", "cache")
        self.context_tokens = histogram("qvpic_context_tokens", "Context tokens of each answer the model computed",
                                        TOKEN_BUCKETS, "mode")
        self.chunks = counter("qvpic_chunks", "Chunks placed in computed answers, by mode and tier", "mode", "tier")
        self.promotions = counter("qvpic_promotions", "Chunks the qvpic router promoted to the highest tier")
        self.kv_lookups = counter("qvpic_kv_cache_lookups", "KV entries looked up in the loader's LRU", "outcome")
        self.kv_tier_hits = counter("qvpic_kv_tier_hits", "Linked KV entries by the tier that served them: device "
                                    "(the generator's hot tier), host (the loader's LRU) or store", "tier")
        self.hot_tier_entries = counter("qvpic_hot_tier_entries", "Linked KV entries the generator's device hot tier "
                                        "was asked for, by outcome (hit or miss); per replica by Ray's replica tag",
                                        "outcome")
        self.hot_tier_bytes = counter("qvpic_hot_tier_bytes", "Device bytes of hot-tier hits, and of the misses it "
                                      "then took in, by outcome (hit or miss)", "outcome")
        self.routed = counter("qvpic_routed_requests", "Generator requests the chunk-affinity router sent, by target "
                              "replica and decision: affinity (most resident bytes under the load cap), cold (no "
                              "replica holds any: power of two choices), no_stats (none fresh: power of two choices)",
                              "target", "decision")
        self.routed_plan_bytes = counter("qvpic_routed_plan_bytes", "Stored bytes of the entries of the plans sent "
                                         "to each generator replica", "target")
        self.routed_predicted_bytes = counter("qvpic_routed_predicted_hit_bytes", "Of those, the bytes the router "
                                              "predicted the replica's hot tier held (its reported key sketch)",
                                              "target")
        self.kv_loaded_bytes = counter("qvpic_kv_loaded_bytes", "Bytes of KV read from the store (LRU misses)")
        self.corrupt_shards = counter("qvpic_corrupt_shards",
                                      "KV entries whose shard was missing or failed its checksum")
        self.kv_recompiles = counter("qvpic_kv_recompiles", "Unreadable KV entries by what the generator did: "
                                     "recompiled, backup (a lower tier) or unservable (503); a lazily compiled "
                                     "tier's pending entries: lazy_compiled or lazy_stored (found written back)",
                                     "outcome")
        self.engine_running = gauge("qvpic_engine_running", "Requests decoding in the generator's batch")
        self.engine_waiting = gauge("qvpic_engine_waiting", "Requests queued for a row of the generator's batch")
        self.engine_kv_bytes = gauge("qvpic_engine_kv_bytes", "Bytes of the generator's batch KV slab")
        self.engine_ended = counter("qvpic_engine_requests_ended", "Generator requests by how they ended: stop, "
                                    "length, cancelled (client gone), deadline or failed", "end")
        self.prefix_cache_device_nbytes = gauge("qvpic_prefix_cache_device_bytes", "Device bytes of the generator's "
                                                "prefix KV cache")
        self.prefix_cache_host_nbytes = gauge("qvpic_prefix_cache_host_bytes", "Host bytes of the generator's prefix "
                                              "KV cache (blocks the device tier evicted)")
        self.prefix_cache_tokens = counter("qvpic_prefix_cache_tokens", "Prompt tokens of linked requests by where "
                                           "their KV came from: hit (the prefix cache) or computed", "outcome")
        self.prefix_cache_evictions = gauge("qvpic_prefix_cache_evicted_blocks", "Prefix-cache blocks dropped "
                                            "since the replica started (host tier full, or none)")
        # by call (route, embed: the router's; generate, stream: the generator's): Ray reserves the `deployment` tag
        self.replica_retries = counter("qvpic_replica_retries", "Calls the ingress made again because the replica "
                                       "serving them died under them (its node lost, its process killed), by call; "
                                       "a stream only before its first event", "call")
        self.tier_fallbacks = counter("qvpic_tier_fallbacks", "Chunks served from a lower tier than planned")
        self.response_cache = counter("qvpic_response_cache", "Response-cache outcome per request "
                                      "(l1/l2/l3 hit, miss, bypass: nothing cacheable, e.g. sampled; no_cache: the "
                                      "request's Cache-Control asked for a computed answer)", "result")
        self.budget_rejections = counter("qvpic_budget_rejections",
                                         "Requests over their token budget (413; 400 for max_tokens)")
        self.rate_limit_rejections = counter("qvpic_rate_limit_rejections", "Requests over a tenant rate (429)",
                                             "limit")
        self.shared_state_errors = counter("qvpic_shared_state_errors", "Redis calls that failed and degraded", "use")
        self.request_log_rows = counter("qvpic_request_log_rows", "Request-log rows written or lost", "outcome")

    def families(self) -> list[Counter | Histogram | Gauge]:
        return [m for m in vars(self).values() if isinstance(m, (Counter, Histogram, Gauge))]

    def exposition(self) -> bytes:
        """This process's metrics in Prometheus text format."""
        return prometheus_client.generate_latest(self.registry)


@functools.cache
def serve_metrics() -> ServeMetrics:
    """The process's metrics, created on first use (Ray's metric objects must not be created twice)."""
    return ServeMetrics()


CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
