"""The connector's worker side on a simulated CUDA device (FakeTensorMode: `cuda` tensors on this CPU-only torch).

On a GPU vLLM's cache write (FlashAttention's `reshape_and_cache_flash`) takes the keys, the values, the layer's
cache and the slot mapping on one device. The fake backend below asks the same of what the connector hands it, with
FlashAttention's cache shape and per-token keys and values (its kernel, the write itself, is vLLM's and not run
here). Control: a slot mapping left on the host (the scheduler builds it there) fails it.

Runs where vLLM imports (`make test-vllm`); skipped elsewhere.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

pytest.importorskip("vllm")

from serve.engine.vllm import connector as connector_module  # noqa: E402
from serve.engine.vllm.connector import CLAIMS, Claim, Load, QvpicConnector, QvpicConnectorMetadata  # noqa: E402

pytestmark = pytest.mark.vllm
LAYERS, HEADS, HEAD_DIM, BLOCK, BLOCKS, TOKENS = 2, 2, 64, 16, 8, 40


class FlashLikeImpl:
    """What vLLM's CUDA cache write needs: one device for everything, keys/values `[tokens, kv_heads, head_dim]`."""

    def __init__(self):
        self.writes: list[int] = []  # tokens written, per layer

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        devices = {t.device for t in (key, value, kv_cache, slot_mapping)}
        assert devices == {torch.device("cuda", 0)}, f"a CUDA cache write across devices: {devices}"
        assert key.shape == value.shape == (slot_mapping.shape[0], HEADS, HEAD_DIM)
        assert key.is_contiguous() and value.is_contiguous()  # the kernel reads them flat: views, no copy
        assert kv_cache.transpose(1, 2).split(HEAD_DIM, dim=-1)[0].shape == (BLOCKS, BLOCK, HEADS, HEAD_DIM)
        self.writes.append(int(slot_mapping.shape[0]))


def load_on_fake_cuda(start: int, end: int) -> FlashLikeImpl:
    connector = QvpicConnector.__new__(QvpicConnector)  # its worker side alone: no vLLM config needed
    connector.block_size = BLOCK
    connector._layers = {f"model.layers.{i}.self_attn.attn": i for i in range(LAYERS)}
    impl = FlashLikeImpl()
    with FakeTensorMode(allow_non_fake_inputs=True):
        layers = {name: SimpleNamespace(kv_cache=torch.empty(BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, device="cuda"),
                                        impl=impl) for name in connector._layers}
        CLAIMS.put("fake", Claim(torch.empty(LAYERS, 2, TOKENS, HEADS, HEAD_DIM, device="cuda")))
        try:
            slots = connector_module.slots_of([3, 5, 1], BLOCK, start, end)  # built on the host, as the scheduler does
            connector.bind_connector_metadata(QvpicConnectorMetadata([Load("fake", "r", start, end, slots)]))
            connector.start_load_kv(SimpleNamespace(no_compile_layers=layers))
        finally:
            CLAIMS.drop("fake")
    return impl


def test_the_claim_is_written_on_the_cache_device_every_layer():
    impl = load_on_fake_cuda(16, TOKENS)  # vLLM's prefix cache held the first block
    assert impl.writes == [TOKENS - 16] * LAYERS


def test_control_a_slot_mapping_left_on_the_host_fails(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: self)  # nothing moves: the host's slots stay
    with pytest.raises(AssertionError, match="across devices"):
        load_on_fake_cuda(16, TOKENS)
