"""`qvpic serve` (also `python -m jobs.run_server`): run the Serve application over a store.

Arguments come from flags, or from a Serve config file (`--config serve/config.yaml`: its first
application's `args`) with flags overriding it. Without `--address` a local Ray is started and
stopped with this process; with one (e.g. `auto`) the app is deployed onto that cluster, and
`--detach` returns as soon as it is healthy, leaving it running there.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from schemas.config import DType

DEFAULT_PORT = 8000
APP_NAME = "qvpic"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qvpic serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, help="Serve config YAML whose first application's args are the base")
    p.add_argument("--store", help="store URI: a directory, s3://bucket/prefix, or any pyarrow filesystem URI")
    p.add_argument("--endpoint-url", help="S3-compatible endpoint for an s3:// store")
    p.add_argument("--model", help="checkpoint directory or built-in name (tiny-qwen, tiny-glm, bench-qwen, bench-glm)")
    p.add_argument("--revision")
    p.add_argument("--dtype", choices=[d.value for d in DType])
    p.add_argument("--device", help="auto (cuda when present), cpu, cuda, cuda:1 ...")
    p.add_argument("--tau", type=float, help="default cumulative relevance share promoted to the high tier")
    p.add_argument("--max-high-res", type=int, help="default budget B of promoted chunks")
    p.add_argument("--cache-nbytes", type=int, help="host-memory KV cache per loader replica, bytes")
    p.add_argument("--max-chunks", type=int, help="most chunks one request may put in context")
    p.add_argument("--max-context-tokens", type=int, help="context limit (default: the model's)")
    p.add_argument("--top-k", type=int, help="chunks retrieved for chat requests that name none")
    p.add_argument("--served-model-name", help="model id of /v1/models and chat requests")
    p.add_argument("--generator-gpus", type=float, help="GPUs per generator replica")
    p.add_argument("--generator-replicas", type=int, help="generator replicas")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--address", help="Ray cluster to deploy onto (e.g. auto); default: start a local one")
    p.add_argument("--num-cpus", type=int, help="logical CPUs of the local Ray (default: Ray's own count)")
    p.add_argument("--detach", action="store_true", help="return once deployed (needs --address)")
    return p


def _set(tree: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for key in parents:
        tree = tree.setdefault(key, {})
    tree[leaf] = value


def app_args(ns: argparse.Namespace):
    """The AppArgs the flags (over the config file, when given) describe."""
    from serve.app import AppArgs

    args: dict[str, Any] = {}
    if ns.config is not None:
        applications = (yaml.safe_load(ns.config.read_text()) or {}).get("applications") or [{}]
        args = dict(applications[0].get("args") or {})
    flags = {"store.uri": ns.store, "store.endpoint_url": ns.endpoint_url, "model.path": ns.model,
             "model.revision": ns.revision, "model.dtype": ns.dtype, "model.device": ns.device, "router.tau": ns.tau,
             "router.max_high_res": ns.max_high_res, "cache_max_nbytes": ns.cache_nbytes, "max_chunks": ns.max_chunks,
             "max_context_tokens": ns.max_context_tokens, "default_top_k": ns.top_k,
             "served_model_name": ns.served_model_name, "generator_deployment.num_gpus": ns.generator_gpus,
             "generator_deployment.num_replicas": ns.generator_replicas}
    for path, value in flags.items():
        if value is not None:
            _set(args, path, value)
    return AppArgs.model_validate(args)


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    if ns.detach and ns.address is None:
        print("qvpic serve: --detach needs --address (a local Ray ends with this process)", file=sys.stderr)
        return 2
    try:
        args = app_args(ns)
    except (ValidationError, OSError, yaml.YAMLError) as error:
        print(f"qvpic serve: invalid arguments: {error}", file=sys.stderr)
        return 2

    import ray
    from ray import serve

    from serve.app import build_app

    try:
        application = build_app(args)  # checks the store against the model before anything starts
    except ValueError as error:  # StoreError, ManifestError: a clear message, not a traceback
        print(f"qvpic serve: {error}", file=sys.stderr)
        return 2
    stop = threading.Event()  # set by SIGINT/SIGTERM, also while starting up
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    ray.init(address=ns.address or "local", num_cpus=ns.num_cpus if ns.address is None else None)
    serve.start(http_options={"host": ns.host, "port": ns.port})
    serve.run(application, name=APP_NAME, route_prefix="/")
    print(f"qvpic: serving {args.store.uri} at http://{ns.host}:{ns.port} (OpenAPI: /docs)", flush=True)
    if ns.detach:
        return 0
    while not stop.wait(1.0):
        pass
    serve.delete(APP_NAME)  # then the local Ray, if this process started it, ends with the process
    return 0


if __name__ == "__main__":
    sys.exit(main())
