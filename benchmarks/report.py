"""Re-export for the benchmarks: the section writer lives in `pipeline/eval/markdown.py`, below `jobs/`."""

from pipeline.eval import BENCHMARKS_MD, markdown_table, write_section

__all__ = ["BENCHMARKS_MD", "markdown_table", "write_section"]
