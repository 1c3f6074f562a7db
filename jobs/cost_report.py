"""`qvpic cost-report`: who spent what, from the serving request log (serve/governance/request_log.py).

    qvpic cost-report --log /var/log/qvpic/requests
    qvpic cost-report --log s3://bucket/qvpic/requests --endpoint-url http://minio:9000 --since 2026-01-01

Prints one table per tenant and one per (tenant, task type), and writes a PNG bar chart. Tokens by
kind count model work: answers the model computed (status < 400, not from the response cache).
Tokens of answers the response cache served are shown apart as "saved". Estimates cost nothing and
count as requests only.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from jobs.help import HelpFormatter

if TYPE_CHECKING:  # pyarrow (and pandas under it) is imported where used: `--help` answers at once
    import pyarrow as pa

    from schemas.store import StoreSpec

TOKEN_KINDS = ("vision_tokens", "text_tokens", "query_tokens", "completion_tokens")
NO_TASK = "-"
COLUMNS = ("requests", "errors", "cache_hits", *TOKEN_KINDS, "computed_tokens", "saved_tokens", "p50_ms")
HEADERS = {"task_type": "task", "requests": "reqs", "errors": "errors", "cache_hits": "cache hits",
           "vision_tokens": "vision", "text_tokens": "text", "query_tokens": "query", "completion_tokens": "completion",
           "computed_tokens": "computed", "saved_tokens": "saved", "p50_ms": "p50 ms"}


class EmptyLogError(ValueError):
    """No request-log rows where the report was asked to look."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qvpic cost-report", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--log", required=True, help="request-log location: a directory or s3://bucket/prefix")
    p.add_argument("--endpoint-url", help="S3-compatible endpoint for an s3:// log")
    p.add_argument("--since", type=datetime.fromisoformat, help="only requests at or after this ISO time (UTC)")
    p.add_argument("--chart", type=Path, default=Path("cost-report.png"), help="PNG to write")
    p.add_argument("--json", action="store_true", help="print the per-(tenant, task) rows as JSON instead of tables")
    return p


def load_log(spec: StoreSpec, since: datetime | None = None) -> pa.Table:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    from pipeline.store import resolve_filesystem
    from serve.governance import REQUEST_LOG_SCHEMA

    fs, root = resolve_filesystem(spec, None)
    table = ds.dataset(root, format="parquet", filesystem=fs, schema=REQUEST_LOG_SCHEMA).to_table()
    if since is not None:
        since = since if since.tzinfo else since.replace(tzinfo=timezone.utc)
        table = table.filter(pc.field("time") >= pa.scalar(since, REQUEST_LOG_SCHEMA.field("time").type))
    if table.num_rows == 0:
        raise EmptyLogError(f"no request-log rows under {spec.uri}" + (f" since {since.isoformat()}" if since else ""))
    return table


def summarise(log: pa.Table, keys: list[str]) -> list[dict]:
    """One row per group of `keys`, with the COLUMNS figures, busiest (most computed tokens) first."""
    import pyarrow as pa
    import pyarrow.compute as pc

    zero = pa.scalar(0, pa.int64())
    served = pc.and_(pc.less(log["status"], 400), pc.not_equal(log["route"], "estimate"))
    hit = pc.and_(served, pc.is_valid(log["cache_level"]))
    computed = pc.and_(served, pc.invert(hit))
    answer_tokens = pc.add(pc.add(log["context_tokens"], log["query_tokens"]), log["completion_tokens"])
    derived = {
        "task_type": pc.fill_null(log["task_type"], NO_TASK), "tenant": log["tenant"],
        "error": pc.cast(pc.greater_equal(log["status"], 400), pa.int64()), "hit": pc.cast(hit, pa.int64()),
        **{kind: pc.if_else(computed, log[kind], zero) for kind in TOKEN_KINDS},
        "computed_tokens": pc.if_else(computed, answer_tokens, zero),
        "saved_tokens": pc.if_else(hit, answer_tokens, zero),
        "served_ms": pc.if_else(served, log["total_ms"], pa.scalar(None, pa.float64())),
    }
    table = pa.table(derived)
    sums = [(name, "sum") for name in ("error", "hit", *TOKEN_KINDS, "computed_tokens", "saved_tokens")]
    grouped = table.group_by(keys).aggregate([("tenant", "count"), *sums, ("served_ms", "approximate_median")])
    rows = []
    for g in grouped.to_pylist():
        rows.append({**{k: g[k] for k in keys}, "requests": g["tenant_count"], "errors": g["error_sum"],
                     "cache_hits": g["hit_sum"], **{kind: g[f"{kind}_sum"] for kind in TOKEN_KINDS},
                     "computed_tokens": g["computed_tokens_sum"], "saved_tokens": g["saved_tokens_sum"],
                     "p50_ms": g["served_ms_approximate_median"]})
    return sorted(rows, key=lambda r: (-r["computed_tokens"], *(r[k] for k in keys)))


def print_table(rows: list[dict], keys: list[str], title: str, console: Console) -> None:
    table = Table(title=title, caption="tokens the model computed, by kind; saved: tokens of cached answers")
    for name in (*keys, *COLUMNS):
        table.add_column(HEADERS.get(name, name), justify="left" if name in keys else "right", no_wrap=True)
    for row in rows:
        p50 = "-" if row["p50_ms"] is None else f"{row['p50_ms']:.1f}"
        table.add_row(*(str(row[k]) for k in keys), *(f"{row[c]:,}" for c in COLUMNS[:-1]), p50)
    console.print(table)


def write_chart(by_tenant: list[dict], by_task: list[dict], path: Path) -> Path:
    """Stacked horizontal bars of computed tokens by kind (plus cache-saved tokens), per tenant and per task."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    segments = (*TOKEN_KINDS, "saved_tokens")
    colors = ("#4C72B0", "#55A868", "#C44E52", "#8172B2", "#CCCCCC")
    figure, axes = plt.subplots(2, 1, figsize=(10, 2 + 0.45 * (len(by_tenant) + len(by_task))), squeeze=True)
    for axis, rows, label, title in ((axes[0], by_tenant, lambda r: r["tenant"], "tokens by tenant"),
                                     (axes[1], by_task, lambda r: f"{r['tenant']} / {r['task_type']}",
                                      "tokens by tenant / task type")):
        names = [label(r) for r in rows][::-1]
        left = [0] * len(rows)
        for segment, color in zip(segments, colors):
            values = [r[segment] for r in rows][::-1]
            label = "saved by the response cache" if segment == "saved_tokens" else segment.removesuffix("_tokens")
            axis.barh(names, values, left=left, color=color, label=label)
            left = [a + b for a, b in zip(left, values)]
        axis.set_title(title)
        axis.set_xlabel("tokens")
    axes[0].legend(loc="lower right", fontsize="small")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=100)
    plt.close(figure)
    return path


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    import pyarrow as pa
    import pyarrow.compute as pc

    from schemas.store import StoreSpec

    try:
        log = load_log(StoreSpec(uri=args.log, endpoint_url=args.endpoint_url), args.since)
    except (ValueError, OSError, pa.ArrowException) as error:  # bad URI, no such directory, empty log, bad parts
        print(f"qvpic cost-report: {error}", file=sys.stderr)
        return 2
    by_tenant = summarise(log, ["tenant"])
    by_task = summarise(log, ["tenant", "task_type"])
    chart = write_chart(by_tenant, by_task, args.chart)
    if args.json:
        print(json.dumps(by_task, indent=2))
        return 0
    console = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 160)  # not 80 when piped
    first, last = pc.min(log["time"]).as_py(), pc.max(log["time"]).as_py()
    print_table(by_tenant, ["tenant"], f"Cost by tenant: {log.num_rows} requests, {first:%Y-%m-%d %H:%M} to "
                f"{last:%Y-%m-%d %H:%M} UTC", console)
    print_table(by_task, ["tenant", "task_type"], "Cost by tenant and task type", console)
    console.print(f"chart: {chart}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
