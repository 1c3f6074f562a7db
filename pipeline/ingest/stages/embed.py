"""The embed stage: each UNIT that needs one gets the sentence embedding of its text (the router's, see
pipeline/runtime/embed.py). Units whose key the store already embedded (same embedder: the manifest pins it)
are not re-embedded.

A Ray Data callable class over pipeline rows (pipeline/ingest/rows.py); other rows pass through.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from pipeline.ingest.preload import Preload
from pipeline.ingest.rows import require_columns, units_to_build, with_columns
from pipeline.runtime import Embedder

NEEDS = ("kind", "error", "needs_embedding", "text")
ADDS = ("embedding",)


class EmbedStage:
    """Units → the same units with `embedding` ([dim] float32, L2-normalised) where they needed one."""

    def __init__(self, model_dir: str | None = None, preload: bool = False) -> None:
        self.model_dir = model_dir
        self._embedder: Embedder | None = None
        # The job's actors preload (pipeline/ingest/preload.py); in-process callers load on the first batch
        # that needs the model, or never (a batch with nothing to embed)
        self._loading = Preload("loading the embedder", lambda: Embedder(model_dir)) if preload else None

    @property
    def embedder(self) -> Embedder:
        if self._embedder is None:
            self._embedder = self._loading.get() if self._loading else Embedder(self.model_dir)
        return self._embedder

    def __call__(self, batch: pa.Table) -> pa.Table:
        require_columns(batch, NEEDS, "embed")
        work, rest = units_to_build(batch, "needs_embedding")
        if work.num_rows == 0:
            return batch
        vectors = self.embedder.embed(work["text"].to_pylist())  # [units, dim] float32
        offsets = pa.array(np.arange(0, vectors.size + 1, vectors.shape[1], dtype=np.int32))
        embeddings = pa.ListArray.from_arrays(offsets, pa.array(vectors.reshape(-1), pa.float32()))
        return pa.concat_tables([rest, with_columns(work, embedding=embeddings)])
