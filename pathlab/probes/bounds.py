"""M5: the far-mass lower bound for bounded logits.

If every logit of a query satisfies |s_ij| ≤ λ, then Z_F ≥ M_L e^{−λ} and Z_N ≤ K e^{λ}, hence

    ρ_D ≥ M_L / (M_L + K e^{2λ})  → 1  as M_L → ∞,

where K = |near set| and M_L = |far set|. Rotations are orthogonal, so |s_ij| ≤ ‖q_i‖‖k_j‖/√d stays bounded and the
bound applies to every accumulated-rotation model; ALiBi and FoX break its premise (logits unbounded below).

Turned around, the bound forces ρ_D ≥ ε once M_L ≥ ε/(1 − ε) · K e^{2λ}: the implied maximum safe length is

    L_max(ε) = W + ε/(1 − ε) · K e^{2λ}.
"""

from __future__ import annotations

import numpy as np


def far_mass_lower_bound(m_far, k_near, lam) -> np.ndarray:
    """M_L / (M_L + K e^{2λ}), computed as a logistic in log space (no overflow for large λ)."""
    m_far = np.asarray(m_far, dtype=np.float64)
    k_near = np.asarray(k_near, dtype=np.float64)
    lam = np.asarray(lam, dtype=np.float64)
    if np.any(m_far < 0) or np.any(k_near <= 0) or np.any(lam < 0):
        raise ValueError("far_mass_lower_bound needs m_far ≥ 0, k_near > 0 and lam ≥ 0")
    with np.errstate(divide="ignore"):
        z = np.log(m_far) - np.log(k_near) - 2.0 * lam
    return logistic(z)


def logistic(z) -> np.ndarray:
    """1 / (1 + e^{−z}) without overflow for large |z|."""
    z = np.asarray(z, dtype=np.float64)
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def max_safe_length(eps, k_near, lam, window) -> np.ndarray:
    """L_max(ε) = W + ε/(1 − ε) · K e^{2λ}: beyond it the bound forces far mass ≥ ε.

    The term is formed in log space: where it exceeds the largest float64 (λ of a few hundred, as ALiBi's and
    FoX's unbounded logits give) L_max is +inf, the bound forcing nothing at any length.
    """
    eps = np.asarray(eps, dtype=np.float64)
    if np.any((eps <= 0) | (eps >= 1)):
        raise ValueError(f"eps must lie in (0, 1), got {eps}")
    with np.errstate(divide="ignore"):
        log_term = (np.log(eps) - np.log1p(-eps) + np.log(np.asarray(k_near, np.float64))
                    + 2.0 * np.asarray(lam, np.float64))
    log_max = np.log(np.finfo(np.float64).max)
    term = np.where(log_term > log_max, np.inf, np.exp(np.minimum(log_term, log_max)))  # a NaN λ stays NaN
    return np.asarray(window, np.float64) + term


def _logsumexp(x: np.ndarray, axis: int = -1) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    return np.squeeze(m, axis) + np.log(np.sum(np.exp(x - m), axis=axis))


def far_mass_from_logits(near_logits, far_logits) -> np.ndarray:
    """ρ_D = Z_F / (Z_F + Z_N) for near logits [..., K] and far logits [..., M_L] (log-sum-exp, fp64)."""
    near = np.asarray(near_logits, dtype=np.float64)
    far = np.asarray(far_logits, dtype=np.float64)
    log_zn, log_zf = _logsumexp(near), _logsumexp(far)
    return 1.0 / (1.0 + np.exp(log_zn - log_zf))


def simulate_bounded_logits(m_far: int, k_near: int, lam: float, trials: int, *, seed: int = 0,
                            distribution: str = "uniform") -> dict:
    """Random logits with |s| ≤ λ: far mass per trial against the bound.

    distribution: "uniform" (s ~ U[−λ, λ] for every key), "adversarial" (near keys at +λ, far keys at −λ: the bound
    is attained exactly) or "two-point" (each logit ±λ with probability 1/2).
    Returns {"far_mass": [trials], "bound": float, "min_far_mass": float, "violations": int}.
    """
    if trials < 1 or m_far < 1 or k_near < 1 or lam < 0:
        raise ValueError("simulate_bounded_logits needs trials, m_far, k_near ≥ 1 and lam ≥ 0")
    rng = np.random.default_rng(seed)
    if distribution == "uniform":
        near = rng.uniform(-lam, lam, size=(trials, k_near))
        far = rng.uniform(-lam, lam, size=(trials, m_far))
    elif distribution == "two-point":
        near = lam * rng.choice([-1.0, 1.0], size=(trials, k_near))
        far = lam * rng.choice([-1.0, 1.0], size=(trials, m_far))
    elif distribution == "adversarial":
        near = np.full((trials, k_near), float(lam))
        far = np.full((trials, m_far), -float(lam))
    else:
        raise ValueError(f"distribution must be 'uniform', 'two-point' or 'adversarial', got {distribution!r}")
    rho = far_mass_from_logits(near, far)
    bound = float(far_mass_lower_bound(m_far, k_near, lam))
    return {"far_mass": rho, "bound": bound, "min_far_mass": float(rho.min()),
            "violations": int(np.sum(rho < bound * (1.0 - 1e-12)))}
