"""The offline jobs on Ray Data: `ingest` (read → chunk → dedup → render → embed → compile → write → publish,
one stage per module in `stages/`) and `recompile`; the pipeline's row schema, the manifest it writes, the resources
it asks Ray for, the rerun record that makes an unchanged rerun a no-op, and the job summary."""

from pipeline.facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "chunker": ["Chunker"],
    "ingest_job": ["IngestConfig", "ingest", "open_store", "unchanged"],
    "manifest": ["new_manifest"],
    "recompile_job": ["RecompileConfig", "recompile"],
    "resources": ["CompileResources", "JobResources", "ResourceError"],
    "rows": ["Kind", "rows_table", "units_to_build", "with_columns"],
    "summary": ["IngestSummary"],
})
