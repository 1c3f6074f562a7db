"""`ModelSpec.weights: host` (vLLM's engine): the VLM's parameters stay in host memory while `vlm.device`, where its
KV goes, is the accelerator. The forwards qvpic still runs there (a template prefix's `text_kv`, a repair's or the
lazy tier's compile through `build_sized_entry`) run on the CPU and hand their KV over on the device.

The device is simulated twice: `cuda:0` under FakeTensorMode (tests/support/fake_cuda.py: shapes and devices, no
data, a device mismatch raises), and `meta`, a second real placement whose forwards on the host run for real (images
included, which FakeTensorMode cannot: their layout is read back) and whose mixing with CPU tensors raises too.
Controls: the weights moved to the device (`weights_device = device`) and the KV left where the forward ran (no move
in `VLM._compile`) each fail the placement tests."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from torch._subclasses.fake_tensor import FakeTensorMode

from pipeline.runtime import VLM
from pipeline.store.entries import build_sized_entry
from schemas.config import ForwardSpec, ModelSpec, WeightsPlacement
from schemas.modes import Variant
from tests.support.fake_cuda import CUDA, HostReads

META = torch.device("meta")
FAMILIES = ["tiny-qwen", "tiny-glm", "tiny-llava"]  # M-RoPE (halves), M-RoPE (interleaved pairs), 1-D RoPE
TEXT = "The quarterly report lists revenue by region."


def page() -> Image.Image:
    image = Image.new("RGB", (64, 64), "white")
    image.paste((20, 40, 200), (8, 8, 40, 30))
    return image


@pytest.mark.parametrize("path", FAMILIES)
def test_on_a_gpu_the_weights_stay_on_the_host_and_the_kv_lands_on_the_device(path, monkeypatch):
    vlm = VLM(ModelSpec(path=path, device="cuda:0", weights=WeightsPlacement.HOST))
    assert vlm.device == CUDA and vlm.weights_device == torch.device("cpu")
    assert {p.device.type for p in vlm.model.parameters()} == {"cpu"}
    assert {b.device.type for b in vlm.model.buffers()} == {"cpu"}
    HostReads().install(monkeypatch)  # the compile reads its positions back: stand-ins (zeros) on a fake device
    with FakeTensorMode(allow_non_fake_inputs=True):
        prefix = vlm.text_kv(vlm.adapter.prefix_ids)  # what a vLLM claim starts with
        entry, sizes = build_sized_entry(vlm, None, TEXT, None, None, Variant.TEXT, images_root=None)  # a repair's
    assert prefix.kv.device == CUDA and prefix.kv.shape[3] == len(vlm.adapter.prefix_ids)
    assert entry.kv.device == CUDA and entry.num_tokens == len(vlm.adapter.encode(TEXT)) and sizes == []
    assert prefix.kv.dtype == entry.kv.dtype == torch.float32


@pytest.mark.parametrize("path", FAMILIES)
def test_a_second_placement_gets_the_hosts_kv_dtype_and_layout_and_the_rotations(path, vlm_bf16_by_path):
    """On `meta` the host's forwards run for real: text, pages, the template prefix — each KV on `meta`, with the
    dtype, shape and counts of the same compile with the weights where the KV is (the CPU)."""
    reference = vlm_bf16_by_path(path)
    vlm = VLM(reference.spec.model_copy(update={"device": "meta", "weights": WeightsPlacement.HOST}))
    assert {p.device.type for p in vlm.model.parameters()} == {"cpu"}
    pairs = [(vlm.text_kv(vlm.adapter.prefix_ids), reference.text_kv(reference.adapter.prefix_ids)),
             (vlm.compile_text(TEXT), reference.compile_text(TEXT)),
             (vlm.compile_images([page()]), reference.compile_images([page()]))]
    for got, want in pairs:
        assert got.kv.device == META
        assert (got.kv.dtype, got.kv.shape) == (torch.bfloat16, want.kv.shape)
        assert (got.position_span, got.compile_start, got.grid_thw, got.vision_tokens) == \
               (want.position_span, want.compile_start, want.grid_thw, want.vision_tokens)
    # re-anchoring's matrices are made where the KV is, from the model's rotary module on the host
    head_dim = want.kv.shape[-1]
    assert vlm.rotations([7], head_dim, META).shape == (1, head_dim, head_dim)
    assert vlm.rotations([7], head_dim, META).device == META


@pytest.fixture(scope="module")
def vlm_bf16_by_path():
    loaded: dict[str, VLM] = {}

    def get(path: str) -> VLM:
        if path not in loaded:
            loaded[path] = VLM(ModelSpec(path=path, device="cpu", dtype="bfloat16"))
        return loaded[path]

    return get


@pytest.mark.parametrize("vlm", ["tiny-qwen", "tiny-llava"], indirect=True)
def test_on_the_cpu_host_weights_compile_exactly_what_the_default_does(vlm):
    """The host is the device there: the same KV, bit for bit (text, pages, the template prefix)."""
    host = VLM(vlm.spec.model_copy(update={"weights": WeightsPlacement.HOST}))
    assert host.weights_device == host.device == torch.device("cpu")
    assert torch.equal(host.text_kv(host.adapter.prefix_ids).kv, vlm.text_kv(vlm.adapter.prefix_ids).kv)
    assert torch.equal(host.compile_text(TEXT).kv, vlm.compile_text(TEXT).kv)
    assert torch.equal(host.compile_images([page()]).kv, vlm.compile_images([page()]).kv)


def test_prefill_and_decode_refuse_weights_that_are_not_on_the_device():
    """qvpic's engine (and the eval's full prefill) keep their cache with the weights: with host weights on another
    device they say so rather than fail on a device mismatch mid-forward."""
    vlm = VLM(ModelSpec(path="tiny-qwen", device="meta", weights=WeightsPlacement.HOST))
    with pytest.raises(RuntimeError, match="needs the model's weights on meta.*model.weights: device"):
        vlm.prefill_full([TEXT], "What does it list?")
    with pytest.raises(RuntimeError, match="qvpic's engine needs the model's weights on meta"):
        vlm.use_forward(ForwardSpec())
