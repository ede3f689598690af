"""M4: far mass against context length, and its prediction from training-length statistics.

For a query with near set N (K keys, distances < W) and far set F (M_L keys, distances ≥ W):

    ρ_D = Z_F / (Z_F + Z_N),    Z_S = Σ_{j∈S} e^{s_ij},    m_F = Z_F / M_L,
    Γ   = log Z_N − log m_F      (the effective score gap),
    ρ_D = M_L / (M_L + e^Γ)      (an identity).

When the per-token statistics are stationary in the distance (the mixing mechanism), Γ measured at the training
length predicts ρ_D at any length: a logistic in log M_L with midpoint M* = e^Γ.

Toy model (docs/theory.md#m4): K near keys at score a, far scores ~ N(0, σ²), so Z_N = K e^a, m_F = e^{σ²/2}.
"""

from __future__ import annotations

import warnings

import numpy as np

from pathlab.probes.bounds import far_mass_from_logits, logistic


def far_mass_from_gap(m_far, gap) -> np.ndarray:
    """ρ_D = M_L / (M_L + e^Γ), computed as a logistic (no overflow)."""
    m_far = np.asarray(m_far, dtype=np.float64)
    with np.errstate(divide="ignore"):
        return logistic(np.log(m_far) - np.asarray(gap, np.float64))


def effective_gap(log_z_near, log_m_far) -> np.ndarray:
    """Γ = log Z_N − log m_F."""
    return np.asarray(log_z_near, np.float64) - np.asarray(log_m_far, np.float64)


def toy_gap(k_near: int, near_score: float, far_sigma: float) -> float:
    """Γ of the toy model: log(K e^a) − σ²/2."""
    return float(np.log(k_near) + near_score - 0.5 * far_sigma ** 2)


def toy_far_mass(m_far, k_near: int = 64, near_score: float = 4.0, far_sigma: float = 1.0) -> np.ndarray:
    """Closed-form toy-model far mass M_L / (M_L + K e^{a − σ²/2})."""
    return far_mass_from_gap(m_far, toy_gap(k_near, near_score, far_sigma))


def simulate_toy_far_mass(m_far, k_near: int = 64, near_score: float = 4.0, far_sigma: float = 1.0,
                          trials: int = 100, *, seed: int = 0) -> np.ndarray:
    """Monte-Carlo far mass of the toy model, mean over trials, one value per entry of m_far."""
    rng = np.random.default_rng(seed)
    near = np.full((trials, k_near), float(near_score))
    out = []
    for m in np.atleast_1d(m_far):
        far = rng.normal(0.0, far_sigma, size=(trials, int(m)))
        out.append(far_mass_from_logits(near, far).mean())
    return np.asarray(out)


def fit_gap_from_training_length(log_z_near, log_m_far) -> float:
    """Γ̂: the median over queries of log Z_N − log m_F measured at the training length (robust to outliers)."""
    return float(np.median(effective_gap(log_z_near, log_m_far)))


def onset_length(gap: float, window: int, rise: float = 0.1, base_far_mass: float | None = None) -> float:
    """Length L where the predicted far mass first exceeds its base value (default: ρ̂ at M_L = 1) by `rise`.

    Solves M/(M + e^Γ) = ρ₀ + rise for M and returns L = W + M (inf if the target is ≥ 1).
    """
    rho0 = float(far_mass_from_gap(1.0, gap)) if base_far_mass is None else float(base_far_mass)
    target = rho0 + rise
    if target >= 1.0:
        return float("inf")
    return float(window + target / (1.0 - target) * np.exp(gap))


def fit_gap_per_head(gap, axis: int = -2) -> np.ndarray:
    """Γ̂ per head: the median over the sampled queries (``axis``) of the training-length gaps Γ_i, ignoring NaN
    (queries with an empty far set). NaN where no query has a far key."""
    gap = np.asarray(gap, np.float64)
    gap = np.where(np.isfinite(gap), gap, np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices -> NaN
        return np.nanmedian(gap, axis=axis)


def predict_far_mass(gap_train, m_far) -> np.ndarray:
    """M4 prediction from training-length statistics alone: ρ̂_D = M_L / (M_L + e^{Γ̂}).

    ``gap_train``: Γ_i = log Z_N − log m_F of the queries at the training length, ``[..., Q, H]``; ``m_far``: far-set
    sizes M_L = i − W + 1 at the evaluation length, ``[..., Q', H]`` (a count, no measurement at that length).
    Returns ``[..., Q', H]``: Γ̂ = median over the training queries per head (:func:`fit_gap_per_head`).
    """
    gap_hat = fit_gap_per_head(gap_train, axis=-2)  # [..., H]
    m_far = np.asarray(m_far, np.float64)
    if np.any(m_far < 0):
        raise ValueError("m_far (far-set sizes) must be ≥ 0")
    return far_mass_from_gap(m_far, gap_hat[..., None, :])
