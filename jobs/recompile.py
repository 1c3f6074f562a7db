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
from jobs.ingest import (
    configured,
    job_resources,
    model_args,
    model_spec,
    render_args,
    render_spec,
    resource_args,
    run_job,
    seal_args,
    store_args,
    store_spec,
    variant_args,
)
from schemas.store import ORPHAN_GRACE_S


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qvpic recompile", description=__doc__, formatter_class=HelpFormatter)
    store_args(parser)
    model_args(parser)
    parser.set_defaults(model=None)
    render_args(parser)
    parser.set_defaults(tiers=None, font_size_pt=None, line_height_pt=None)  # unset: keep the store's layout
    variant_args(parser, None,
                 kv_quant_help="store KV as none/int8/fp8 (default: keep the store's); a change rebuilds every entry")
    resource_args(parser)
    parser.add_argument("--images-root", help="absolute directory the store's scanned page images are read from; "
                        "an image_path outside it is refused and its entries quarantined (default: none is read)")
    seal_args(parser, "seal the generation this job publishes")
    parser.add_argument("--orphan-grace-s", type=float, default=ORPHAN_GRACE_S)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    logs.add_verbose_flag(parser)
    args = parser.parse_args(argv)
    logs.configure(args.verbose)
    from jobs.cluster import init_ray  # Ray, pyarrow and the model runtime: after `--help` has answered
    from pipeline.ingest import RecompileConfig, recompile

    cfg = configured("recompile", lambda: RecompileConfig(
        store=store_spec(args), model=model_spec(args),
        render=None if args.tiers is args.font_size_pt is args.line_height_pt is args.font_names is None
        else render_spec(args),
        variants=None if args.variants is None else tuple(args.variants), orphan_grace_s=args.orphan_grace_s,
        kv_quant=args.kv_quant, images_root=args.images_root, hmac_key_file=args.hmac_key_file,
        **job_resources(args)))
    if cfg is None:
        return 2
    init_ray(quiet=args.json)
    summary = run_job("recompile", args.store, lambda: recompile(cfg))
    if summary is None:
        return 1
    print(json.dumps(asdict(summary), indent=2, default=str))
    return 0 if not summary.failures else 3


if __name__ == "__main__":
    logs.as_program()
    sys.exit(main())
