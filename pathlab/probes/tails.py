"""M3 (synthetic): concentration of far scores under a fully mixed transport.

For a far path the transport P is (close to) Haar, so Pk/‖k‖ is uniform on S^{d−1} and

    qᵀPk = ‖q‖‖k‖ x₁,   x ~ Unif(S^{d−1}):   E = 0,  Var = ‖q‖²‖k‖²/d.

Tail bounds overlaid on the empirical tail P(|qᵀPk| ≥ t):

* sphere:     P(|x₁| ≥ u) ≤ e^{−d u²/2}                                 (d ≥ 3)
* Lévy:       P(|F − EF| ≥ t) ≤ 2 exp(−c (d − 2) t² / L²),  c = 1/8, L = ‖q‖‖k‖ (F is L-Lipschitz on SO(d))
* Hoeffding (block SO(2), independent uniform phases): qᵀPk = Σ_b r_b cos(φ_b + δ_b), r_b = ‖q_b‖‖k_b‖,
              P(|qᵀPk| ≥ t) ≤ 2 exp(−t² / (2 Σ_b r_b²)).

Rotation pairs are (x[b], x[b + d/2]) (half split), as everywhere in pathlab.
"""

from __future__ import annotations

import numpy as np


def haar_scores(q, k, n_samples: int, *, seed: int = 0) -> np.ndarray:
    """n samples of qᵀPk with P Haar on SO(d) (equivalently Pk = ‖k‖ u, u uniform on the sphere)."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    rng = np.random.default_rng(seed)
    u = rng.normal(size=(n_samples, q.shape[-1]))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    return np.linalg.norm(k) * (u @ q)


def block_pair_norms(x) -> np.ndarray:
    """‖x_b‖ for the half-split pairs (x[b], x[b + d/2]); returns [d/2]."""
    x = np.asarray(x, np.float64)
    half = x.shape[-1] // 2
    if x.shape[-1] % 2:
        raise ValueError(f"the head dimension must be even for SO(2) blocks, got {x.shape[-1]}")
    return np.hypot(x[..., :half], x[..., half:])


def block_so2_scores(q, k, n_samples: int, *, seed: int = 0) -> np.ndarray:
    """n samples of qᵀPk with P = blockdiag(R(φ_b)), φ_b i.i.d. uniform: Σ_b r_b cos(φ_b + δ_b)."""
    r = block_pair_norms(q) * block_pair_norms(k)  # [d/2]
    rng = np.random.default_rng(seed)
    phi = rng.uniform(0.0, 2.0 * np.pi, size=(n_samples, r.shape[0]))
    return np.cos(phi) @ r  # the offsets δ_b are absorbed by the uniform phases


def sphere_tail_bound(t, dim: int, scale: float = 1.0) -> np.ndarray:
    """min(1, exp(−d (t/scale)² / 2)) with scale = ‖q‖‖k‖."""
    t = np.asarray(t, np.float64) / scale
    return np.minimum(1.0, np.exp(-0.5 * dim * t ** 2))


def levy_tail_bound(t, dim: int, lipschitz: float = 1.0, c: float = 1.0 / 8.0) -> np.ndarray:
    """min(1, 2 exp(−c (d − 2) t² / L²))."""
    t = np.asarray(t, np.float64)
    return np.minimum(1.0, 2.0 * np.exp(-c * (dim - 2) * t ** 2 / lipschitz ** 2))


def hoeffding_tail_bound(t, r) -> np.ndarray:
    """min(1, 2 exp(−t² / (2 Σ r_b²))) for block amplitudes r_b."""
    t = np.asarray(t, np.float64)
    return np.minimum(1.0, 2.0 * np.exp(-t ** 2 / (2.0 * np.sum(np.asarray(r, np.float64) ** 2))))


def empirical_tail(samples, t) -> np.ndarray:
    """P̂(|s| ≥ t) for each threshold in t."""
    a = np.sort(np.abs(np.asarray(samples, np.float64)))
    return 1.0 - np.searchsorted(a, np.asarray(t, np.float64), side="left") / a.size
