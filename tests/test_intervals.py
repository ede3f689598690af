"""Paired and marginal interval comparisons of perplexity ratios (pathlab.intervals), on synthetic windows."""

from __future__ import annotations

import numpy as np
import pytest

from pathlab.intervals import bootstrap_ratio, compare, order, paired_ratio_interval, verdict


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


def test_verdict_needs_every_comparison_decided_the_wanted_way():
    assert verdict([-1, -1], -1) is True
    assert verdict([-1, 0], -1) is None
    assert verdict([-1, 0, 1], -1) is False
    assert verdict([], -1) is None


def test_bootstrap_ratio_refuses_mismatched_windows():
    with pytest.raises(ValueError, match="two equal 1-d arrays"):
        bootstrap_ratio([1.0, 2.0], [1.0])
