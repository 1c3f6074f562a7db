"""`qvpic serve` (also `python -m jobs.run_server`): run the Serve application over a store.

Arguments come from flags, or from a Serve config file (`--config serve/config.yaml`: its first
application's `args`) with flags overriding it. Without `--address` a local Ray is started and
stopped with this process; with one (e.g. `auto`) the app is deployed onto that cluster, and
`--detach` returns as soon as it is healthy, leaving it running there.

While deploying it prints what each pending deployment waits for; on a local Ray, a deployment that
no node can host (a GPU generator on a CPU-only machine) is an error at once (exit 2), not a hang.
SIGTERM or SIGINT (what systemd, Kubernetes and Ctrl-C send) drains: the application is deleted, each
replica finishes its in-flight requests for up to `--drain-timeout-s`, then the process exits 0.
A second signal stops at once (exit 1).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from jobs import logs
from jobs.cluster import workers_at_niceness_0
from jobs.help import HelpFormatter
from schemas.config import DType, EngineKind, RecomputeKind

DEFAULT_PORT = 8000
APP_NAME = "qvpic"
QUIET_START_S = 10.0  # a deploy that takes longer reports what it waits for


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qvpic serve", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--config", type=Path, help="Serve config YAML whose first application's args are the base")
    p.add_argument("--store", help="store URI: a directory, s3://bucket/prefix, or any pyarrow filesystem URI")
    p.add_argument("--endpoint-url", help="S3-compatible endpoint for an s3:// store")
    p.add_argument("--model", help="checkpoint directory or built-in name (tiny-qwen, tiny-glm, bench-qwen, bench-glm)")
    p.add_argument("--revision")
    p.add_argument("--dtype", choices=[d.value for d in DType])
    p.add_argument("--device", help="auto (cuda when present), cpu, cuda, cuda:1 ...")
    p.add_argument("--tau", type=float, help="default cumulative relevance share promoted to the high tier")
    p.add_argument("--max-high-res", type=int, help="default budget B of promoted chunks")
    p.add_argument("--hybrid", action="store_true", default=None,
                   help="qvpic mode serves a chunk as its text entry where text is cheaper than its pages, or its "
                        "pages scored illegible at ingest (`qvpic ingest --legibility`)")
    p.add_argument("--images-root", help="absolute directory scanned page images are read from; a stored image_path "
                   "outside it is refused unread (default: none is read)")
    p.add_argument("--hmac-key-file", help="serve only generations sealed with the HMAC key in this file (on every "
                   "router host; unset: QVPIC_HMAC_KEY if set, else seals are not checked). docs/SECURITY.md")
    p.add_argument("--cache-nbytes", type=int, help="host-memory KV cache per loader replica, bytes")
    p.add_argument("--max-chunks", type=int, help="most chunks one request may put in context")
    p.add_argument("--max-context-tokens", type=int, help="context limit (default: the model's)")
    p.add_argument("--top-k", type=int, help="chunks retrieved for chat requests that name none")
    p.add_argument("--served-model-name", help="model id of /v1/models and chat requests")
    p.add_argument("--generator-gpus", type=float, help="GPUs per generator replica")
    p.add_argument("--generator-replicas", type=int, help="generator replicas (fixed: drops the config's autoscaling)")
    p.add_argument("--engine", choices=[k.value for k in EngineKind],
                   help="what runs the generators' forwards: qvpic (its own engine, the default) or vllm (vLLM's "
                        "engine with qvpic's KV connector; needs vllm installed: docs/DEPLOY.md, Engines)")
    p.add_argument("--max-batch-size", type=int, help="requests decoded together in one forward pass per generator")
    p.add_argument("--forward-threads", type=int,
                   help="torch threads of each generator replica (default: its num_cpus rounded up; a local CPU run "
                        "without --config: this machine's cores over the generator replicas)")
    p.add_argument("--request-timeout-s", type=float, help="deadline of a request that sets none (504 past it)")
    p.add_argument("--recompute", choices=[k.value for k in RecomputeKind],
                   help="selective recompute of linked chunks before the query: leading (EPIC: the first "
                        "--recompute-tokens of every chunk) or deviation (CacheBlend: the --recompute-fraction of "
                        "each chunk's tokens whose layer-1 KV deviate most); default none")
    p.add_argument("--recompute-tokens", type=int, help="leading recompute: tokens per chunk (default 16)")
    p.add_argument("--recompute-fraction", type=float, help="deviation recompute: share of each chunk's tokens, "
                                                            "in (0, 1] (default 0.15)")
    p.add_argument("--router-search-threads", type=int,
                   help="threads one query's exhaustive vector scan may use (its index files scanned in parallel)")
    p.add_argument("--host", help="interface to listen on (default: the --config file's http_options.host, else "
                                  "127.0.0.1; 0.0.0.0: every interface, which needs API keys or --insecure-no-auth)")
    p.add_argument("--insecure-no-auth", action="store_true", default=None,
                   help="listen beyond loopback with no API keys configured (development only; warned at every start)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP port")
    p.add_argument("--address", help="Ray cluster to deploy onto (e.g. auto); default: start a local one")
    p.add_argument("--num-cpus", type=int, help="logical CPUs of the local Ray (default: Ray's own count)")
    p.add_argument("--detach", action="store_true", help="return once deployed (needs --address)")
    p.add_argument("--proxy-location", choices=["EveryNode", "HeadOnly"],
                   help="Serve's HTTP proxies: on every node, or the head only (default: the --config file's, "
                        "else HeadOnly, as serve/config-gpu.yaml). HeadOnly: a worker node that dies resets no client "
                        "connection")
    p.add_argument("--drain-timeout-s", type=float,
                   help="on SIGTERM, how long replicas finish in-flight requests (default 20; keep it under the "
                        "supervisor's kill timeout: Kubernetes' terminationGracePeriodSeconds, systemd's "
                        "TimeoutStopSec)")
    logs.add_verbose_flag(p)
    return p


def _set(tree: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for key in parents:
        tree = tree.setdefault(key, {})
    tree[leaf] = value


def local_forward_threads(ns: argparse.Namespace) -> int | None:
    """A local CPU run without a config file: the machine's cores shared among the generator replicas (their
    default 0.1-CPU reservation would run each forward on one thread). None otherwise: the reservation decides."""
    if ns.address is not None or ns.config is not None or ns.generator_gpus:
        return None
    return max(1, len(os.sched_getaffinity(0)) // (ns.generator_replicas or 1))


def app_args(ns: argparse.Namespace):
    """The AppConfig the flags (over the config file, when given) describe."""
    from serve.config import AppConfig

    args: dict[str, Any] = {}
    if ns.config is not None:
        applications = (yaml.safe_load(ns.config.read_text()) or {}).get("applications") or [{}]
        args = dict(applications[0].get("args") or {})
    flags = {"store.uri": ns.store, "store.endpoint_url": ns.endpoint_url, "model.path": ns.model,
             "model.revision": ns.revision, "model.dtype": ns.dtype, "model.device": ns.device,
             "router.defaults.tau": ns.tau, "router.defaults.max_high_res": ns.max_high_res,
             "router.defaults.hybrid.enabled": ns.hybrid, "router.max_chunks": ns.max_chunks,
             "router.max_context_tokens": ns.max_context_tokens, "router.scan.search_threads": ns.router_search_threads,
             "loader.max_nbytes": ns.cache_nbytes, "generator.engine.max_batch_size": ns.max_batch_size,
             "generator.engine.kind": ns.engine,
             "generator.engine.forward.threads": ns.forward_threads or local_forward_threads(ns),
             "generator.recompute.kind": ns.recompute, "generator.recompute.leading_num_tokens": ns.recompute_tokens,
             "generator.recompute.deviation_fraction": ns.recompute_fraction,
             "ingress.default_top_k": ns.top_k, "ingress.served_model_name": ns.served_model_name,
             "ingress.request_timeout_s": ns.request_timeout_s, "generator_deployment.num_gpus": ns.generator_gpus,
             "generator_deployment.num_replicas": ns.generator_replicas, "drain_timeout_s": ns.drain_timeout_s,
             "ingress.governance.auth.insecure_no_auth": ns.insecure_no_auth, "images_root": ns.images_root,
             "hmac_key_file": ns.hmac_key_file}
    for path, value in flags.items():
        if value is not None:
            _set(args, path, value)
    if ns.generator_replicas is not None:  # a fixed count replaces the file's autoscaling
        args["generator_deployment"].pop("autoscaling_config", None)
    return AppConfig.model_validate(args)


def _file_config(ns: argparse.Namespace) -> dict[str, Any]:
    return (yaml.safe_load(ns.config.read_text()) or {}) if ns.config is not None else {}


def proxy_location(ns: argparse.Namespace) -> str:
    if ns.proxy_location is not None:
        return ns.proxy_location
    return _file_config(ns).get("proxy_location", "HeadOnly")  # serve/config-gpu.yaml's: HTTP beside the ingress


def http_host(ns: argparse.Namespace) -> str:
    """The flag's, else the config file's `http_options.host`, else loopback: the file and the CLI agree."""
    if ns.host is not None:
        return ns.host
    return (_file_config(ns).get("http_options") or {}).get("host") or "127.0.0.1"


class Stopped(BaseException):
    """A second stop signal: stop without draining (raised from the handler, so it interrupts any wait)."""


class StopSignals:
    """SIGINT and SIGTERM: the first sets `requested`, which the main thread waits on; a second raises Stopped."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.name = ""

    def __call__(self, signum: int, _frame) -> None:
        if self.requested.is_set():
            raise Stopped(signal.Signals(signum).name)
        self.name = signal.Signals(signum).name
        self.requested.set()

    def install(self) -> None:
        """Call it again after `ray.init`: Ray's driver replaces the SIGTERM handler with one that aborts
        the process (the `Aborted` that a plain `kill` used to end `qvpic serve` with)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self)

    @staticmethod
    def restore() -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def deploy(application, local: bool, stop: StopSignals, poll_s: float = 2.0) -> bool:
    """Deploy and wait until every deployment runs (True) or a stop is requested (False), reporting what
    each pending deployment waits for. Raises RuntimeError when the deploy fails, or when this local Ray
    has no node that can host a deployment (nothing will ever join it)."""
    from ray import serve

    from serve.http import fetch_readiness

    serve.run_many([serve.RunTarget(application, name=APP_NAME, route_prefix="/")],
                   wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
    reported, started = "", time.monotonic()
    while not stop.requested.wait(poll_s):
        report = fetch_readiness(APP_NAME)
        if report.ready:
            return True
        unplaceable = [f"{d.name}: {d.reason}" for d in report.deployments if d.unplaceable]
        if report.status == "DEPLOY_FAILED" or (local and unplaceable):
            cause = "; ".join(unplaceable) if local and unplaceable else report.detail
            hint = (" (lower the deployment's resources, e.g. --generator-gpus 0, or run where they exist)"
                    if local and unplaceable else "")
            raise RuntimeError(f"cannot deploy: {cause}{hint}")
        if report.pending and report.detail != reported and time.monotonic() - started > QUIET_START_S:
            reported = report.detail or ""
            print(f"qvpic serve: waiting for {', '.join(report.pending)}: {reported}", file=sys.stderr, flush=True)
    return False


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    logs.configure(ns.verbose, native_to_file=False)  # no Ray Data here: native lines are about signals, crashes
    if ns.detach and ns.address is None:
        print("qvpic serve: --detach needs --address (a local Ray ends with this process)", file=sys.stderr)
        return 2
    try:
        args = app_args(ns)
        ns.host = http_host(ns)
    except (ValidationError, OSError, yaml.YAMLError) as error:
        print(f"qvpic serve: invalid arguments: {error}", file=sys.stderr)
        return 2
    from serve.governance.auth import exposure

    try:
        warning = exposure(ns.host, args.ingress.governance.auth)
    except ValueError as error:
        print(f"qvpic serve: {error}", file=sys.stderr)
        return 2
    if warning:
        print(f"qvpic serve: {warning}", file=sys.stderr, flush=True)

    import ray
    from ray import serve

    from pipeline.store import Store
    from serve.app import build_app

    try:
        application = build_app(args)  # checks the store against the model before anything starts
        kv_format = Store.open(args.store).load_manifest_or_raise().kv_quant.value  # the store's, not a flag
    except ValueError as error:  # StoreError, ManifestError: a clear message, not a traceback
        print(f"qvpic serve: {error}", file=sys.stderr)
        return 2
    stop = StopSignals()
    stop.install()
    try:
        verbose = logs.is_verbose()
        if ns.address is None:
            workers_at_niceness_0()
        ray.init(address=ns.address or "local", num_cpus=ns.num_cpus if ns.address is None else None,
                 log_to_driver=verbose, logging_level=logging.INFO if verbose else logging.WARNING)
        logs.quiet_libraries()  # Serve's driver-side logger, configured on import (replicas log to Ray's files)
        stop.install()
        if not stop.requested.is_set():
            serve.start(proxy_location=proxy_location(ns), http_options={"host": ns.host, "port": ns.port})
            if deploy(application, ns.address is None, stop):
                stop_hint = "" if ns.detach else "; Ctrl-C stops it"
                print(f"qvpic: serving {args.store.uri} (KV {kv_format}) at http://{ns.host}:{ns.port} "
                      f"(OpenAPI: /docs; inspector: http://{ns.host}:{ns.port}/ui){stop_hint}",
                      flush=True)
                if ns.detach:
                    return 0
                stop.requested.wait()
            # Serve stops routing to the application; each replica finishes its in-flight requests (for up to
            # drain_timeout_s, its graceful_shutdown_timeout_s) before it stops.
            print(f"qvpic serve: {stop.name}: draining in-flight requests (up to {args.drain_timeout_s:g} s; "
                  "a second signal stops at once)", file=sys.stderr, flush=True)
            serve.delete(APP_NAME)
        print("qvpic serve: stopped", file=sys.stderr, flush=True)
        return 0
    except RuntimeError as error:
        print(f"qvpic serve: {error}", file=sys.stderr, flush=True)
        return 2
    except Stopped as second:
        print(f"qvpic serve: {second} again: stopping without draining", file=sys.stderr, flush=True)
        return 1
    finally:
        if ns.address is None and ray.is_initialized():
            ray.shutdown()  # the local Ray this process started
        stop.restore()


if __name__ == "__main__":
    logs.as_program()
    sys.exit(main())
