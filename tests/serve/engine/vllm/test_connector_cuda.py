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
from serve.engine.vllm.claims import Claim  # noqa: E402
from serve.engine.vllm.connector import Load, QvpicConnector, QvpicConnectorMetadata  # noqa: E402

pytestmark = pytest.mark.vllm
LAYERS, HEADS, HEAD_DIM, BLOCK, BLOCKS, TOKENS = 2, 2, 64, 16, 8, 40


class Streams:
    """torch.cuda's streams and events as a log: what ran on which stream, and who waited for whom (this torch has
    no CUDA; the order of the calls is what the connector decides)."""

    def __init__(self):
        self.current = "forward"  # the forward's stream
        self.log: list[tuple] = []

    def install(self, monkeypatch) -> None:
        streams = self

        class Stream:
            def __init__(self, device=None):
                self.name = "side"

            def wait_stream(self, other):
                streams.log.append(("wait_stream", self.name, other.name))

            def wait_event(self, event):
                streams.log.append(("wait_event", self.name, event.layer))

        class Current(Stream):
            def __init__(self):
                self.name = streams.current

        class Event:
            def record(self, stream):
                self.layer = streams.log[-1][2]  # the layer of the write just enqueued
                streams.log.append(("record", stream.name, self.layer))

        class On:
            def __init__(self, stream):
                self.stream, self.before = stream, None

            def __enter__(self):
                self.before, streams.current = streams.current, self.stream.name

            def __exit__(self, *exc):
                streams.current = self.before

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "stream", On)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Current())


STREAMS = Streams()


@pytest.fixture(autouse=True)
def fake_streams(monkeypatch):
    STREAMS.__init__()
    STREAMS.install(monkeypatch)
    return STREAMS


class FlashLikeImpl:
    """What vLLM's CUDA cache write needs: one device for everything, keys/values `[tokens, kv_heads, head_dim]`."""

    def __init__(self):
        self.writes: list[int] = []  # tokens written, per layer

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        kv_cache = kv_cache.tensor
        devices = {t.device for t in (key, value, kv_cache, slot_mapping)}
        assert devices == {torch.device("cuda", 0)}, f"a CUDA cache write across devices: {devices}"
        assert key.shape == value.shape == (slot_mapping.shape[0], HEADS, HEAD_DIM)
        assert key.is_contiguous() and value.is_contiguous()  # the kernel reads them flat: views, no copy
        assert kv_cache.transpose(1, 2).split(HEAD_DIM, dim=-1)[0].shape == (BLOCKS, BLOCK, HEADS, HEAD_DIM)
        self.writes.append(int(slot_mapping.shape[0]))
        STREAMS.log.append(("write", STREAMS.current, int(getattr(layer, "index", -1))))


class LoggedCache:
    """A layer's cache whose block copies (`index_copy_` on dim 0) are logged with the stream they ran on."""

    def __init__(self, tensor: torch.Tensor, index: int):
        self.tensor, self.index = tensor, index

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def index_select(self, dim, index):
        return self.tensor.index_select(dim, index)

    def index_copy_(self, dim, index, source):
        STREAMS.log.append(("copy", STREAMS.current, self.index))
        return self.tensor.index_copy_(dim, index, source)


def load_on_fake_cuda(start: int, end: int, offset: int = 0, attend: bool = True) -> FlashLikeImpl:
    """One step's load on fake CUDA: start_load_kv, then (`attend`) each layer's attention asks for its columns in
    the forward's order, then the forward ends (`wait_for_save`)."""
    connector = QvpicConnector.__new__(QvpicConnector)  # its worker side alone: no vLLM config needed
    connector.block_size = BLOCK
    connector._layers = {f"model.layers.{i}.self_attn.attn": i for i in range(LAYERS)}
    connector._todo, connector._ready, connector._stream = {}, {}, None
    impl = FlashLikeImpl()
    with FakeTensorMode(allow_non_fake_inputs=True):
        layers = {name: SimpleNamespace(kv_cache=LoggedCache(torch.empty(BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM,
                                                                          device="cuda"), i),
                                        impl=impl, index=i) for name, i in connector._layers.items()}
        claim = Claim(torch.empty(LAYERS, 2, TOKENS - offset, HEADS, HEAD_DIM, device="cuda"), offset=offset)
        claim.history = ("history", [6, 7, 2])  # the history pass's blocks, held
        first = max(start, offset)
        blocks = [3, 5, 1]  # built on the host, as the scheduler does
        load = Load(claim.kv.narrow(2, first - offset, end - first),
                    connector_module.slots_of(blocks, BLOCK, first, end), connector._copies(claim, blocks, start))
        connector.bind_connector_metadata(QvpicConnectorMetadata([load]))
        connector.start_load_kv(SimpleNamespace(no_compile_layers=layers))
        for name in connector._layers if attend else ():
            STREAMS.log.append(("attention", STREAMS.current, connector._layers[name]))
            connector.wait_for_layer_load(name)
        connector.wait_for_save()
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


# ---- layer by layer, on a side stream ------------------------------------------------------------------------
def test_each_layers_attention_waits_for_that_layers_writes_alone_which_ran_on_a_side_stream():
    """The order the connector puts on the device: a history pass's blocks copied on the forward's stream (the query's
    own cache write may share the last one), the side stream waiting for the forward's once, then each layer's
    columns on the side stream with an event a layer; layer i's attention waits for event i, and nothing else
    blocks the forward. Controls: the columns written on the forward's stream, or all the events waited for at the
    first layer, fail it."""
    load_on_fake_cuda(16, TOKENS, offset=20)
    log = STREAMS.log
    assert log == [("copy", "forward", 0), ("copy", "forward", 1), ("wait_stream", "side", "forward"),
                   ("write", "side", 0), ("record", "side", 0), ("write", "side", 1), ("record", "side", 1),
                   ("attention", "forward", 0), ("wait_event", "forward", 0),
                   ("attention", "forward", 1), ("wait_event", "forward", 1)]


def test_a_layer_whose_attention_never_asked_is_waited_for_when_the_forward_ends():
    """vLLM skips `wait_for_layer_load` where a layer has no attention metadata: the step still ends with the
    forward's stream after every write (the claim may be freed once the step returns)."""
    load_on_fake_cuda(16, TOKENS, attend=False)
    waited = [entry[2] for entry in STREAMS.log if entry[0] == "wait_event"]
    assert sorted(waited) == list(range(LAYERS))
