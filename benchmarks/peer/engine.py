"""Running the vLLM side (benchmarks/peer/vllm_side.py) from the project's venv: one job, one process.

vLLM gets the same cores the project's runs get: `VLLM_CPU_OMP_THREADS_BIND` names this process's torch
thread count of cores (0..N-1), `OMP_NUM_THREADS` is that count too, and its KV cache is given
`VLLM_CPU_KVCACHE_SPACE` GiB.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from pipeline.runtime import resolve_path
from schemas.config import ModelSpec

ROOT = Path(__file__).resolve().parents[2]
PEER_VENV = Path(os.environ.get("PEER_VENV", ROOT / ".peer-vllm"))
SIDE = Path(__file__).with_name("vllm_side.py")
KV_CACHE_GIB = 4
MAX_MODEL_LEN = 8192  # tokens: 16 chunks as pages (~4k) with room to spare


class PeerMissing(RuntimeError):
    """The peer venv is not built (`make peer-vllm`)."""


def peer_env(threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the peer must not import our tree's pins
    # OMP_NUM_THREADS: else vLLM drops its engine process's torch threads to one.
    env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", OMP_NUM_THREADS=str(threads),
               VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB), VLLM_CACHE_ROOT=str(PEER_VENV / "cache"),
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "WARNING"))
    return env


def job(spec: ModelSpec, max_images: int, tasks: list[dict]) -> dict:
    """A vllm_side job on `spec`'s checkpoint directory and dtype, with qvpic's image pixel budget (vLLM
    would otherwise take the checkpoint's preprocessor_config.json, whose max_pixels is lower)."""
    return {"model": str(resolve_path(spec)), "dtype": spec.dtype.value, "max_model_len": MAX_MODEL_LEN,
            "max_images": max_images, "min_pixels": spec.min_pixels, "max_pixels": spec.max_pixels, "tasks": tasks}


def run_job(job: dict, log: Path | None = None) -> dict:
    """Run one vllm_side job in the peer venv and return its output (raises with the log's tail on failure)."""
    python = PEER_VENV / "bin" / "python"
    if not python.exists():
        raise PeerMissing(f"{python} not found: build the peer venv with `make peer-vllm`")
    with tempfile.TemporaryDirectory(prefix="qvpic-peer-") as folder:
        job_path, out_path = Path(folder) / "job.json", Path(folder) / "out.json"
        job_path.write_text(json.dumps(job))
        log = log or Path(folder) / "log.txt"
        with open(log, "w") as sink:
            code = subprocess.call([str(python), str(SIDE), str(job_path), str(out_path)], stdout=sink,
                                   stderr=subprocess.STDOUT, env=peer_env(torch.get_num_threads()), cwd=folder)
        if code != 0:
            raise RuntimeError(f"vllm_side exited {code}:\n" + "\n".join(log.read_text().splitlines()[-30:]))
        return json.loads(out_path.read_text())
