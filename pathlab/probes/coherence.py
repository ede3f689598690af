"""M6: value-side incoherence of the far contribution.

Model v_j = u_j + b with a shared background b. With Q/K-only transport the far output carries ρ_D b, a coherent
bias. With Q/K/V transport it carries Σ_F α_j P_{j→i} b, and per SO(2) block
Σ_j α_j R(Φ_i − Φ_j) b_b = R(Φ_i) [Σ_j α_j e^{−iΦ_j}] b_b, an empirical Fourier coefficient of the far weights.
The coherence ratio

    κ = ‖Σ_F α_j P_{j→i} b‖ / (ρ_D ‖b‖),     M_eff = ρ_D² / Σ_F α_j²,

is 1 for Q/K only and ≈ 1/√M_eff for fully mixed phases (≈ √(1 + 2W)/√M_eff with a window W). For i.i.d.
Gaussian steps (|E e^{iθ}| = γ) and equal weights, exactly E κ² = (1/M²) Σ_{j,k} γ^{|j−k|}.
"""

from __future__ import annotations

import numpy as np


def rotate_pairs(x, angle) -> np.ndarray:
    """Rotate the half-split pairs (x[b], x[b + d/2]) of x [..., d] by angle [..., d/2]."""
    x = np.asarray(x, np.float64)
    half = x.shape[-1] // 2
    c, s = np.cos(angle), np.sin(angle)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def effective_far_count(alpha_far) -> np.ndarray:
    """M_eff = ρ_D² / Σ_F α_j² for far weights [..., M]."""
    alpha = np.asarray(alpha_far, np.float64)
    rho = alpha.sum(-1)
    return rho ** 2 / np.sum(alpha ** 2, axis=-1)


def coherence_ratio(alpha_far, transport_angles, background) -> np.ndarray:
    """κ = ‖Σ_j α_j P_j b‖ / (ρ_D ‖b‖).

    alpha_far: [..., M] far weights; transport_angles: [..., M, d/2] angles Φ_i − Φ_j of P_{j→i} per block
    (None for Q/K only: P = I, κ = 1); background: [d] or [..., d].
    """
    alpha = np.asarray(alpha_far, np.float64)
    b = np.asarray(background, np.float64)
    if transport_angles is None:
        rotated = np.broadcast_to(b[..., None, :], alpha.shape + b.shape[-1:])
    else:
        rotated = rotate_pairs(np.broadcast_to(b[..., None, :], np.shape(transport_angles)[:-1] + b.shape[-1:]),
                               transport_angles)
    far = np.einsum("...m,...md->...d", alpha, rotated)
    return np.linalg.norm(far, axis=-1) / (alpha.sum(-1) * np.linalg.norm(b, axis=-1))


def simulate_incoherence(m_values, dim: int = 64, trials: int = 200, *, step_sigma: float | None = None,
                         seed: int = 0) -> dict:
    """Mean κ over trials for equal far weights α_j = 1/M, for each M in m_values.

    step_sigma None: fully mixed phases (independent uniform per key and block); otherwise the phases are a
    Gaussian random walk with step N(0, σ²) along the keys (a finite mixing window).
    Returns {"qkv": [len(m_values)], "qk": [...] (exactly 1), "m": m_values}.
    """
    rng = np.random.default_rng(seed)
    b = rng.normal(size=dim)
    qkv, qk = [], []
    for m in m_values:
        m = int(m)
        alpha = np.full(m, 1.0 / m)
        ratios = []
        for _ in range(trials):
            if step_sigma is None:
                phases = rng.uniform(0.0, 2.0 * np.pi, size=(m, dim // 2))
            else:
                phases = np.cumsum(rng.normal(0.0, step_sigma, size=(m, dim // 2)), axis=0)
            ratios.append(coherence_ratio(alpha, phases, b))
        qkv.append(float(np.mean(ratios)))
        qk.append(float(coherence_ratio(alpha, None, b)))
    return {"m": [int(m) for m in m_values], "qkv": qkv, "qk": qk}


def predicted_coherence(m, gamma: float = 0.0) -> np.ndarray:
    """√(E κ²) for equal weights and i.i.d. steps with |E e^{iθ}| = γ: √((1/M²) Σ_{j,k} γ^{|j−k|}).

    γ = 0 (fully mixed) gives 1/√M; for M ≫ W it approaches √((1 + γ)/(1 − γ)) / √M.
    """
    m = np.asarray(m, np.float64)
    if gamma == 0.0:
        return 1.0 / np.sqrt(m)
    # Σ_{j,k} γ^{|j−k|} = M + 2 Σ_{n=1}^{M−1} (M − n) γ^n, in closed form
    g = gamma
    s = m + 2.0 * (g * (m * (1 - g) - 1 + g ** m) / (1 - g) ** 2)
    return np.sqrt(s) / m
