"""`device: auto` (pipeline/runtime/checkpoint.py resolve_device): on a node with an NVIDIA GPU that torch
cannot use (here always: CI's torch is the CPU build) it refuses, naming the GPU lock and `device: cpu`; with
no GPU, or GPUs hidden, or only Ray's logical GPU ids, it runs on the CPU as before. The node's /dev is a
temporary folder: a file named nvidia0 stands for a GPU's device node."""

from __future__ import annotations

import pytest
import torch

from pipeline.runtime import checkpoint
from pipeline.runtime.checkpoint import nvidia_gpus, resolve_device


@pytest.fixture()
def node(tmp_path, monkeypatch):
    """A /dev with no GPU (nvidiactl alone is the driver's control node, not a GPU); CUDA_VISIBLE_DEVICES unset."""
    (tmp_path / "null").touch()
    (tmp_path / "nvidiactl").touch()
    monkeypatch.setattr(checkpoint, "DEVICE_DIR", tmp_path)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert not torch.cuda.is_available()  # the CPU build, as in CI
    return tmp_path


def test_no_gpu_runs_on_the_cpu(node):
    assert nvidia_gpus() == []
    assert resolve_device("auto") == torch.device("cpu")


def test_rays_logical_gpu_ids_alone_run_on_the_cpu(node, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # tests: num_gpus=1 on a CPU node
    assert resolve_device("auto") == torch.device("cpu")


def test_a_gpu_with_the_cpu_torch_refuses_auto(node, monkeypatch):
    (node / "nvidia0").touch()
    (node / "nvidia1").touch()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert nvidia_gpus() == [str(node / "nvidia0"), str(node / "nvidia1")]
    with pytest.raises(RuntimeError) as refused:
        resolve_device("auto")
    message = str(refused.value)
    for said in ("nvidia0", "CPU build", "requirements-gpu.lock", "make install-gpu", "device: cpu"):
        assert said in message, said
    assert resolve_device("cpu") == torch.device("cpu")  # the way to run on the CPU anyway


def test_a_cuda_build_without_a_driver_refuses_too(node, monkeypatch):
    (node / "nvidia0").touch()
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.raises(RuntimeError, match=r"\(CUDA 13.0\) finds no usable CUDA device.*nvidia-smi.*device: cpu"):
        resolve_device("auto")


@pytest.mark.parametrize("hidden", ["", " ", "-1"])
def test_gpus_hidden_by_cuda_visible_devices_run_on_the_cpu(node, monkeypatch, hidden):
    (node / "nvidia0").touch()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
    assert nvidia_gpus() == []
    assert resolve_device("auto") == torch.device("cpu")
