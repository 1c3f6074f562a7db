"""The ingest pipeline's stages, one per module, in data-flow order: read, chunk, dedup, render, embed,
compile, write. Each module declares the columns it needs (`NEEDS`, checked on every batch: a batch that
lacks one is refused with a ValueError naming it) and the ones it adds (`ADDS`)."""

from pipeline.facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "read": ["read_files", "rejected_row"],
    "chunk": ["ChunkStage"],
    "dedup": ["check_ids", "deduplicate", "stored_embeddings", "stored_entries"],
    "render": ["RenderStage"],
    "embed": ["EmbedStage"],
    "compile": ["CompilePlan", "CompileStage", "compile_in_process"],
    "write": ["write_documents"],
})
