"""Placeholder."""

from benchmarks.gpu_check.common import Context, Record, Skip


def device_paths(ctx: Context, out: Record) -> None:
    raise Skip("not written yet")
