"""`qvpic recompile` / `python -m jobs.recompile`: rebuild exactly the stale or missing KV entries.

Run it after changing the model, its dtype or chat template, the page layout or the tiers; schedule
it (see docs/SCHEDULING.md) to pick up new checkpoints. Serving keeps using the old entries until the
new manifest is published at the very end.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from jobs import logs
from jobs.help import HelpFormatter
from jobs.ingest import compile_resources, model_args, render_args, render_spec, resource_args
from schemas.config import KVQuant, ModelSpec, Variant


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qvpic recompile", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--store", required=True)
    parser.add_argument("--s3-endpoint", default=None)
    model_args(parser)
    parser.set_defaults(model=None)
    render_args(parser)
    parser.set_defaults(tiers=None, font_size_pt=None, line_height_pt=None)  # unset: keep the store's layout
    parser.add_argument("--variants", nargs="+", type=Variant, default=None, choices=list(Variant))
    parser.add_argument("--kv-quant", type=KVQuant, default=None, choices=list(KVQuant),
                        help="store KV as none/int8/fp8 (default: keep the store's); a change rebuilds every entry")
    resource_args(parser)
    parser.add_argument("--orphan-grace-s", type=float, default=3600.0)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    logs.add_verbose_flag(parser)
    args = parser.parse_args(argv)
    logs.configure(args.verbose)
    from jobs.cluster import init_ray  # Ray, pyarrow and the model runtime: after `--help` has answered
    from jobs.failure import explain, report
    from pipeline.store import StoreBusyError
    from pipeline.ingest import RecompileConfig, recompile
    from pipeline.ingest import ResourceError
    from schemas.store import StoreSpec

    try:
        cfg = RecompileConfig(
            store=StoreSpec(uri=args.store, endpoint_url=args.s3_endpoint),
            model=None if args.model is None else ModelSpec(path=args.model, dtype=args.dtype, device=args.device,
                                                            revision=args.revision),
            render=None if args.tiers is args.font_size_pt is args.line_height_pt is args.font_names is None
            else render_spec(args),
            variants=None if args.variants is None else tuple(args.variants),
            resources=compile_resources(args), orphan_grace_s=args.orphan_grace_s,
            resource_wait_s=args.resource_wait_s, stall_timeout_s=args.stall_timeout_s, kv_quant=args.kv_quant,
        )
    except ValueError as e:
        print(f"qvpic recompile: {e}", file=sys.stderr)
        return 2
    init_ray(quiet=args.json)
    try:
        summary = recompile(cfg)
    except (StoreBusyError, ResourceError) as e:  # refused before any work: nothing to trace
        print(explain(e, "recompile", args.store), file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as e:
        print(f"qvpic recompile: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001  any failure mid-job: the traceback, then what it means
        report(e, "recompile", args.store)
        return 1
    print(json.dumps(asdict(summary), indent=2, default=str))
    return 0 if not summary.failures else 3


if __name__ == "__main__":
    logs.as_program()
    sys.exit(main())
