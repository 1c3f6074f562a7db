"""The evaluation harness: LongBench loading and scoring, synthetic long-document QA, fidelity to full
prefill, evidence legibility, the paper's grid and the reports. It reaches the serving path only through
the `Answerer` seam (HTTP, or in-process as `jobs/eval_serving.py` wires it), so it runs against a
deployed service as well as inside one process."""

from pipeline.facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "evaluation": [
        "Answered", "HttpAnswerer", "ServingSpec", "StoreView", "corpus_documents", "item_request", "write_corpus"
    ],
    "evidence": ["OcrJudge", "RoutePlanner", "RoutedChunk", "judge_items", "serving_configs", "summarize_evidence"],
    "fidelity": [
        "Fidelity", "METRICS", "REFERENCE_MODE", "Trace", "answer_token_ids", "compare", "run_fidelity",
        "summarize_fidelity", "trace_full", "trace_linked"
    ],
    "legibility": ["answer_recoverable"],
    "longbench": ["LONGBENCH_QA_TASKS", "QAItem", "QATask", "load_generic", "load_tasks"],
    "markdown": ["BENCHMARKS_MD", "RELIABILITY_MD", "markdown_table", "write_section"],
    "paper": [
        "DEFAULT_BUDGETS", "DEFAULT_TAUS", "PAPER_TIERS", "SWEEP_PNG", "ablation_table", "dpi_table",
        "fidelity_table", "paper_grid", "paper_table", "sweep_png", "tau_budget_table"
    ],
    "report": ["REPORT_MD", "legibility_markdown", "summary_markdown", "write_report"],
    "runner": ["ItemResult", "ModeSummary", "middle_cut", "protocol", "run", "summarize"],
    "synthetic": ["evidence_chunks", "generate"],
})
