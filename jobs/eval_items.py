"""`qvpic eval`'s items: read from LongBench-format JSONL, a generic JSONL, the synthetic generator or the bundled
fixtures (`load_items`), and their documents ingested into the eval's store by the real Ray Data job."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from jobs.ingest import render_spec
from pipeline.eval import QAItem, QATask, load_generic, load_tasks
from schemas.config import ModelSpec
from schemas.modes import AblationTiers, Variant

FIXTURES = Path(__file__).resolve().parent / "data" / "longbench_fixture"


def load_items(args: argparse.Namespace) -> tuple[list[QAItem], str]:
    """The items and a description of where they came from."""
    if args.synthetic is not None:
        from pipeline.eval import synthetic

        records = synthetic.generate(args.synthetic, context_words=args.context_words, seed=args.seed)
        with tempfile.TemporaryDirectory(prefix="qvpic-synthetic-") as folder:
            synthetic.write_jsonl(records, folder)
            items = load_tasks(folder, [QATask.SYNTHETIC])
        source = f"synthetic ({args.synthetic} items, {args.context_words} words, seed {args.seed})"
    elif args.generic is not None:
        items, source = load_generic(args.generic), args.generic
    else:
        items = load_tasks(args.data or str(FIXTURES), args.tasks)
        source = args.data or "bundled LongBench-format fixtures"
    if args.limit is not None:
        kept: dict[QATask, int] = {}
        limited = []
        for item in items:
            kept[item.task] = kept.get(item.task, 0) + 1
            if kept[item.task] <= args.limit:
                limited.append(item)
        items = limited
    return items, source


def ingest_documents(items: list[QAItem], store: str, model: ModelSpec, args: argparse.Namespace) -> None:
    from jobs.cluster import init_ray
    from pipeline.eval import corpus_documents, write_corpus
    from pipeline.ingest import IngestConfig, ingest
    from schemas.store import StoreSpec

    documents = corpus_documents(items)
    if not documents:
        return  # chunk_ids items only: the store holds their chunks already
    with tempfile.TemporaryDirectory(prefix="qvpic-eval-corpus-") as folder:
        corpus = write_corpus(documents, os.path.join(folder, "documents.jsonl"))
        init_ray(quiet=True)  # the eval's own progress bars say enough
        summary = ingest(IngestConfig(corpus=corpus, store=StoreSpec(uri=store), model=model, render=render_spec(args),
                                      chunk_tokens=args.chunk_tokens, variants=tuple(Variant),
                                      ablation_tiers=AblationTiers.EVERY if args.paper else AblationTiers.LOWEST))
    print(f"ingested {summary.indexed} documents ({summary.num_chunks} chunks, {summary.num_chunks_compiled} "
          f"compiled now) into {store}; quarantined: {summary.quarantined or 'none'}", file=sys.stderr)
