"""The connector's worker side on a simulated CUDA device (FakeTensorMode: `cuda` tensors on this CPU-only torch).

On a GPU vLLM's cache write (FlashAttention's `reshape_and_cache_flash`) takes the keys, the values, the layer's
cache and the slot mapping on one device. The fake backend below asks the same of what the connector hands it, with
FlashAttention's cache shape and per-token keys and values (its kernel, the write itself, is vLLM's and not run
here). A follow-up's load also copies the history pass's blocks on the device, block to block, before the chunks'
columns. Controls: a slot mapping, or the block pairs, left on the host (the scheduler builds both there) fail it.

Runs where vLLM imports (`make test-vllm`); skipped elsewhere.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

pytest.importorskip("vllm")

from serve.engine.vllm import connector as connector_module  # noqa: E402
from serve.engine.vllm.connector import Claim, Load, QvpicConnector, QvpicConnectorMetadata  # noqa: E402

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


def load_on_fake_cuda(start: int, end: int, offset: int = 0) -> FlashLikeImpl:
    connector = QvpicConnector.__new__(QvpicConnector)  # its worker side alone: no vLLM config needed
    connector.block_size = BLOCK
    connector._layers = {f"model.layers.{i}.self_attn.attn": i for i in range(LAYERS)}
    impl = FlashLikeImpl()
    with FakeTensorMode(allow_non_fake_inputs=True):
        layers = {name: SimpleNamespace(kv_cache=torch.empty(BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, device="cuda"),
                                        impl=impl) for name in connector._layers}
        claim = Claim(torch.empty(LAYERS, 2, TOKENS - offset, HEADS, HEAD_DIM, device="cuda"), offset=offset)
        claim.history = ("history", [6, 7, 2])  # the history pass's blocks, held
        first = max(start, offset)
        blocks = [3, 5, 1]  # built on the host, as the scheduler does
        load = Load(claim.kv.narrow(2, first - offset, end - first),
                    connector_module.slots_of(blocks, BLOCK, first, end), connector._copies(claim, blocks, start))
        connector.bind_connector_metadata(QvpicConnectorMetadata([load]))
        connector.start_load_kv(SimpleNamespace(no_compile_layers=layers))
    return impl


def test_the_claim_is_written_on_the_cache_device_every_layer():
    impl = load_on_fake_cuda(16, TOKENS)  # vLLM's prefix cache held the first block
    assert impl.writes == [TOKENS - 16] * LAYERS


def test_a_follow_ups_history_blocks_are_copied_on_the_cache_device():
    impl = load_on_fake_cuda(16, TOKENS, offset=20)  # blocks 1 (a partial one) copied, then columns 20..40 written
    assert impl.writes == [TOKENS - 20] * LAYERS


def test_control_block_pairs_left_on_the_host_fail(monkeypatch):
    real = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: self if self.dim() == 2 else real(self, *a, **k))
    with pytest.raises(Exception, match="device"):
        load_on_fake_cuda(16, TOKENS, offset=20)


def test_control_a_slot_mapping_left_on_the_host_fails(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: self)  # nothing moves: the host's slots stay
    with pytest.raises(AssertionError, match="across devices"):
        load_on_fake_cuda(16, TOKENS)


@pytest.mark.parametrize("total, world", [(4, 1), (4, 2), (8, 4), (2, 4), (1, 2)])
def test_each_tensor_parallel_rank_writes_its_share_of_the_heads(total, world):
    """vLLM's rule (QKVParallelLinear): total // world KV heads a rank, or with fewer heads than ranks each head
    replicated on world // total consecutive ranks."""
    connector = QvpicConnector.__new__(QvpicConnector)
    kv = torch.arange(total).reshape(1, 1, 1, total, 1).expand(2, 2, 3, total, 4)
    shares = []
    for rank in range(world):
        connector._rank = rank, world
        shares.append(connector.heads(kv)[0, 0, 0, :, 0].tolist())
    if total >= world:
        assert shares == [list(range(r * total // world, (r + 1) * total // world)) for r in range(world)]
    else:
        assert shares == [[r // (world // total)] for r in range(world)]
