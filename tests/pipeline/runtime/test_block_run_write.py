"""Issue 59 item 4's residual: a resumed prompt's prefix-cache blocks (`BlockRun`) into a slab row. On a GPU one
batched gather and one copy, whatever the number of blocks (a kernel launch per block was ~90 for a 1,500-column
conversation); on the CPU block by block (one pass over the bytes). Kernels counted on a simulated CUDA device
(tests/support/fake_cuda.py) by a dispatch counter; values checked on the CPU for both paths. Control (see the
report of the change that added this file): the per-block loop put back on CUDA fails the count."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline.runtime.kv import BlockRun, batched_write
from tests.support.fake_cuda import CUDA

BLOCK = (2, 2, 1, 4, 8)  # [layers, 2, kv_heads, block_tokens, head_dim]
COPIES = {"copy_", "cat", "_foreach_copy_", "index_copy_", "index_put_", "clone", "_to_copy", "stack"}


class Kernels(TorchDispatchMode):
    """The copying aten operations issued (each one kernel launch on a GPU; views are not counted)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in COPIES:
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def run(blocks: int, num_tokens: int, device: torch.device | str = "cpu") -> BlockRun:
    make = torch.randn if torch.device(device).type == "cpu" else torch.empty  # (the fake device has no generator)
    return BlockRun([make(BLOCK, device=device) for _ in range(blocks)], num_tokens, num_tokens)


def slab_row(device: torch.device | str = "cpu") -> torch.Tensor:
    """Row 1 of a 3-row slab of 40 columns: the strided view a slab row is."""
    return torch.empty(2, 2, 3, 1, 40, 8, device=device).zero_().select(2, 1)


@pytest.mark.parametrize("blocks, num_tokens", [(8, 30), (3, 12), (1, 2)])
def test_both_paths_write_the_runs_columns_and_nothing_past_them(blocks, num_tokens):
    source = run(blocks, num_tokens)
    for write in (source.write_into, lambda out: batched_write(source._parts(), out)):
        out = slab_row()
        write(out)
        assert torch.equal(out[:, :, :, :num_tokens], source.kv)  # the blocks concatenated: `kv`, cut
        assert not out[:, :, :, num_tokens:].any()


@pytest.mark.parametrize("blocks", [8, 3])
def test_on_a_gpu_a_run_is_two_kernels_whatever_its_blocks(blocks):
    with FakeTensorMode():
        source, out = run(blocks, 4 * blocks - 2, CUDA), slab_row(CUDA)
        with Kernels() as kernels:
            source.write_into(out)
    assert sorted(kernels.names) == ["cat", "index_copy_"]
