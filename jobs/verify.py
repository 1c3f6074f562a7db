"""`qvpic verify` / `python -m jobs.verify`: check a store's consistency, and with --repair apply the safe fixes.

Checks manifest ↔ serving generation ↔ table parts ↔ index rows ↔ shards: parts the current generation
was built from that are gone or changed, index rows whose shard is missing or too short, entries whose
bytes fail their checksum (--deep reads every entry), chunks lacking entries, and orphans (files no
reader reads, shards nothing references). Everything streams: memory holds a record batch or one key
range, whatever the store's size. `qvpic serve` and every publish run the parts check (a listing) first
and refuse a store that lost parts.

--repair, under the store's write lease: restores lost index rows from the current generation, drops
index rows pointing at missing or corrupt entries (then `qvpic recompile` rebuilds exactly those),
deletes orphan files and shards older than --grace-s. It never deletes what a live generation uses.

--hmac-key-file (or QVPIC_HMAC_KEY): the current generation's seal must match the key (docs/SECURITY.md).

Exit status: 0 consistent, 1 problems found (after --repair: problems left), 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import sys

from jobs.help import HelpFormatter
from schemas.store import ORPHAN_GRACE_S


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="qvpic verify", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--store", required=True, help="store URI (a local path or s3://bucket/prefix)")
    parser.add_argument("--s3-endpoint", default=None)
    parser.add_argument("--deep", action="store_true", help="also read every entry's bytes and verify its checksum "
                        "(reads the whole store, streaming) and every part's footer")
    parser.add_argument("--repair", action="store_true", help="apply the safe fixes, then verify again")
    parser.add_argument("--grace-s", type=float, default=ORPHAN_GRACE_S,
                        help="orphans younger than this may belong to a job still writing: not reported, not deleted")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    parser.add_argument("--hmac-key-file", default=None, help="also check that the current generation is sealed with "
                        "the HMAC key in this file (unset: the QVPIC_HMAC_KEY environment variable, if set; neither: "
                        "seals are not checked). A missing or wrong seal is a problem: exit 1")
    args = parser.parse_args(argv)
    if args.grace_s < 0:
        parser.error("--grace-s must be >= 0")
    return args


def print_report(report, repaired: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"qvpic verify {report.store}" + (" (deep)" if report.deep else ""))
    for column in ("check", "severity", "count", "what", "examples", "--repair"):
        table.add_column(column, overflow="fold")
    for f in report.findings:
        style = "red" if f.severity.value == "problem" else "dim"
        table.add_row(f.check.value, f.severity.value, str(f.count), f.detail, "\n".join(f.examples), f.repair,
                      style=style)
    console = Console()
    if report.findings:
        console.print(table)
    console.print("checked: " + ", ".join(f"{k} {v}" for k, v in report.counts.items()))
    for line in repaired:
        console.print(f"repaired: {line}")
    console.print("[green]consistent[/green]" if report.ok else f"[red]{len(report.problems)} problem(s)[/red]")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pipeline.store import SealError, Store, StoreError, hmac_key
    from pipeline.store.check import verify
    from schemas.store import StoreSpec

    try:
        key = hmac_key(args.hmac_key_file)
    except SealError as e:  # an unreadable or short key file: a usage error, before the store is read
        print(f"qvpic verify: {e}", file=sys.stderr)
        return 2
    try:
        store = Store.open(StoreSpec(uri=args.store, endpoint_url=args.s3_endpoint))
        report = verify(store, args.deep, args.grace_s, key)
        repaired: list[str] = []
        if args.repair and report.problems:
            from pipeline.store.check import repair

            repaired = repair(store, report, args.grace_s)
            report = verify(store, args.deep, args.grace_s, key)  # what is left
            report.repaired = repaired
    except StoreError as e:  # no manifest, an unreadable one, a busy store (--repair)
        if args.json:
            print(json.dumps({"store": args.store, "ok": False, "error": str(e)}))
        else:
            print(f"qvpic verify: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print_report(report, repaired)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
