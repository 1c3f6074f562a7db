"""`qvpic ingest` / `python -m jobs.ingest`: build or extend a KV store from a corpus (Ray Data)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from jobs import logs
from jobs.help import HelpFormatter
from pipeline.ingest import CompileResources, JobResources
from schemas.config import DType, KVQuant, ModelSpec
from schemas.modes import AblationTiers, Variant
from schemas.render import RenderSpec, TierSpec

if TYPE_CHECKING:  # imported where used: Ray and pyarrow would make `--help` take seconds
    from pipeline.ingest import IngestSummary
    from schemas.store import StoreSpec

T = TypeVar("T")


def parse_tiers(values: list[str]) -> tuple[TierSpec, ...]:
    """`low=72 high=120` → tiers."""
    tiers = []
    for value in values:
        name, sep, dpi = value.partition("=")
        if not sep or not dpi.isdigit():
            raise argparse.ArgumentTypeError(f"tier {value!r} must look like NAME=DPI, e.g. low=72")
        tiers.append(TierSpec(name=name, dpi=int(dpi)))
    return tuple(tiers)


# ---- the argument builders `qvpic ingest` and `qvpic recompile` share --------------------------------
def store_args(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    parser.add_argument("--store", required=True, help=help)
    parser.add_argument("--s3-endpoint", default=None, help="S3-compatible endpoint URL (MinIO, …)")


def seal_args(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--hmac-key-file", default=None, help=f"{what} with the HMAC key in this file (unset: the "
                        "QVPIC_HMAC_KEY environment variable, if set). Keep it off the store; docs/SECURITY.md")


def store_spec(args: argparse.Namespace) -> StoreSpec:
    from schemas.store import StoreSpec

    return StoreSpec(uri=args.store, endpoint_url=args.s3_endpoint)


def model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny-qwen",
                        help="local checkpoint dir or built-in tiny-qwen|tiny-glm|bench-qwen|bench-glm")
    parser.add_argument("--dtype", type=DType, default=DType.FLOAT32, choices=list(DType))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--revision", default="local")


def model_spec(args: argparse.Namespace) -> ModelSpec | None:
    """The model the arguments name (None where `--model` was left unset and has no default)."""
    if args.model is None:
        return None
    return ModelSpec(path=args.model, dtype=args.dtype, device=args.device, revision=args.revision)


def render_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tiers", nargs="+", default=["low=72", "high=120"], help="NAME=DPI …")
    parser.add_argument("--font-size-pt", type=float, default=RenderSpec().font_size_pt)
    parser.add_argument("--line-height-pt", type=float, default=RenderSpec().line_height_pt)
    parser.add_argument("--font", action="append", dest="font_names", metavar="FILE",
                        help="font file name or absolute path, tried in order per character (repeat for a "
                             "fallback chain); e.g. Glyph's Verdana.ttf to match what a Glyph checkpoint was "
                             f"trained on (default: {' '.join(RenderSpec().font_names)})")


def render_spec(args: argparse.Namespace) -> RenderSpec:
    """The page layout the arguments name; unset ones keep RenderSpec's defaults."""
    fields = {"tiers": parse_tiers(args.tiers) if args.tiers else None, "font_size_pt": args.font_size_pt,
              "line_height_pt": args.line_height_pt,
              "font_names": tuple(args.font_names) if getattr(args, "font_names", None) else None}
    return RenderSpec(**{k: v for k, v in fields.items() if v is not None})


def variant_args(parser: argparse.ArgumentParser, default: list[Variant] | None, kv_quant_help: str) -> None:
    parser.add_argument("--variants", nargs="+", type=Variant, default=default, choices=list(Variant))
    parser.add_argument("--kv-quant", type=KVQuant, default=None, choices=list(KVQuant), help=kv_quant_help)


def resource_args(parser: argparse.ArgumentParser) -> None:
    pool, limits = CompileResources(), JobResources()
    parser.add_argument("--compile-workers", type=int, default=pool.workers, help="compile actors (each holds one VLM)")
    parser.add_argument("--gpus-per-worker", type=float, default=pool.gpus_per_worker)
    parser.add_argument("--compile-batch-size", type=int, default=pool.batch_size, help="chunks per compile forward")
    parser.add_argument("--resource-wait-s", type=float, default=limits.resource_wait_s,
                        help="how long to wait for the cluster to free what the job needs before failing")
    parser.add_argument("--stall-timeout-s", type=float, default=limits.stall_timeout_s,
                        help="fail (instead of hanging) when no data moves through the pipeline for this long")


def job_resources(args: argparse.Namespace) -> dict[str, Any]:
    """The JobResources fields of a job config, from `resource_args`' arguments."""
    return {"resources": CompileResources(workers=args.compile_workers, gpus_per_worker=args.gpus_per_worker,
                                          batch_size=args.compile_batch_size),
            "resource_wait_s": args.resource_wait_s, "stall_timeout_s": args.stall_timeout_s}


def configured(command: str, build: Callable[[], T]) -> T | None:
    """`build()` (a job config), or None after printing why the arguments make none (exit status 2)."""
    try:
        return build()
    except ValueError as e:  # pydantic's ValidationError is one
        print(f"qvpic {command}: {e}", file=sys.stderr)
        return None


def run_job(command: str, store_uri: str, job: Callable[[], T]) -> T | None:
    """`job()`, or None after printing why it did not complete (exit status 1)."""
    from jobs.failure import explain, report
    from pipeline.ingest import ResourceError
    from pipeline.store import StoreBusyError

    try:
        return job()
    except (StoreBusyError, ResourceError) as e:  # refused before any work: nothing to trace
        print(explain(e, command, store_uri), file=sys.stderr)
    except (ValueError, FileNotFoundError) as e:  # could not run at all: bad corpus root, mismatched store
        print(f"qvpic {command}: {e}", file=sys.stderr)
    except Exception as e:  # noqa: BLE001  any failure mid-job: the traceback, then what it means
        report(e, command, store_uri)
    return None


def print_summary(summary: IngestSummary, as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary.to_dict(), indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"ingest {summary.job_id}", show_header=False)
    for label, value in [
        ("inputs", summary.inputs), ("indexed", summary.indexed), ("deduplicated", summary.deduplicated),
        ("quarantined", f"{summary.num_quarantined} {summary.quarantined or ''}"),
        ("chunks (distinct texts)", f"{summary.num_chunks} ({summary.num_chunk_texts})"),
        ("chunks compiled", summary.num_chunks_compiled), ("chunks embedded", summary.num_chunks_embedded),
        ("chunk rows published", summary.num_chunks_published), ("wall time", f"{summary.wall_s:.1f} s"),
        ("chunks/s", f"{summary.chunks_per_s:.2f}"), ("accounted", "yes" if summary.balanced else "NO"),
    ]:
        table.add_row(label, str(value))
    console = Console()
    console.print(table)
    if summary.unchanged_since:
        console.print(f"nothing to do: the corpus, the settings and the store are unchanged since job "
                      f"{summary.unchanged_since} (`--force` runs the pipeline anyway)")
        return
    if not summary.groups:
        reason = ("the store already holds the KV entries of every chunk" if summary.num_chunks
                  else "the corpus yielded no chunks")
        console.print(f"nothing to compile: {reason}")
        return
    groups = Table(title="compiled entries")
    for column in ("entry", "entries", "pages", "vision tokens", "KV bytes"):
        groups.add_column(column)
    for name, g in summary.per_entry_group.items():
        groups.add_row(name, str(g["entries"]), str(g["pages"]), str(g["vision_tokens"]), f"{g['nbytes']:,}")
    console.print(groups)
    if len(summary.per_node) > 1:  # a job spread over a cluster: how its compile nodes shared the work
        nodes = Table(title="compiled per Ray node")
        for column in ("node", "entries", "KV bytes"):
            nodes.add_column(column)
        for node, n in summary.per_node.items():
            nodes.add_row(node, str(n["entries"]), f"{n['nbytes']:,}")
        console.print(nodes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qvpic ingest", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--corpus", required=True,
                        help="file or folder: jsonl, parquet, .txt/.md, LongBench jsonl, PNG/JPEG pages; or "
                             "s3://bucket/prefix, read through the store's --s3-endpoint (page images: local only)")
    store_args(parser, help="local directory or s3://bucket/prefix")
    model_args(parser)
    render_args(parser)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    variant_args(parser, list(Variant),
                 kv_quant_help="how KV entries are stored: none (the model's dtype), int8 or fp8 (KIVI layout: keys "
                               "per channel, values per token, ~0.5x the bytes of bf16). Default: the store's own, "
                               "none for a new store; changing it is `qvpic recompile --kv-quant`")
    parser.add_argument("--lazy-high-tier", action="store_true",
                        help="compile only the lowest tier now; each chunk's highest tier is compiled by the "
                             "generator on its first promotion and written back to the store (recorded in the "
                             "manifest)")
    parser.add_argument("--ablation-tiers", type=AblationTiers, choices=[a.value for a in AblationTiers],
                        default=AblationTiers.LOWEST, help="tiers of the plain and dummy-prefix variants: the lowest "
                        "(image_pic baselines) or every tier (the paper's compile prefix × allocation grid: "
                        "qvpic_plain, qvpic_dummy and image_pic at any tier; `qvpic eval --paper` uses it)")
    parser.add_argument("--legibility", action="store_true",
                        help="OCR every page at every tier (tesseract) and store its character accuracy in the index: "
                             "what `qvpic serve --hybrid` uses to serve illegible chunks as text")
    resource_args(parser)
    parser.add_argument("--embedder-dir", default=None,
                        help="local sentence-transformers dir (default: offline MiniLM)")
    parser.add_argument("--force", action="store_true",
                        help="run the pipeline even when the corpus and the store are unchanged since the last ingest "
                             "(by default such a rerun is a no-op: it hashes the corpus and stops)")
    seal_args(parser, "seal the generation this job publishes")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    logs.add_verbose_flag(parser)
    args = parser.parse_args(argv)
    logs.configure(args.verbose)
    from jobs.cluster import init_ray
    from pipeline.ingest import IngestConfig, ingest, unchanged

    cfg = configured("ingest", lambda: IngestConfig(
        corpus=args.corpus, store=store_spec(args), model=model_spec(args), render=render_spec(args),
        chunk_tokens=args.chunk_tokens, variants=tuple(args.variants), embedder_dir=args.embedder_dir,
        kv_quant=args.kv_quant, force=args.force, lazy_high_tier=args.lazy_high_tier, legibility=args.legibility,
        ablation_tiers=args.ablation_tiers, hmac_key_file=args.hmac_key_file, **job_resources(args)))
    if cfg is None:
        return 2

    def run() -> IngestSummary:
        key, summary = unchanged(cfg)  # a rerun with nothing to do stops here, before Ray starts
        if summary is None:
            init_ray(quiet=args.json)
            summary = ingest(cfg, key)
        return summary

    summary = run_job("ingest", args.store, run)
    if summary is None:
        return 1
    print_summary(summary, args.json)
    return 0


if __name__ == "__main__":
    logs.as_program()
    sys.exit(main())
