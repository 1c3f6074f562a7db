"""Corpus inputs: readers for every supported format (jsonl, parquet, .txt/.md folders, LongBench, page
images), safe page-image decoding, and the documents that repeat across files."""

from pipeline.facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "readers": ["discover", "file_format", "read_file"],
    "remote": ["RemoteFiles", "corpus_location", "is_remote"],
    "repeats": ["DocRef", "near_duplicate_images", "source_order_key"],
})
