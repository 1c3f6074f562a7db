"""Fidelity to full prefill: the metrics on known inputs, zero where linking is exact, positive where not."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pipeline.eval import Trace, compare, trace_full, trace_linked
from schemas.modes import CompilePrefix
from tests.pipeline.runtime.test_runtime_exactness import page, random_text

QUERY = "Question: which part ships on 12 March?\nAnswer:"


def test_compare_on_known_traces():
    hidden = torch.randn(3, 8)
    logits = torch.randn(3, 32)
    same = compare(Trace(hidden, logits), Trace(hidden, logits))
    assert (same.hidden_rel_l2, same.kl, same.top1_agreement, same.top5_overlap, same.num_tokens) == (
        0.0, 0.0, 1.0, 1.0, 3)
    # two positions over a 6-token vocabulary with hand-computable answers
    ref = torch.log(torch.tensor([[0.5, 0.5, 1e-9, 1e-9, 1e-9, 1e-9], [0.1, 0.2, 0.3, 0.05, 0.05, 0.3]]))
    other = torch.log(torch.tensor([[0.25, 0.75, 1e-9, 1e-9, 1e-9, 1e-9], [0.3, 0.2, 0.1, 0.05, 0.05, 0.3]]))
    h = torch.ones(2, 4)
    result = compare(Trace(2 * h, other), Trace(h, ref))
    kl_first = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    kl_second = 0.1 * math.log(0.1 / 0.3) + 0.3 * math.log(0.3 / 0.1)
    assert result.kl == pytest.approx((kl_first + kl_second) / 2, rel=1e-6)
    assert result.hidden_rel_l2 == pytest.approx(1.0)  # ‖2h − h‖ / ‖h‖
    assert result.top1_agreement == 0.0  # argmax 1 vs 0, then 0 vs 2 (ties go to the lower index)
    assert 0.0 < result.top5_overlap <= 1.0
    with pytest.raises(ValueError, match="different shapes"):
        compare(Trace(h[:1], other[:1]), Trace(h, ref))


def test_zero_where_linking_is_exact_positive_where_not(vlm):
    rng = random.Random(4)
    answer = vlm.adapter.encode(" XK-4471-B ships on 12 March")[:6]
    one = [[page(rng, 140, 98)]]
    exact = compare(trace_linked(vlm, vlm.assemble([vlm.compile_images(one[0])]), QUERY, answer),
                    trace_full(vlm, one, QUERY, answer))
    assert exact.num_tokens == len(answer) and exact.top1_agreement == 1.0 and exact.top5_overlap == 1.0
    assert exact.hidden_rel_l2 < 1e-5 and exact.kl < 1e-9
    pieces = [[page(rng, 84, 140)], random_text(rng, 20), [page(rng, 120, 90)]]
    chunks = [vlm.compile_text(p) if isinstance(p, str) else vlm.compile_images(p, CompilePrefix.TEMPLATE)
              for p in pieces]
    context = vlm.assemble(chunks)
    reference = trace_full(vlm, pieces, QUERY, answer)
    linked = compare(trace_linked(vlm, context, QUERY, answer), reference)
    assert linked.hidden_rel_l2 > 1e-4 and linked.kl > 1e-9  # no cross-chunk attention: a measurable cost
    again = compare(trace_linked(vlm, context, QUERY, answer), reference)
    assert again == linked  # the assembled context is not consumed by a trace
    assert not vlm.model.model.language_model.norm._forward_hooks  # the hidden-state hook is removed
