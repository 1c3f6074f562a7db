"""A serving generation's chunk catalog and entry table, laid out for reads by row: the reader routing opens,
the streaming writer that builds it from the table parts, and the vector index (with its calibration)
that retrieval searches."""

from pipeline.facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "ann_calibration": ["calibration_queries", "exact_top_k", "recall_at_k"],
    "embedding_rows": ["EmbeddingRows"],
    "reader": [
        "CATALOG", "CATALOG_COLUMNS", "COUNTS", "Catalog", "EMBEDDINGS", "ENTRIES", "RowFile", "SEARCH",
        "TEXTS"
    ],
    "vector_index": ["code_scale"],
    "writer": ["ENTRY_COLUMNS", "parts_digest", "write_chunks_dir", "write_entries_dir"],
})
