"""Paired and marginal interval comparisons of perplexity ratios (pathlab.intervals), on synthetic windows."""

from __future__ import annotations

import numpy as np
import pytest

from pathlab.intervals import bootstrap_ratio, compare, margin_at, order, paired_ratio_interval, seed_margins, verdict


def _row(d, starts, base=3.0):
    """An eval.json row whose windows have loss − loss at the training context = d."""
    d = np.asarray(d, np.float64)
    lo, hi = bootstrap_ratio(base + d, np.full_like(d, base))
    return {"window_loss": list(base + d), "window_loss_train_context": [base] * len(d),
            "window_starts": list(starts), "ratio": float(np.exp(d.mean())), "ratio_ci95": [lo, hi]}


def test_pairing_decides_what_the_marginal_intervals_leave_open():
    rng = np.random.default_rng()
    text = rng.normal(0.0, 1.0, 32)  # how hard each window's text is, shared by both models
    a, b = _row(text + 0.1 + rng.normal(0, 0.01, 32), range(32)), _row(text, range(32))
    assert order(a["ratio_ci95"], b["ratio_ci95"]) == 0  # the marginal intervals overlap
    lo, hi = paired_ratio_interval(a, b)
    assert 1.0 < lo < hi < np.exp(0.2)
    assert compare(a, b) == 1 and compare(b, a) == -1
    assert paired_ratio_interval(b, b) == (1.0, 1.0) and compare(b, b) == 0  # no difference: undecided


def test_different_windows_fall_back_to_the_marginal_intervals():
    rng = np.random.default_rng()
    text = rng.normal(0.0, 1.0, 32)
    a, b = _row(text + 0.1, range(32)), _row(text, range(1, 33))
    assert paired_ratio_interval(a, b) is None and compare(a, b) == 0
    far = _row(text + 3.0, range(1, 33))
    assert compare(far, b) == 1


def test_a_margin_leaves_open_what_lies_within_the_seed_spread():
    rng = np.random.default_rng()
    text = rng.normal(0.0, 1.0, 64)
    a, b = _row(text + 0.1 + rng.normal(0, 0.01, 64), range(64)), _row(text, range(64))
    lo, hi = paired_ratio_interval(a, b)
    assert compare(a, b, margin=1.0) == 1
    assert compare(a, b, margin=(lo + 1.0) / 2) == 1  # the interval clears a margin below its lower end
    assert compare(a, b, margin=lo * 1.01) == 0 and compare(b, a, margin=lo * 1.01) == 0  # not one that reaches in
    assert compare(_row(text + 1.0, range(64)), b, margin=lo * 1.01) == 1  # a larger effect clears it
    far = _row(text + 3.0, range(1, 65))  # other windows: the conservative interval (lo_far / hi_b, hi_far / lo_b)
    lo_c = far["ratio_ci95"][0] / b["ratio_ci95"][1]
    assert compare(far, b, margin=lo_c * 0.99) == 1 and compare(far, b, margin=lo_c * 1.01) == 0
    with pytest.raises(ValueError, match="at least 1"):
        compare(a, b, margin=0.9)


def test_seed_margins_take_the_largest_spread_between_seeds_at_each_length():
    def ev(ratios):
        return {"lengths": {str(L): {"ratio": r} for L, r in ratios.items()}}

    pairs = [(ev({512: 1.0, 8192: 2.4, 65536: 3.0}), ev({512: 1.0, 8192: 2.0, 65536: 3.3})),
             (ev({512: 1.0, 8192: 1.0}), ev({512: 1.0, 8192: 1.1}))]
    margins = seed_margins(pairs)
    assert list(margins) == [512, 8192, 65536]
    assert margins[512] == 1.0 and margins[8192] == pytest.approx(1.2) and margins[65536] == pytest.approx(1.1)
    assert margin_at(margins, 8192) == pytest.approx(1.2)
    assert margin_at(margins, 16384) == pytest.approx(1.2)  # no pair there: the largest spread seen
    assert seed_margins([]) == {} and margin_at({}, 8192) == 1.0 and margin_at(None, 8192) == 1.0


def test_verdict_needs_every_comparison_decided_the_wanted_way():
    assert verdict([-1, -1], -1) is True
    assert verdict([-1, 0], -1) is None
    assert verdict([-1, 0, 1], -1) is False
    assert verdict([], -1) is None


def test_bootstrap_ratio_refuses_mismatched_windows():
    with pytest.raises(ValueError, match="two equal 1-d arrays"):
        bootstrap_ratio([1.0, 2.0], [1.0])
