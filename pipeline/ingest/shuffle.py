"""The Ray Data plumbing the ingest stages and recompile share: a store table's parts as a dataset, and the
hash-partitioned shuffle that brings every row of one key into one block."""

from __future__ import annotations

from typing import Any

import ray.data

from pipeline.ingest.resources import StagePlan
from pipeline.store import Store


def shuffle(rows: ray.data.Dataset, plan: StagePlan) -> ray.data.Dataset:
    """Rows hash-partitioned on `key`: every row of one key lands in one block (Ray keeps key partitions whole)."""
    return rows.repartition(plan.num_partitions, keys=["key"])


def read_parts(store: Store, table: str, columns: list[str], plan: StagePlan,
               **options: Any) -> ray.data.Dataset | None:
    """`columns` of every part of the store's `table` (None when it has none); `options` go to read_parquet."""
    paths = store.part_paths(table)
    if not paths:
        return None
    return ray.data.read_parquet(paths, filesystem=store.blobs.fs, columns=columns, num_cpus=plan.task_cpus, **options)
