"""What the inspector explains, checked without a browser: why placement gave each chunk its tier
(hand-worked rankings), and that the /ui pages ship inside the package and keep to their CSP."""

from __future__ import annotations

import re

import pytest

from schemas.report import TierReason
from serve.routing.placement import allocate, tier_reasons
from serve.ui.routes import ASSETS, CSP, PAGES, asset

P, TAU, B, BUDGET = TierReason.PROMOTED, TierReason.LOW_BY_TAU, TierReason.LOW_BY_B, TierReason.LOW_BY_BUDGET


# Shares of [0.9, 0.5, 0.3, 0.1] (sum 1.8): 0.500, 0.278, 0.167, 0.056; share above each in rank order:
# 0, 0.5, 0.778, 0.944.
@pytest.mark.parametrize("tau, max_high_res, costs, budget, expected", [
    (0.7, 1, [1, 1, 1, 1], None, [P, B, TAU, TAU]),  # B stops at one; τ cuts after the second
    (0.7, 4, [1, 1, 1, 1], None, [P, P, TAU, TAU]),
    (0.9, 3, [100, 1, 1, 1], 50, [BUDGET, P, P, TAU]),  # the first does not fit; its share still counts
    (0.0, 4, [1, 1, 1, 1], None, [TAU, TAU, TAU, TAU]),
    (1.0, 0, [1, 1, 1, 1], None, [B, B, B, B]),
])
def test_each_chunk_is_told_what_kept_it_low(tau, max_high_res, costs, budget, expected):
    relevance = [0.9, 0.5, 0.3, 0.1]
    assert tier_reasons(relevance, tau, max_high_res, costs, budget) == expected
    assert allocate(relevance, tau, max_high_res, costs, budget) == [r is P for r in expected]


def test_a_chunk_with_no_share_is_cut_by_tau_in_any_order():
    # the same chunks shuffled: reasons follow the chunks, the order of the request never changes
    assert tier_reasons([0.0, 0.9, -0.2, 0.3], 1.0, 9, [1] * 4, None) == [TAU, P, TAU, P]


def test_the_pages_ship_in_the_package_and_name_only_listed_assets():
    for name in [*ASSETS, *PAGES.values()]:
        assert asset(name)  # read through importlib.resources, as an installed package reads it
    referenced = {m for page in PAGES.values() for m in re.findall(r"/ui/static/([\w.]+)", asset(page).decode())}
    assert referenced and referenced <= set(ASSETS)
    with pytest.raises(FileNotFoundError):  # negative control: a name outside the package's static/ is absent
        asset("no-such-asset.js")


def test_the_pages_have_no_inline_script_style_or_handler():
    for page in PAGES.values():
        html = asset(page).decode()
        assert re.findall(r"<script(?![^>]*\bsrc=)", html) == []
        assert re.findall(r"\son\w+\s*=|\sstyle\s*=|<style", html) == []
    markup_sinks = r"\.innerHTML\b|\.outerHTML\b|insertAdjacentHTML|document\.write"
    for script in (n for n in ASSETS if n.endswith(".js")):
        assert re.findall(markup_sinks, asset(script).decode()) == []
    assert "script-src 'self'" in CSP and "unsafe" not in CSP and "http" not in CSP
    # negative control: the checks above see an inline script and a handler
    assert re.findall(r"<script(?![^>]*\bsrc=)", "<script>alert(1)</script>")
    assert re.findall(r"\son\w+\s*=", '<img src=x onerror="alert(1)">')
    assert re.findall(markup_sinks, "node.innerHTML = text;")
