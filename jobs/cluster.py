"""Connect a job to Ray: the cluster it was submitted to, else a local one sized to avoid deadlocks."""

from __future__ import annotations

import logging
import os

from jobs import logs
from pipeline.priority import RAY_WORKER_NICENESS_ENV

# Environment a local Ray's workers need from the driver: our settings, S3 credentials, offline hubs.
WORKER_ENV_PREFIXES = ("QVPIC_", "AWS_", "HF_", "TRANSFORMERS_")


def workers_at_niceness_0() -> None:
    """Before starting a local Ray: its raylet starts every worker at niceness 0, not Ray's default 15. qvpic's roles
    run work whose size a client chooses BULK_NICE (10) steps lower (pipeline/priority.py); from 15 that step stops at
    19, CFS weights 36 against 15 instead of 1,024 against 110, and another tenant's question barely gets the cores
    first (issue 60). 0 is what Ray's own job supervisor gives drivers. A cluster sets it on its nodes (cluster.yaml,
    serve/rayservice.yaml); a value already in the environment is kept."""
    os.environ.setdefault(RAY_WORKER_NICENESS_ENV, "0")


def init_ray(num_cpus: int | None = None, num_gpus: int | None = None, quiet: bool = True) -> None:
    """Attach to `RAY_ADDRESS` (set by `ray job submit`) or start a private local Ray.

    `quiet`: no Ray Data progress bars (a job that prints JSON, or one with progress bars of its own).
    Ray's own log lines, and its workers' output, reach the terminal only when `jobs.logs` is verbose.
    Locally, at least 4 logical CPUs: on a 2-core box an actor pool holding every CPU starves the
    read/write tasks and Ray Data hangs silently.
    """
    import ray
    from ray.data import DataContext

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    verbose = logs.is_verbose()
    context = DataContext.get_current()
    context.enable_progress_bars = not quiet
    context.enable_operator_progress_bars = verbose  # quiet: one bar per Ray Data execution, not one per operator
    if not verbose:
        from ray.util.debug import log_once

        # Bars we turned off on purpose: skip Ray Data's warnings about them (each is logged once per process)
        log_once("ray_data_progress_manager_disabled" if quiet else "ray_data_progress_manager_global")
    options = {"log_to_driver": verbose, "logging_level": logging.INFO if verbose else logging.WARNING}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(**options)
    else:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        workers_at_niceness_0()
        ray.init(
            address="local", num_cpus=num_cpus or max(4, os.cpu_count() or 1), num_gpus=num_gpus,
            include_dashboard=False, object_store_memory=512 * 1024**2, **options,
            # Workers import our packages from the installed project; pass the env they need.
            runtime_env={"env_vars": {k: v for k, v in os.environ.items()
                                      if k.startswith(WORKER_ENV_PREFIXES) or k == "TOKENIZERS_PARALLELISM"}},
        )
    logs.quiet_libraries()  # Ray (re)configured its loggers and warning filters on import and init
