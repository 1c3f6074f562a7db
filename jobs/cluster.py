"""Connect a job to Ray: the cluster it was submitted to, else a local one sized to avoid deadlocks."""

from __future__ import annotations

import os

import ray


def init_ray(num_cpus: int | None = None, num_gpus: int | None = None, quiet: bool = True) -> None:
    """Attach to `RAY_ADDRESS` (set by `ray job submit`) or start a private local Ray.

    Locally, at least 4 logical CPUs: on a 2-core box an actor pool holding every CPU starves the
    read/write tasks and Ray Data hangs silently.
    """
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from ray.data import DataContext

    DataContext.get_current().enable_progress_bars = not quiet
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=not quiet)
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        address="local", num_cpus=num_cpus or max(4, os.cpu_count() or 1), num_gpus=num_gpus,
        include_dashboard=False, log_to_driver=not quiet, object_store_memory=512 * 1024**2,
        # Workers import our packages from the installed project; pass the env they need.
        runtime_env={"env_vars": {k: v for k, v in os.environ.items()
                                  if k.startswith(("QVPIC_", "AWS_", "HF_")) or k == "TOKENIZERS_PARALLELISM"}},
    )
