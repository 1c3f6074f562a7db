"""One store and two in-process stacks over it, one per engine, shared by the vLLM engine's tests."""

from __future__ import annotations

import pytest

from schemas.config import ModelSpec

MODEL = ModelSpec(path="oracle-qwen", device="cpu")  # vLLM's CPU attention takes head_dim 64, not tiny-qwen's 16
KV_NBYTES = 256 << 20  # each engine's KV cap (vLLM's CPU backend would otherwise take 92% of the machine)


@pytest.fixture(scope="session")
def store_uri(tmp_path_factory) -> str:
    from pipeline.runtime import VLM, Embedder
    from tests.support.store_factory import build_store

    root = tmp_path_factory.mktemp("vllm-store")
    build_store(root, VLM(MODEL), Embedder())
    return str(root)


def stack(uri: str, kind: str):
    from serve import build_local

    return build_local({"store": uri, "model": MODEL.model_dump(), "router": {"max_chunks": 3},
                        "generator": {"engine": {"kind": kind, "max_batch_size": 4, "max_kv_nbytes": KV_NBYTES}},
                        "ingress": {"default_top_k": 2}})


@pytest.fixture(scope="session")
def stacks(store_uri):
    """(on qvpic's engine, on vLLM's), over the same store."""
    qvpic, vllm = stack(store_uri, "qvpic"), stack(store_uri, "vllm")
    yield qvpic, vllm
    qvpic.close()
    vllm.close()
