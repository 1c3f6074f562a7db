"""The embedding model's transformer on ONNX Runtime: the same vectors as sentence-transformers' `encode`, faster.

A new query's MiniLM forward was most of its route (docs/BENCHMARKS.md `routing`): ~10–15 ms of one core in
PyTorch eager, nearly all of it in 37 small matrix products. ONNX Runtime runs the same float32 graph with its
fused kernels (attention, layer norm, GELU, bias adds) in ~60% of the time, and its vectors agree with
`encode`'s to float32 rounding (1 − cosine ≤ 1e-6; tests/pipeline/runtime/test_embed.py holds it to 1e-5).

The graph is exported from the loaded PyTorch model once per model (`torch.onnx.export`, its TorchScript
exporter) into a file named by the embedder's model name (package version, or a directory's content hash), so
a changed model never reuses another's graph. Only the stack every sentence-transformers bi-encoder of this
kind has is taken — Transformer, mean Pooling, optionally Normalize — and the exported graph is checked against
`encode` on probe texts before it is used; anything else stays on `encode` (`OnnxEncoder.build` returns None
and says why).
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

INPUTS = ("input_ids", "attention_mask", "token_type_ids")
MAX_ONE_MINUS_COSINE = 1e-5  # the exported graph must reproduce encode's vectors this closely, or it is not used
# What the check at build time runs: a short text, a long one, and the two together (padding)
PROBES = ("a", "The cooling pump's mechanical seal failed at Dock 3 on 4 March; the spare ships from Hamburg.")


_SESSIONS: dict[tuple[str, int], Any] = {}  # (graph file, threads) -> session, shared by the process's embedders
_SESSIONS_LOCK = threading.Lock()


def onnx_cache() -> Path:
    return Path(os.environ.get("QVPIC_ONNX_CACHE", Path.home() / ".cache" / "qvpic" / "onnx"))


class OnnxEncoder:
    """Tokenizer → ONNX Runtime session over the transformer → mean pooling over the attention mask → L2 norm."""

    def __init__(self, session: Any, tokenizer: Any, max_seq_length: int, inputs: tuple[str, ...],
                 path: Path | None = None):
        self.session, self.tokenizer, self.max_seq_length, self.inputs = session, tokenizer, max_seq_length, inputs
        self.path = path  # the graph file: another session over it (`on_threads`)

    def on_threads(self, threads: int) -> OnnxEncoder:
        """The same encoder over a session of `threads` (the process's one for that count). On 1, ONNX Runtime runs
        the forward on the calling thread, so the caller's CPU priority is the forward's."""
        return OnnxEncoder(_session(self.path, threads, lambda: None), self.tokenizer, self.max_seq_length,
                           self.inputs, self.path)

    @classmethod
    def build(cls, model: Any, model_name: str, threads: int, cache: Path | None = None) -> OnnxEncoder | None:
        """An encoder for sentence-transformers `model`, or None (logged) where it cannot reproduce `encode`."""
        import torch

        kinds = [type(module).__name__ for module in model]
        if kinds not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
            log.info("embedder %s: modules %s are not Transformer + Pooling (+ Normalize): encode", model_name, kinds)
            return None
        pooling = model[1]
        # sentence-transformers >= 6 names the mode; older versions list it as a string
        modes = getattr(pooling, "pooling_mode", None) or getattr(pooling, "get_pooling_mode_str", lambda: None)()
        if modes != "mean":
            log.info("embedder %s: pooling %r is not mean pooling: encode", model_name, modes)
            return None
        transformer = model[0].auto_model
        inputs = tuple(name for name in INPUTS if name in model.tokenizer("a"))
        path = (cache or onnx_cache()) / f"{re.sub(r'[^A-Za-z0-9._=@-]', '_', model_name)}.onnx"
        try:
            encoder = cls(_session(path, threads, lambda: _export(transformer, model.tokenizer, inputs, path)),
                          model.tokenizer, model.max_seq_length, inputs, path)
            with torch.inference_mode():
                reference = model.encode(list(PROBES), convert_to_numpy=True, normalize_embeddings=True)
            error = float(np.max(1.0 - np.sum(encoder.encode(list(PROBES)) * reference, axis=1)))
        except Exception as exc:  # an exporter or runtime that cannot take this model: encode still can
            log.warning("embedder %s: no ONNX graph (%s): encode", model_name, exc)
            return None
        if error > MAX_ONE_MINUS_COSINE:
            log.warning("embedder %s: ONNX vectors differ from encode's (1 - cosine %.2g): encode", model_name, error)
            return None
        return encoder

    def encode(self, texts: list[str]) -> np.ndarray:
        """float32 [len(texts), dim], L2-normalised: one forward over `texts`, padded to the longest."""
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_seq_length,
                               return_tensors="np")
        feeds = {name: np.asarray(batch[name], dtype=np.int64) for name in self.inputs}
        hidden = self.session.run(None, feeds)[0]  # [n, tokens, dim]
        mask = feeds["attention_mask"][..., None].astype(np.float32)
        mean = (hidden * mask).sum(axis=1) / np.clip(mask.sum(axis=1), 1e-9, None)  # sentence-transformers' Pooling
        return mean / np.clip(np.linalg.norm(mean, axis=1, keepdims=True), 1e-12, None)  # torch's F.normalize


def _export(transformer: Any, tokenizer: Any, inputs: tuple[str, ...], path: Path) -> None:
    """The transformer's last hidden state as an ONNX graph with dynamic batch and sequence axes, written to a
    temporary file and renamed into place (another process exporting the same model at once is harmless)."""
    import torch

    class LastHidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transformer = transformer

        def forward(self, *args: torch.Tensor) -> torch.Tensor:
            return self.transformer(**dict(zip(inputs, args))).last_hidden_state

    sample = tokenizer(["an example sentence to trace", "two"], padding=True, return_tensors="pt")
    axes = {name: {0: "batch", 1: "tokens"} for name in (*inputs, "last_hidden_state")}
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as folder:
        tmp = Path(folder) / path.name
        # its TracerWarnings are about branches on shapes that one trace fixes; the check in `build` is what
        # says whether the graph reproduces encode
        with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(LastHidden().eval(), tuple(sample[name] for name in inputs), str(tmp),
                              input_names=list(inputs), output_names=["last_hidden_state"], dynamic_axes=axes,
                              opset_version=17, dynamo=False)
        os.replace(tmp, path)


def _session(path: Path, threads: int, export) -> Any:
    """The process's session over `path` on `threads` (built once: ~1 s; `export` first where the file is new);
    ONNX Runtime's `run` is thread-safe."""
    with _SESSIONS_LOCK:
        key = (str(path), threads)
        if key not in _SESSIONS:
            if not path.exists():
                export()
            _SESSIONS[key] = _new_session(path, threads)
        return _SESSIONS[key]


def _new_session(path: Path, threads: int) -> Any:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = max(1, threads)  # the process's torch threads (Ray sets 1 in a fractional-CPU actor)
    options.inter_op_num_threads = 1
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3  # errors only: it warns about every unused initializer of the export
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
