"""`qvpic publish` / `python -m jobs.publish`: snapshot a store into a new serving generation.

`qvpic ingest` and `qvpic recompile` publish at their end; run this after changing a store by other
means (the Store API, a restore from backup), or to rebuild the vector index with other settings.
Running services switch to the new generation on their next poll. `--collect` only removes
generations and snapshot files no live service uses (leases), without publishing.
"""

from __future__ import annotations

import argparse
import sys

from jobs.help import HelpFormatter
from jobs.ingest import seal_args
from schemas.generation import SearchSpec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qvpic publish", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--store", required=True)
    parser.add_argument("--s3-endpoint", default=None)
    parser.add_argument("--ann-min-rows", type=int, default=SearchSpec().ann_min_rows,
                        help="chunks from which an IVF index is considered (below: exhaustive scan)")
    parser.add_argument("--target-recall", type=float, default=SearchSpec().target_recall)
    parser.add_argument("--collect", action="store_true", help="collect unused generations only")
    seal_args(parser, "seal the generation")
    args = parser.parse_args(argv)
    from pipeline.store import Store, StoreError, collect_generations, hmac_key, publish_generation
    from schemas.store import StoreSpec

    try:
        store = Store.open(StoreSpec(uri=args.store, endpoint_url=args.s3_endpoint))
        if args.collect:
            print(f"removed generations: {collect_generations(store)}")
            return 0
        spec = SearchSpec(ann_min_rows=args.ann_min_rows, target_recall=args.target_recall)
        record = publish_generation(store, "publish", spec, hmac_key=hmac_key(args.hmac_key_file))
    except (StoreError, ValueError) as e:
        print(f"qvpic publish: {e}", file=sys.stderr)
        return 1
    print(record.model_dump_json(indent=2, exclude={"manifest"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
