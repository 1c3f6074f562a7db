"""KV slab memory reused on a CPU (serve/engine/qvpic/slab_memory.py) — never while anything still uses it.

- a slab dropped gives its buffer to the next slab of its size class (the same memory: no fresh page to fault on),
  at once, without waiting for the cyclic collector (a slab's layers refer back to it weakly);
- a buffer one view of an old slab still holds is never handed out: that view keeps its values;
- free buffers stay within the bound, least recently taken dropped first; a bound of 0 reuses nothing;
- through the engine, a conversation's follow-up takes the memory of the turn before, and its answer equals a
  cold engine's (the prefix cache's tests compare answers with and without it: every slab there comes from here).
"""

from __future__ import annotations

import gc

import torch

from serve.engine.qvpic.batch import Slab
from serve.engine.qvpic.slab_memory import SLAB_MEMORY, SlabMemory, size_class

SHAPE = (2, 2, 1, 2, 300, 8)  # [layers, 2, rows, kv_heads, capacity, head_dim]


def slab(capacity: int = 300, rows: int = 1) -> Slab:
    return Slab.empty(2, rows, 2, capacity, 8, torch.float32, torch.device("cpu"), zeroed=False)


def test_size_classes_round_up_by_at_most_a_fifth_and_share_nearby_sizes():
    for numel in (1, 7, 1000, 4800, 4801, 123_457, 19_700_000):
        assert numel <= size_class(numel) <= numel * 1.19 + 1
    assert size_class(4800) == size_class(4700)  # nearly the same slab: one class


def test_a_dropped_slab_gives_its_memory_to_the_next_without_a_collection():
    gc.disable()  # a reference cycle would keep the first slab's memory until the collector runs
    try:
        first = slab()
        address = first.kv.data_ptr()
        del first
        second = slab(capacity=290)  # another size in the same class
        assert second.kv.data_ptr() == address
    finally:
        gc.enable()


def test_memory_a_view_still_holds_is_never_handed_out():
    pool = SlabMemory(1 << 30)
    old = pool.empty(SHAPE, torch.float32, "cpu")
    old.fill_(7.0)
    row = old[:, :, 0]  # someone still reads one row of the old slab
    del old
    new = pool.empty(SHAPE, torch.float32, "cpu")
    new.fill_(-1.0)
    assert new.data_ptr() != row.data_ptr()
    assert bool((row == 7.0).all())  # untouched by the new slab
    del row, new
    again = pool.empty(SHAPE, torch.float32, "cpu")  # now both are free: one of them comes back
    assert pool.reused == 1 and pool.allocated == 2
    del again


def test_free_memory_stays_within_its_bound_and_zero_keeps_none():
    one = size_class(3 * 300 * 8 * 8) * 4  # bytes of one buffer of the shapes below
    pool = SlabMemory(max_free_nbytes=2 * one)
    held = [pool.empty((3, 300, 8, 8), torch.float32, "cpu") for _ in range(4)]
    del held
    taken = pool.empty((1,), torch.float32, "cpu")  # each take trims what is free
    assert pool.free_nbytes() == 2 * one  # two of the four kept
    del taken
    none = SlabMemory(max_free_nbytes=0)
    none.empty(SHAPE, torch.float32, "cpu")  # dropped at once
    b = none.empty(SHAPE, torch.float32, "cpu")
    assert none.reused == 0 and none.allocated == 0 and b.shape == SHAPE


def test_a_follow_up_turn_takes_the_memory_of_the_turn_before(vlm):
    from schemas.config import EngineConfig
    from schemas.sampling import Sampling
    from serve.engine.prepared import LinkedContext
    from serve.engine.qvpic.engine import QvpicEngine
    from serve.engine.qvpic.linked_prompt import native_prompt
    from serve.engine.sequence import Sequence

    engine = QvpicEngine(vlm, EngineConfig(), start=False)
    chunks = [vlm.compile_text("The warranty covers two years of normal use.")]

    def run(question: str) -> Sequence:
        prompt = native_prompt(vlm, chunks, question)
        seq = Sequence(Sampling(max_new_tokens=3), LinkedContext(prompt, b"tenant"), prompt.num_tokens,
                       prompt.after.num_tokens, emit=lambda e: None)
        engine.add(seq)
        while engine.scheduler.busy:
            engine.step()
        return seq

    run("How long is the warranty?")
    reused = SLAB_MEMORY.reused
    run("How long is the warranty for parts?")
    assert SLAB_MEMORY.reused > reused
