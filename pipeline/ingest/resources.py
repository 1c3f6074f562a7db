"""What the ingest and recompile pipelines ask Ray for, sized to what the cluster has free.

A job that shares its cluster with a Serve app (or anything else holding CPUs) must never wait forever
for a CPU: Ray Data's shuffle tasks ask for a whole CPU each (fixed by Ray), and an actor pool that takes
the rest starves them silently. So before a job starts, its stage actors' CPU requests are scaled to fit
beside one free CPU for tasks, pools start at one actor and grow only into what frees up, and if even
that does not fit within `wait_s`, the job fails at once with a message naming what it needs, what the
cluster has free and who holds the rest. GPUs are left to Ray (an autoscaler adds GPU nodes for the
compile actors it sees pending); a job that stalls for any reason — a GPU that never comes — fails
once no block has moved for `stall_timeout_s` (Ray Data's own report) instead of hanging.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from pydantic import Field

from schemas.frozen import Frozen

TASK_CPUS = 1.0  # Ray Data's shuffle map and reduce tasks each take one CPU; not configurable
MIN_ACTOR_CPUS = 0.01
_POLL_S = 1.0


class ResourceError(RuntimeError):
    """The cluster cannot give a job what it needs to make progress."""


class CompileResources(Frozen):
    """The compile actor pool: one VLM per actor; GPUs per actor 0 = CPU; `batch_size` chunks per forward."""

    workers: int = Field(1, ge=1)
    gpus_per_worker: float = Field(0.0, ge=0)
    cpus_per_worker: float = Field(1.0, gt=0)
    batch_size: int = Field(8, ge=1)


class JobResources(Frozen):
    """What an offline job (ingest, recompile) asks of the cluster, and how long it waits: the fields both
    job configs share."""

    resources: CompileResources = CompileResources()
    resource_wait_s: float = Field(60.0, ge=0)  # how long to wait for the cluster to free what the job needs
    stall_timeout_s: float = Field(1800.0, gt=0)  # a job in which no block moves for this long fails instead of hanging


@dataclass(frozen=True)
class StagePlan:
    """Per-stage requests: tasks take `task_cpus`; each actor pool starts at one actor."""

    task_cpus: float
    chunk_cpus: float
    render_cpus: float
    embed_cpus: float
    compile_cpus: float
    compile_gpus: float
    compile_workers: int
    pool_max: int  # chunk / render / embed pools grow up to this many actors
    cpu_budget: float | None  # what the job may hold at once; None: the whole (autoscaling) cluster
    num_partitions: int  # of each shuffle

    def apply(self, stall_timeout_s: float) -> None:
        """Bound Ray Data to the budget, and make a stall an error rather than a hang."""
        from ray.data import DataContext, ExecutionResources  # here: `--help` reads this module's defaults

        ctx = DataContext.get_current()
        ctx.execution_options.resource_limits = ExecutionResources(cpu=self.cpu_budget)
        ctx.execution_no_progress_timeout_s = stall_timeout_s


def plan_stages(resources: CompileResources, wait_s: float,
                stages: tuple[str, ...] = ("chunk", "render", "embed")) -> StagePlan:
    """The requests of a pipeline with `stages` actor pools (besides compile) on this cluster now."""
    import ray

    want = {"chunk": 0.25, "render": 0.5, "embed": 0.5}
    want = {name: want[name] for name in stages} | {"compile": resources.cpus_per_worker}
    total = ray.cluster_resources()
    deadline = time.monotonic() + wait_s
    while True:  # GPUs are left to Ray: an autoscaler adds GPU nodes for pending actors; CPUs are ours to size
        free = ray.available_resources()
        free_cpus, free_gpus = free.get("CPU", 0.0), free.get("GPU", 0.0)
        scale = min(1.0, (free_cpus - TASK_CPUS) / sum(want.values()))
        if scale * min(want.values()) >= MIN_ACTOR_CPUS:
            break
        if time.monotonic() >= deadline:
            raise ResourceError(_shortage(want, resources, free_cpus, free_gpus, total, wait_s))
        time.sleep(_POLL_S)
    cpus = {name: max(MIN_ACTOR_CPUS, round(v * scale, 3)) for name, v in want.items()}
    # Pools grow only while every actor they may start still leaves a CPU for the shuffle tasks.
    others = sum(v for name, v in cpus.items() if name != "compile")
    room = free_cpus - TASK_CPUS - cpus["compile"] * resources.workers
    return StagePlan(
        task_cpus=min(0.25, max(MIN_ACTOR_CPUS, free_cpus - TASK_CPUS - sum(cpus.values()))),
        chunk_cpus=cpus.get("chunk", 0.0), render_cpus=cpus.get("render", 0.0), embed_cpus=cpus.get("embed", 0.0),
        compile_cpus=cpus["compile"], compile_gpus=resources.gpus_per_worker, compile_workers=resources.workers,
        pool_max=max(1, min(4, int(room // others) if others else 1)), cpu_budget=free_cpus if scale < 1 else None,
        num_partitions=max(1, min(16, int(total.get("CPU", 1)))),
    )


def _shortage(want: dict[str, float], resources: CompileResources, free_cpus: float, free_gpus: float,
              total: dict[str, float], wait_s: float) -> str:
    needs = f"{TASK_CPUS + len(want) * MIN_ACTOR_CPUS:g} CPU ({TASK_CPUS:g} for Ray Data's shuffle tasks, " \
            f"a sliver for each of its {len(want)} stage actors)"
    return (f"this job needs at least {needs} free to make progress, but after {wait_s:.0f} s the cluster still "
            f"has {free_cpus:g} of {total.get('CPU', 0.0):g} CPUs and {free_gpus:g} of {total.get('GPU', 0.0):g} "
            f"GPUs free{_holders()}. Free some (scale the Serve app down, or give it fractional "
            "`num_cpus`), add a node, or run the job on its own cluster.")


def _holders() -> str:
    """`; held by: ServeReplica:app:Generator ×2, …` from the live actors, when Ray can list them."""
    try:
        from ray._private import state  # no public API lists actors without the dashboard

        names = Counter(a.get("ActorClassName", "?") for a in state.actors().values() if a.get("State") == "ALIVE")
    except Exception:  # noqa: BLE001  a hint only: the message stands without it
        return ""
    if not names:
        return ""
    return "; live actors: " + ", ".join(f"{n} ×{c}" for n, c in names.most_common(8))
