"""Memory for KV slabs on a CPU, taken over from slabs that are gone (serve/engine/qvpic/batch.py `Slab`).

Every prefill lays its rows out in a new slab, and every join or leave of the running batch builds another:
`[layers, 2, rows, kv_heads, capacity, head_dim]`, ~20 MB for one 1,600-column row of bench-qwen. On a CPU the
allocator maps an allocation of that size afresh and hands it back to the kernel when it is freed, so each page of
the next slab faults at its first write: ~2,300 minor faults, ~5 ms of a 4-turn conversation's follow-up on a
2-core VM, in the row's assembly. Here a new slab takes a buffer that no tensor uses any more, when one of its size
class is kept. A GPU has torch's caching allocator for this, so only CPU slabs come from here.

A buffer is free when nothing but this pool references its storage (a slab and every view of it gone): that is
checked when a slab asks, never assumed, so a view someone still holds is never written over. Sizes are rounded up
to classes 2^(1/4) apart (at most ~19% more), so slabs of nearly the same size share buffers. Each time a slab is
taken, the free buffers beyond `max_free_nbytes` are dropped, the least recently taken first (so what is kept free is
at most that bound plus the slabs dropped since); 0 keeps none (every slab allocated afresh).
"""

from __future__ import annotations

import math
import threading

import torch

CLASSES_PER_DOUBLING = 4


def _users(buffer: torch.Tensor) -> int:
    """Tensors sharing `buffer`'s storage, the pool's own included."""
    storage = buffer.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata) - 1  # less the `storage` object made here


def size_class(numel: int) -> int:
    """The element count a buffer for `numel` elements gets: the next of the classes 2^(k/4)."""
    k = math.ceil(CLASSES_PER_DOUBLING * math.log2(max(numel, 1)))
    return max(numel, math.ceil(2 ** (k / CLASSES_PER_DOUBLING)))


class SlabMemory:
    def __init__(self, max_free_nbytes: int = 1 << 30):
        self.max_free_nbytes = max_free_nbytes
        self._buffers: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}  # (dtype, class) -> flat buffers
        self._taken: dict[int, int] = {}  # id(buffer) -> when it was last taken (a counter)
        self._clock = 0
        self._lock = threading.Lock()
        self.reused = self.allocated = 0  # slabs served from a kept buffer, and from a new one

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """An uninitialised tensor of `shape`: on a CPU a view of a kept buffer nobody uses, or of a new one kept."""
        numel = math.prod(shape)
        if torch.device(device).type != "cpu" or self.max_free_nbytes <= 0 or numel == 0:
            return torch.empty(shape, dtype=dtype, device=device)
        size = size_class(numel)
        with self._lock:
            self._clock += 1
            kept = self._buffers.setdefault((dtype, size), [])
            buffer = next((b for b in kept if _users(b) == 1), None)
            if buffer is None:
                with torch.inference_mode(False):  # a normal tensor: slabs are written in and out of inference mode
                    buffer = torch.empty(size, dtype=dtype)
                kept.append(buffer)
                self.allocated += 1
            else:
                self.reused += 1
            self._taken[id(buffer)] = self._clock
            view = buffer[:numel].view(shape)
            self._trim()
        return view

    def free_nbytes(self) -> int:
        with self._lock:
            return sum(b.numel() * b.element_size() for b in self._free())

    def _free(self) -> list[torch.Tensor]:
        return [b for kept in self._buffers.values() for b in kept if _users(b) == 1]

    def _trim(self) -> None:
        """Drop free buffers, least recently taken first, until the free ones fit `max_free_nbytes`."""
        free = sorted(self._free(), key=lambda b: self._taken[id(b)])
        total = sum(b.numel() * b.element_size() for b in free)
        for buffer in free:
            if total <= self.max_free_nbytes:
                break
            total -= buffer.numel() * buffer.element_size()
            self._buffers[(buffer.dtype, buffer.numel())].remove(buffer)
            del self._taken[id(buffer)]


# The process's pool: the engine sets its bound from `EngineConfig.slab_reuse_nbytes` (serve/engine/qvpic/engine.py).
SLAB_MEMORY = SlabMemory()
