"""The ingest pipeline's stages, one per module, in data-flow order: read, chunk, dedup, render, embed,
compile, write. Each declares the columns it needs and the ones it adds."""

from pipeline.facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "compile": ["CompilePlan", "CompileStage", "RenderStage", "compile_in_process"],
    "dedup": ["check_ids", "deduplicate", "read_parts", "stored_embeddings", "stored_entries"],
    "read": ["ChunkStage", "read_files", "rejected_row"],
    "write": ["write_documents"],
})
