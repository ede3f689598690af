"""Bootstrap intervals of perplexity ratios, and comparisons that are decided only when the interval says so.

Every cell of a study is evaluated on the same validation windows (``pathlab.training.evaluate``), so two cells
are compared *paired*: the windows are resampled together and the interval is that of r_a(L) / r_b(L), which
removes the variation of the text that both share. A comparison is decided (−1 or +1) when that interval
excludes 1, and undecided (0) otherwise; cells scored on different windows fall back to their two marginal
intervals, decided only when those are disjoint.

Windows are not the only source of spread: two trainings of one cell that differ only in their seed can differ by
more than the windows explain. Where a study trained second seeds, :func:`seed_margins` measures that spread and a
comparison passed ``margin=m`` is decided only when its interval lies wholly outside [1/m, m]: beyond what
retraining alone moved r by.
"""

from __future__ import annotations

import numpy as np

BOOTSTRAP_SAMPLES = 2000


def bootstrap_ratio(window_loss: np.ndarray, window_loss_train: np.ndarray, *, samples: int = BOOTSTRAP_SAMPLES,
                    seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of r = exp(mean(loss) − mean(loss_train)) with windows resampled with replacement."""
    a, b = np.asarray(window_loss, np.float64), np.asarray(window_loss_train, np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"window losses must be two equal 1-d arrays, got {a.shape} and {b.shape}")
    pick = np.random.default_rng(seed).integers(0, a.size, size=(samples, a.size))
    r = np.exp(a[pick].mean(1) - b[pick].mean(1))
    tail = 50 * (1 - level)
    return float(np.percentile(r, tail)), float(np.percentile(r, 100 - tail))


def order(a, b) -> int:
    """−1 when interval a lies wholly below interval b, +1 when wholly above, 0 when they overlap."""
    return -1 if a[1] < b[0] else (1 if a[0] > b[1] else 0)


def paired_ratio_interval(row_a: dict, row_b: dict, *, seed: int = 0) -> tuple[float, float] | None:
    """95% interval of r_a / r_b for two eval.json rows of one length (``window_loss``,
    ``window_loss_train_context``, ``window_starts``): r_a / r_b = exp(mean(d_a) − mean(d_b)) with
    d = loss − loss at the training context per window, the windows resampled together. None when the rows were
    not scored on the same windows."""
    starts = row_a.get("window_starts")
    if starts is None or starts != row_b.get("window_starts") or "window_loss" not in row_a or "window_loss" not in row_b:
        return None
    d_a = np.subtract(row_a["window_loss"], row_a["window_loss_train_context"])
    d_b = np.subtract(row_b["window_loss"], row_b["window_loss_train_context"])
    return bootstrap_ratio(d_a, d_b, seed=seed)


def paired_ratio(row_a: dict, row_b: dict, *, seed: int = 0) -> dict:
    """``{"ratio": r_a / r_b, "paired_ci95": its paired interval or None}`` for two eval.json rows of one length:
    the record the figures keep of a comparison between two cells."""
    return {"ratio": row_a["ratio"] / row_b["ratio"], "paired_ci95": paired_ratio_interval(row_a, row_b, seed=seed)}


def paired_table(eval_a: dict, eval_b: dict) -> list[dict]:
    """Cell a against cell b at every length both ``eval.json`` files hold: ``{"length", "r_a", "r_b", "ratio",
    "paired_ci95"}``, the interval seeded with the length as the figures seed theirs."""
    shared = sorted(set(eval_a["lengths"]) & set(eval_b["lengths"]), key=int)
    return [{"length": int(L), "r_a": eval_a["lengths"][L]["ratio"], "r_b": eval_b["lengths"][L]["ratio"],
             **paired_ratio(eval_a["lengths"][L], eval_b["lengths"][L], seed=int(L))} for L in shared]


def compare(row_a: dict, row_b: dict, *, seed: int = 0, margin: float = 1.0) -> int:
    """−1 when r_a is decidedly below r_b, +1 when decidedly above, 0 when undecided (module docstring): the
    interval of r_a / r_b must lie wholly below 1/margin or wholly above margin. On different windows that
    interval is the conservative (lo_a / hi_b, hi_a / lo_b), which at margin 1 decides exactly when the two
    marginal intervals are disjoint."""
    if margin < 1.0:
        raise ValueError(f"a margin is a ratio of at least 1, got {margin}")
    paired = paired_ratio_interval(row_a, row_b, seed=seed)
    if paired is None:
        (lo_a, hi_a), (lo_b, hi_b) = row_a["ratio_ci95"], row_b["ratio_ci95"]
        paired = (lo_a / hi_b, hi_a / lo_b)
    return order(paired, (1.0 / margin, margin))


def seed_margins(pairs) -> dict[int, float]:
    """The spread between seeds, per evaluation length: for pairs ``(eval_seed1, eval_seed2)`` of ``eval.json``
    files, m(L) = max over pairs of max(q, 1/q) with q = r_seed1(L) / r_seed2(L), at every length some pair has.

    The largest spread seen rather than a typical one, since a few pairs estimate it: a comparison that clears
    m(L) (``compare(..., margin=m(L))``) differs by more than any retraining of one cell did. ``{}`` without
    pairs.
    """
    spread: dict[int, float] = {}
    for a, b in pairs:
        for L in set(a["lengths"]) & set(b["lengths"]):
            q = a["lengths"][L]["ratio"] / b["lengths"][L]["ratio"]
            spread[int(L)] = max(spread.get(int(L), 1.0), q, 1.0 / q)
    return dict(sorted(spread.items()))


def margin_at(margins: dict | None, length: int) -> float:
    """The seed margin at ``length``: 1 without margins, the largest one where no pair reached this length."""
    if not margins:
        return 1.0
    return float(margins.get(int(length), max(margins.values())))


def verdict(orders, want: int) -> bool | None:
    """True when every comparison is decided the wanted way, False when any is decided the other way, None when
    an overlap leaves it open (or there is nothing to compare)."""
    orders = list(orders)
    if any(o == -want for o in orders):
        return False
    return True if orders and all(o == want for o in orders) else None
