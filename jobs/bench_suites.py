"""The table of `qvpic bench`: every benchmark module under benchmarks/, by group (tests/jobs/test_bench.py checks
that none with an entry point is left out).

A suite's `quick_argv` is what `qvpic bench` (all) passes it; None keeps it out of `all`: it is slow, needs a
service (Ray Serve, a cluster, the vLLM peer venv, a GPU), or its quick run would replace a fuller section of
docs/BENCHMARKS.md with a smaller one. Run it by name: `qvpic bench NAME [options]`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

GROUPS = {  # benchmarks/<group>/, in the order `--list` and docs/BENCHMARKS.md show them
    "perf": "speed of the engine and the serving path on this machine",
    "quality": "fidelity to full prefill, exactness, legibility",
    "scale": "large stores, replicas, clusters, load",
    "peer": "side by side with vLLM (needs the peer venv: `make peer-vllm`)",
    "tools": "what is not a benchmark",
}


@dataclass(frozen=True)
class Suite:
    name: str
    group: str  # a key of GROUPS: the package under benchmarks/ that holds the module
    module: str
    about: str
    quick_argv: tuple[str, ...] | None  # what `all` passes; None: not part of `all` (slow, or needs a service)

    @property
    def available(self) -> bool:
        return importlib.util.find_spec(self.module) is not None


def _group(group: str, *rows: tuple[str, str, str, tuple[str, ...] | None]) -> tuple[Suite, ...]:
    """Suites of benchmarks/<group>/: (name, module, about, quick argv)."""
    return tuple(Suite(name, group, f"benchmarks.{group}.{module}", about, quick)
                 for name, module, about, quick in rows)


QUICK = ("--quick",)
SUITES: tuple[Suite, ...] = (
    *_group("perf",
            ("ttft", "ttft", "TTFT per mode, breakdown, scaling, KV bytes, HTTP share", QUICK),
            ("batching", "batching", "batched vs serialised engine: tokens/s and TTFT at 1/4/16 clients, device hot "
             "tier", QUICK),
            ("structured", "structured", "json_schema, forced tool call and logprobs vs plain: decode cost per token "
             "at 1/16 clients", QUICK),
            ("runtime", "runtime", "full prefill vs query-only prefill, re-anchoring cost",
             ("--dtypes", "bfloat16", "--repeats", "3")),
            ("limits", "limits", "memory bandwidth, product rates, the engine's forwards against their bounds "
             "(bench-qwen, 7B shape)", None),
            ("threads", "threads", "which thread runs the forward: one OpenMP pool per process", None),
            ("served-stream", "served_stream", "one answer streamed through a live server: ms per token, CPU per "
             "process (Ray Serve)", None),
            ("governance", "governance", "tenant quotas, cost accounting and admission overheads", None),
            ("body-loop", "body_loop", "the ingress loop's worst stall per hostile request body, FastAPI's route "
             "against qvpic's (shape limits, charge, parsing worker)", ()),
            ("render", "render_throughput", "renderer pages/s per DPI and script", ()),
            ("compile-batch", "compile_batch", "compile chunks/s by compile batch size (a step of "
             "benchmarks/perf/gpu.sh; writes no section)", None),
            ("ingest", "ingest", "Ray Data compile throughput per model and actor count", None),
            ("kv-quant", "kv_quant", "int8 / fp8 KV entries vs unquantised: bytes, load, TTFT, fidelity", QUICK),
            ("lazy-tier", "lazy_tier", "lazy high tier: ingest saved vs first-promotion TTFT, convergence to all-hot",
             QUICK),
            ("routing", "routing", "a new query's route (embedding and the rest), follow-ups, search at 10^6 rows",
             None),
            ("gpu", "gpu", "paper-scale speed on one GPU, real-size shapes (benchmarks/perf/gpu.sh; writes gpu.md)",
             None)),
    *_group("quality",
            ("fidelity", "fidelity", "fidelity to full prefill: template vs prefix-free vs dummy prefix", None),
            ("conversation-fidelity", "conversation_fidelity", "fidelity of linked chunks inside conversations, per "
             "layout", None),
            ("recompute", "recompute", "selective recompute across chunks: fidelity gained vs TTFT (leading k, "
             "deviation r)", None),
            ("hybrid", "hybrid", "hybrid representation per chunk vs pure qvpic: tokens, evidence legibility",
             QUICK),
            ("legibility", "legibility", "OCR accuracy vs vision tokens per font size and DPI", ()),
            ("real-shapes", "real_shapes", "exactness at the real models' shapes: every case of "
             "tests/pipeline/runtime/test_real_shapes.py", None),
            ("calibration-queries", "calibration_queries", "which calibration queries predict real queries' IVF "
             "recall", QUICK)),
    *_group("scale",
            ("scale-ingest", "scale_ingest", "≥10k chunks of real text through `qvpic ingest`: rate, memory, reruns",
             None),
            ("scale-serve", "scale_serve", "router start-up, route latency, memory, recall, hot reload at 10^4..10^6 "
             "chunks", None),
            ("store-check", "store_check", "start-up parts check and `qvpic verify` cost vs parts and rows", QUICK),
            ("shard-packing", "shard_packing", "KV entries one per file vs packed, local disk and S3", QUICK),
            ("affinity", "affinity", "chunk-affinity dispatch vs Serve's default across generator replicas", None),
            ("affinity-limit", "affinity_limit", "affinity's workload replayed with exact knowledge: the policy's "
             "limit", ()),
            ("cluster", "cluster", "node loss under load and generator autoscaling on a 3-node Ray cluster", None),
            ("load", "load", "concurrent load on the Serve app: throughput, latency, failures, memory", None),
            ("fairness", "fairness", "a hostile tenant looping every cost probe beside a victim: the victim's TTFT "
             "and errors, /healthz latency (writes docs/RELIABILITY.md)", None)),
    *_group("peer",
            ("peer-vllm", "side_by_side", "TTFT and decode side by side with vLLM; --oracle: vLLM as a correctness "
             "oracle", None),
            ("conversation", "conversation", "4-turn conversations side by side with vLLM: TTFT per turn, "
             "throughput", None),
            ("engines", "engines", "vLLM alone, qvpic's engine and qvpic on vLLM in one process: TTFT on reordered, "
             "Zipf and identical requests, decode tokens/s at 16 (run by .venv-vllm/bin/python)", None),
            ("engines-http", "engines_http", "the same three sides over HTTP: vLLM's own OpenAI server, qvpic's two "
             "Serve apps; streamed TTFT per workload, decode at 16 streams (run by .venv-vllm/bin/python)", None),
            ("record-oracle", "record_oracle", "record vLLM's answers for tests/pipeline/eval/test_vllm_oracle.py",
             None)),
    *_group("tools",
            ("mutations", "mutations", "a fixed list of mutations, each against the tests meant to catch it", None),
            ("same-requests", "same_requests", "the same requests before and after a change: identical answers, TTFT "
             "within noise (store / run / compare)", None)),
)
