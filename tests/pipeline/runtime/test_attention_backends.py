"""Issue 59 item 3: the SDPA kernels the fused forward runs on CUDA are chosen on purpose (`ForwardSpec.
attention_kernels`), cuDNN attention left out of the default, and the configured set is what SDPA sees at every
call of a forward. The CPU keeps torch's own choice (nothing pinned). Controls: a default that lets cuDNN in, and a
forward that no longer pins the set, both fail (see the report of the change that added this file)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from torch.nn.attention import SDPBackend

from pipeline.runtime import fused as fused_module
from pipeline.runtime.fused import FusedDecoder, sdpa_backends
from pipeline.runtime.model import VLM
from schemas.config import AttentionKernel, ForwardSpec, ModelSpec
from serve.engine.qvpic.batch import Slab, forward
from tests.support.fake_cuda import CUDA


def enabled() -> dict[str, bool]:
    """Which SDPA backends torch's dispatcher may pick right now (the flags `sdpa_kernel` sets)."""
    cuda = torch.backends.cuda
    return {"flash": cuda.flash_sdp_enabled(), "efficient": cuda.mem_efficient_sdp_enabled(),
            "math": cuda.math_sdp_enabled(), "cudnn": cuda.cudnn_sdp_enabled()}


def test_the_default_on_cuda_is_flash_efficient_math_without_cudnn():
    chosen = sdpa_backends(ForwardSpec().attention_kernels, CUDA)
    assert chosen == [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    assert SDPBackend.CUDNN_ATTENTION not in chosen
    assert sdpa_backends(ForwardSpec().attention_kernels, torch.device("cpu")) is None  # the CPU: torch's choice
    # opting in is a config value, an enum; an empty set is refused where it is written
    assert sdpa_backends((AttentionKernel.CUDNN,), CUDA) == [SDPBackend.CUDNN_ATTENTION]
    assert ForwardSpec.model_validate({"attention_kernels": ["cudnn", "math"]}).attention_kernels == (
        AttentionKernel.CUDNN, AttentionKernel.MATH)
    with pytest.raises(ValidationError):
        ForwardSpec(attention_kernels=())


@pytest.mark.parametrize(("kernels", "expected"), [
    ((AttentionKernel.MATH,), {"flash": False, "efficient": False, "math": True, "cudnn": False}),
    (ForwardSpec().attention_kernels, {"flash": True, "efficient": True, "math": True, "cudnn": False}),
])
def test_the_configured_kernels_are_the_ones_sdpa_sees_at_every_call(kernels, expected, monkeypatch):
    vlm = VLM(ModelSpec(path="tiny-qwen"))
    spec = ForwardSpec(native_ops=False, attention_kernels=kernels)  # torch ops: the path a CUDA device runs
    decoder = FusedDecoder(vlm.model, spec)
    assert decoder.sdpa_backends is None  # built on the CPU: nothing pinned
    decoder.sdpa_backends = sdpa_backends(spec.attention_kernels, CUDA)  # what building it on a GPU sets
    shape = vlm.prefix.kv  # (the template prefix's own forward, by transformers: before the spy)
    slab = Slab.empty(shape.shape[0], 2, shape.shape[2], 16, shape.shape[4], vlm.dtype, vlm.device)
    seen, real = [], fused_module.F.scaled_dot_product_attention
    monkeypatch.setattr(fused_module.F, "scaled_dot_product_attention",
                        lambda *a, **k: seen.append(enabled()) or real(*a, **k))
    outside = enabled()
    vlm.fused = decoder
    try:
        for token in (10, 11):  # two decode steps (one new token: SDPA on each kv head's stacked queries)
            forward(vlm, slab, torch.tensor([[token], [token + 5]]), torch.ones(2, 1, dtype=torch.bool))
    finally:
        vlm.fused = None
    assert len(seen) == 2 * len(decoder.layers)  # every layer's attention, both steps
    assert all(flags == expected for flags in seen), seen
    assert enabled() == outside  # restored after the forward
