"""M1: mixing of accumulated products ("finite mixing window").

For i.i.d. steps M_t with E[M_t] = A, the path product P_n = M_n ⋯ M_1 has E[P_n] = A^n, so its coherence

    c(n) = ‖E P_n‖_op ≤ γ^n,        γ := ‖E M_t‖_op,

decays geometrically and falls below ε after the mixing window W(ε) = ⌈ln ε / ln γ⌉ steps, whatever the context
length. Closed forms of γ used here:

* SO(2) block with angle θ:  ‖E R(θ)‖ = |ψ|, ψ = E e^{iθ};  θ ~ N(μ, σ²) gives |ψ| = e^{−σ²/2};
  θ = ω ξ with ξ ~ U[a, b] gives |ψ| = |sinc(ω (b − a) / 2)| (sinc x = sin x / x);
* Householder-like H = I − β w wᵀ with w ~ Unif(S^{d−1}):  E H = (1 − E β / d) I, so γ = 1 − E β / d;
* lazy Haar walk (identity with probability 1 − p, Haar SO(d) with probability p):  γ = 1 − p;
* RoPE (θ ≡ ω_b): |ψ_b| = 1, no mixing.

The Monte-Carlo estimates have a noise floor of about 1/√trials.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

AngleSampler = Callable[[np.random.Generator, tuple], np.ndarray]  # (rng, (trials, n, blocks)) -> θ
MatrixStep = Callable[[np.ndarray, np.random.Generator], np.ndarray]  # (P [trials, d, d], rng) -> M P


# ----------------------------------------------------------------------------------------------------------------
# closed forms


def rope_frequencies(head_dim: int, base: float = 10000.0) -> np.ndarray:
    """RoPE frequencies ω_b = base^{−2b/d}, b = 0 … d/2 − 1 (float64)."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even integer, got {head_dim}")
    return base ** (-2.0 * np.arange(head_dim // 2) / head_dim)


def gamma_gaussian(sigma) -> np.ndarray:
    """|E e^{iθ}| = e^{−σ²/2} for θ ~ N(μ, σ²)."""
    return np.exp(-0.5 * np.asarray(sigma, dtype=np.float64) ** 2)


def gamma_scaled_uniform(omega, low: float = 0.0, high: float = 2.0) -> np.ndarray:
    """|E e^{iωξ}| = |sinc(ω (high − low) / 2)| for ξ ~ U[low, high] (RoPE-scaled random angles, option A)."""
    half = 0.5 * np.asarray(omega, dtype=np.float64) * (high - low)
    return np.abs(np.sinc(half / np.pi))  # np.sinc(x) = sin(πx)/(πx)


def gamma_householder(dim: int, mean_beta: float) -> float:
    """γ = 1 − E β / d for H = I − β w wᵀ, w uniform on the sphere."""
    return 1.0 - mean_beta / dim


def gamma_from_angle_table(theta, probs=None) -> np.ndarray:
    """|ψ_b| = |Σ_v p(v) e^{iθ_b(v)}| for token-driven angles.

    theta: [V, ...] angle per token; probs: [V] token frequencies (uniform when None). Returns shape theta.shape[1:].
    """
    theta = np.asarray(theta, dtype=np.float64)
    probs = np.full(theta.shape[0], 1.0 / theta.shape[0]) if probs is None else np.asarray(probs, np.float64)
    if probs.shape != (theta.shape[0],) or np.any(probs < 0):
        raise ValueError(f"probs must be non-negative with shape ({theta.shape[0]},), got shape {probs.shape}")
    probs = probs / probs.sum()
    return np.abs(np.tensordot(probs, np.exp(1j * theta), axes=(0, 0)))


def mixing_window(gamma, eps: float = 0.05) -> np.ndarray:
    """W(ε) = ⌈ln ε / ln γ⌉ (inf where γ ≥ 1, 1 where γ ≤ ε)."""
    if not 0.0 < eps < 1.0:
        raise ValueError(f"eps must lie in (0, 1), got {eps}")
    gamma = np.asarray(gamma, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        w = np.ceil(np.log(eps) / np.log(np.clip(gamma, 1e-300, None)) - 1e-9)
    w = np.where(gamma >= 1.0, np.inf, np.maximum(w, 1.0))
    return w


def empirical_window(curve, eps: float = 0.05) -> float:
    """First path length n ≥ 1 with c(n) ≤ ε, for curve[k] = c(k + 1); inf if never reached."""
    below = np.nonzero(np.asarray(curve) <= eps)[0]
    return float(below[0] + 1) if below.size else math.inf


def noise_floor(trials: int) -> float:
    """Typical |mean of `trials` independent unit phasors| ≈ √(π / 4 trials): where c(n) stops following γ^n."""
    return math.sqrt(math.pi / (4.0 * trials))


# ----------------------------------------------------------------------------------------------------------------
# SO(2) ensembles (per block, complex phases)


def gaussian_angles(sigma: float, mu: float = 0.0) -> AngleSampler:
    """θ ~ N(μ, σ²) i.i.d."""
    return lambda rng, shape: rng.normal(mu, sigma, size=shape)


def scaled_uniform_angles(omega, low: float = 0.0, high: float = 2.0) -> AngleSampler:
    """θ_b = ω_b ξ, ξ ~ U[low, high] i.i.d. per position and block (option B of docs/theory.md#angles)."""
    omega = np.asarray(omega, dtype=np.float64)
    return lambda rng, shape: omega * rng.uniform(low, high, size=shape)


def rope_angles(omega) -> AngleSampler:
    """θ_b ≡ ω_b: RoPE, a deterministic step."""
    omega = np.asarray(omega, dtype=np.float64)
    return lambda rng, shape: np.broadcast_to(omega, shape).copy()


def so2_coherence(sampler: AngleSampler, n_max: int, trials: int, n_blocks: int = 1, *, seed: int = 0,
                  chunk: int = 100) -> np.ndarray:
    """c_b(n) = |mean_trials e^{iΦ_{n,b}}|, Φ_{n,b} = Σ_{t ≤ n} θ_{t,b}, for n = 1 … n_max.

    Returns [n_max, n_blocks]; c(n) of the full block-diagonal product is the max over blocks.
    """
    if n_max < 1 or trials < 1 or n_blocks < 1:
        raise ValueError(f"n_max, trials and n_blocks must be ≥ 1, got {n_max}, {trials}, {n_blocks}")
    rng = np.random.default_rng(seed)
    acc = np.zeros((n_max, n_blocks), dtype=np.complex128)
    for start in range(0, trials, chunk):
        m = min(chunk, trials - start)
        theta = sampler(rng, (m, n_max, n_blocks))  # [m, n, B]
        phi = np.cumsum(theta, axis=1, dtype=np.float64)
        acc += np.exp(1j * phi).sum(axis=0)
    return np.abs(acc / trials)


# ----------------------------------------------------------------------------------------------------------------
# matrix walks: Householder-like steps, lazy Haar walks


def householder_step(beta) -> MatrixStep:
    """P ← (I − β w wᵀ) P with w ~ Unif(S^{d−1}); beta is a number or a sampler rng, size -> β."""

    def step(P, rng):
        trials, d, _ = P.shape
        w = rng.normal(size=(trials, d))
        w /= np.linalg.norm(w, axis=1, keepdims=True)
        b = beta(rng, trials) if callable(beta) else np.full(trials, float(beta))
        return P - b[:, None, None] * w[:, :, None] * np.einsum("td,tde->te", w, P)[:, None, :]

    return step


def sigmoid_beta(rng: np.random.Generator, size: int) -> np.ndarray:
    """β = 2 σ(z), z ~ N(0, 1): the PaTH parameterisation with a random pre-activation (E β = 1)."""
    return 2.0 / (1.0 + np.exp(-rng.normal(size=size)))


def haar_so(d: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """[size, d, d] Haar-distributed rotations (QR of a Gaussian with the sign fix, then det = +1)."""
    q, r = np.linalg.qr(rng.normal(size=(size, d, d)))
    q = q * np.sign(np.diagonal(r, axis1=1, axis2=2))[:, None, :]
    flip = np.linalg.det(q) < 0
    q[flip, :, 0] *= -1.0
    return q


def lazy_haar_step(p: float) -> MatrixStep:
    """P ← M P with M = I (probability 1 − p) or Haar on SO(d) (probability p); E M = (1 − p) I."""

    def step(P, rng):
        trials, d, _ = P.shape
        move = rng.random(trials) < p
        if move.any():
            P = P.copy()
            P[move] = haar_so(d, int(move.sum()), rng) @ P[move]
        return P

    return step


def matrix_coherence(step: MatrixStep, dim: int, n_max: int, trials: int, *, seed: int = 0) -> dict:
    """Coherence of P_n = M_n ⋯ M_1 for a random matrix walk, n = 1 … n_max.

    Returns {"trace": (1/d) tr(mean P_n), "op": ‖mean P_n‖_op}, each [n_max].
    """
    if n_max < 1 or trials < 1 or dim < 2:
        raise ValueError(f"n_max, trials must be ≥ 1 and dim ≥ 2, got {n_max}, {trials}, {dim}")
    rng = np.random.default_rng(seed)
    P = np.broadcast_to(np.eye(dim), (trials, dim, dim)).copy()
    trace = np.empty(n_max)
    op = np.empty(n_max)
    for n in range(n_max):
        P = step(P, rng)
        mean = P.mean(axis=0)
        trace[n] = np.trace(mean) / dim
        op[n] = np.linalg.norm(mean, ord=2)
    return {"trace": trace, "op": op}
