"""M2: learned spectral gaps, mixing windows and score-weighted decorrelation of a trained rotation model.

For step angles θ_{t,h,b} read from the model on real text (Φ = cumsum θ in fp64), block b being the pair of
coordinates (x_b, x_{b+D/2}) written as the complex number z_b = x_b + i x_{b+D/2}:

    γ_{h,b}    = |mean_t e^{iθ_{t,h,b}}|                         (ψ estimate, the per-block spectral gap)
    C_{h,b}(n) = mean_t e^{i(Φ_{t+n,h,b} − Φ_{t,h,b})}           (complex phase correlation at path length n)
    c_{h,b}(n) = |C_{h,b}(n)|                                   (the empirical coherence)
    W_{h,b}(ε) = min{n : c_{h,b}(n) ≤ ε}                        (and the i.i.d. prediction ⌈ln ε / ln γ⌉)

Score-weighted decorrelation (docs/theory.md#m2), for pairs (i, j) at distance n = i − j, the rotated logit
s_ij = Σ_b Re(conj(z_{q_i,b}) e^{i(Φ_i − Φ_j)_b} z_{k_j,b}) / √D and the same logit without rotation s⁰_ij:

    ρ_s(n) = E[s_ij s⁰_ij] / E[(s⁰_ij)²]                         (measured: :func:`score_decorrelation`)
    ρ̂_s(n) = Σ_b Re(u_b C_b(n)),  u_b = E[conj(z_{q,b}) z_{k,b} s⁰] / (√D E[(s⁰)²])   (predicted)

The prediction is exact when the phases are independent of q and k; Σ_b Re u_b = 1, so ρ̂_s(0) = 1. It generalises
the first-moment form Σ_b w_b Re C_b(n), w_b = E[q_bᵀk_b]/E[qᵀk] (no q_bᵀJk_b term) to the second moments that ρ_s
is made of. The per-head window of the near/far split is taken from its envelope

    c_h(n) = Σ_b |u_b| c_{h,b}(n) / Σ_b |u_b|  ∈ [0, 1],     W_h(ε) = min{n ≥ 1 : c_h(n) ≤ ε},

(a score-weighted average of the block coherences, with |ρ̂_s(n)| ≤ c_h(n) Σ_b |u_b|), which does not cross
zero where ρ̂_s oscillates (RoPE-like blocks), so a head gets a finite window only when the
blocks that carry its score energy have mixed. Heads with no such n ≤ n_max get a fallback width (see
:func:`head_windows`).

C(n) is an autocorrelation of e^{iΦ_t}, computed with an FFT in O(T log T) per block. Every function computes on
its input's device (fp64) and returns numpy.
"""

from __future__ import annotations

import numpy as np
import torch

from pathlab.probes.mixing import mixing_window


def phase_correlation(theta: torch.Tensor, n_max: int) -> np.ndarray:
    """C(n) = mean_{b,t} e^{i(Φ_{t+n} − Φ_t)} for n = 1 … n_max (complex), θ ``[B, T, H, Db]`` -> ``[n_max, H, Db]``."""
    if theta.ndim != 4:
        raise ValueError(f"theta must be [B, T, H, Db], got shape {tuple(theta.shape)}")
    B, T = theta.shape[:2]
    if not 1 <= n_max < T:
        raise ValueError(f"n_max must lie in [1, T) = [1, {T}), got {n_max}")
    size = 1 << int(np.ceil(np.log2(2 * T)))
    total = 0
    for b in range(B):  # one window at a time: the padded spectrum is 2T complex128 values per (head, block)
        phi = torch.cumsum(theta[b].to(torch.float64), dim=0)
        z = torch.polar(torch.ones_like(phi), torch.remainder(phi, 2 * np.pi))  # [T, H, Db] complex128
        f = torch.fft.fft(z, n=size, dim=0)
        total = total + torch.fft.ifft(f.conj() * f, dim=0)[1:n_max + 1]  # Σ_t z_{t+n} conj(z_t)
    counts = torch.arange(T - 1, T - n_max - 1, -1, dtype=torch.float64, device=theta.device)[:, None, None]
    return (total / (B * counts)).cpu().numpy()


def phase_autocorrelation(theta: torch.Tensor, n_max: int) -> np.ndarray:
    """c(n) = |mean_{b,t} e^{i(Φ_{t+n} − Φ_t)}| for n = 1 … n_max, θ ``[B, T, H, Db]`` -> ``[n_max, H, Db]``."""
    return np.abs(phase_correlation(theta, n_max))


def angle_statistics(theta: torch.Tensor, n_max: int, eps: float = 0.05) -> dict:
    """γ, c(n), empirical and predicted windows per head and block from step angles ``[B, T, H, Db]``."""
    gamma = torch.exp(torch.complex(torch.zeros_like(theta, dtype=torch.float64), theta.to(torch.float64)))
    gamma = gamma.mean(dim=(0, 1)).abs().cpu().numpy()  # [H, Db]
    c = phase_autocorrelation(theta, n_max)  # [n, H, Db]
    below = c <= eps
    w_emp = np.where(below.any(0), below.argmax(0) + 1.0, np.inf)
    return {"gamma": gamma, "coherence": c, "W_emp": w_emp, "W_pred": mixing_window(gamma, eps),
            "mean_angle": theta.to(torch.float64).mean(dim=(0, 1)).cpu().numpy()}


# ----------------------------------------------------------------------------------------------------------------
# score-weighted decorrelation ρ_s(n)


def score_decorrelation(s, s0, distance, edges) -> np.ndarray:
    """Measured ρ_s per distance bin: Σ_{pairs in bin} s·s⁰ / Σ_{pairs in bin} (s⁰)².

    ``s``, ``s0``: ``[P]`` or ``[P, H]`` logits of P query/key pairs with and without the rotation (P = I);
    ``distance``: ``[P]`` integer i − j ≥ 0; ``edges``: increasing integer bin edges, bin k = [edges_k, edges_{k+1}).
    Returns ``[n_bins]`` or ``[n_bins, H]``; NaN where a bin holds no pair (or only s⁰ = 0).
    Ratio of sums, i.e. E[s s⁰] / E[(s⁰)²] over the pairs of each bin.
    """
    s, s0 = np.asarray(s, np.float64), np.asarray(s0, np.float64)
    distance, edges = np.asarray(distance), np.asarray(edges)
    if s.shape != s0.shape or s.ndim not in (1, 2):
        raise ValueError(f"s and s0 must have the same shape [P] or [P, H], got {s.shape} and {s0.shape}")
    if distance.shape != s.shape[:1] or not np.issubdtype(distance.dtype, np.integer) or np.any(distance < 0):
        raise ValueError(f"distance must be non-negative integers of shape ({s.shape[0]},), got {distance.shape}")
    if edges.ndim != 1 or edges.size < 2 or np.any(np.diff(edges) <= 0):
        raise ValueError("edges must be an increasing 1-D array with at least two entries")
    idx = np.searchsorted(edges, distance, side="right") - 1  # [P]
    inside = (idx >= 0) & (distance < edges[-1])
    nb = edges.size - 1
    flat = s.reshape(s.shape[0], -1)
    flat0 = s0.reshape(s.shape[0], -1)
    cross = np.zeros((nb, flat.shape[1]))
    sq = np.zeros((nb, flat.shape[1]))
    np.add.at(cross, idx[inside], flat[inside] * flat0[inside])
    np.add.at(sq, idx[inside], flat0[inside] ** 2)
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = np.where(sq > 0, cross / sq, np.nan)
    return rho.reshape((nb,) + s.shape[1:])


def _complex_blocks(x: torch.Tensor) -> torch.Tensor:
    """z_b = x_b + i x_{b+D/2}: ``[..., D]`` real -> ``[..., D/2]`` complex128."""
    x = x.to(torch.float64)
    half = x.shape[-1] // 2
    return torch.complex(x[..., :half], x[..., half:])


def block_score_weights(q: torch.Tensor, k: torch.Tensor) -> np.ndarray:
    """u_b = Σ_{j≤i} conj(z_{q_i,b}) z_{k_j,b} s⁰_ij / (√D Σ_{j≤i} (s⁰_ij)²), s⁰_ij = q_iᵀk_j/√D.

    q, k: unrotated ``[B, T, H, D]`` (heads already expanded). Returns complex ``[H, D/2]``; Σ_b Re u_b = 1 for every
    head whose s⁰ is not identically 0 (NaN otherwise). O(B·T²·H·D): meant for the training length.
    """
    if q.ndim != 4 or q.shape != k.shape or q.shape[-1] % 2:
        raise ValueError(f"q and k must both be [B, T, H, D] with even D, got {tuple(q.shape)} and {tuple(k.shape)}")
    D, T = q.shape[-1], q.shape[1]
    scale = D ** -0.5
    causal = torch.tril(torch.ones(T, T, dtype=torch.float64, device=q.device))  # pairs j ≤ i
    num = torch.zeros(q.shape[2], D // 2, dtype=torch.complex128, device=q.device)
    den = torch.zeros(q.shape[2], dtype=torch.float64, device=q.device)
    for b in range(q.shape[0]):  # one window at a time: a [H, T, T] matrix
        qd, kd = q[b].to(torch.float64), k[b].to(q.device, torch.float64)  # [T, H, D]
        s0 = torch.einsum("ihd,jhd->hij", qd, kd) * scale * causal  # [H, T, T]
        weighted_k = torch.einsum("hij,jhc->ihc", s0.to(torch.complex128), _complex_blocks(kd))  # Σ_j s⁰_ij z_kj
        num += (_complex_blocks(qd).conj() * weighted_k).sum(0) * scale  # [H, Db]
        den += (s0 ** 2).sum(dim=(1, 2))
    with np.errstate(divide="ignore", invalid="ignore"):
        return (num / den[:, None]).cpu().numpy()


def predicted_score_decorrelation(corr, weights) -> np.ndarray:
    """ρ̂_s(n) = Σ_b Re(u_b C_b(n)): ``corr [n, H, Db]`` complex, ``weights [H, Db]`` complex -> ``[n, H]``."""
    corr, weights = np.asarray(corr), np.asarray(weights)
    if corr.ndim != 3 or weights.shape != corr.shape[1:]:
        raise ValueError(f"corr must be [n, H, Db] and weights [H, Db], got {corr.shape} and {weights.shape}")
    return np.real(corr * weights[None]).sum(-1)


def head_coherence(corr, weights) -> np.ndarray:
    """c_h(n) = Σ_b |u_b| |C_b(n)| / Σ_b |u_b| (1 at n = 0; NaN for a head with u = 0):
    ``corr [n, H, Db]``, ``weights [H, Db]`` -> ``[n, H]``."""
    corr, weights = np.asarray(corr), np.asarray(weights)
    if corr.ndim != 3 or weights.shape != corr.shape[1:]:
        raise ValueError(f"corr must be [n, H, Db] and weights [H, Db], got {corr.shape} and {weights.shape}")
    w = np.abs(weights)
    with np.errstate(divide="ignore", invalid="ignore"):
        return (np.abs(corr) * w[None]).sum(-1) / w.sum(-1)[None]


def head_windows(coherence, eps: float = 0.05, fallback: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per-head mixing window W_h(ε) = min{n ≥ 1 : c_h(n) ≤ ε} from ``coherence[k] = c(k + 1)``, ``[n, ...]``.

    Returns ``(W, fell_back)``, both of shape ``coherence.shape[1:]``: where no n ≤ n_max reaches ε (no mixing within
    the measured range, e.g. RoPE-like heads) W is ``fallback`` (the training context length, so far = beyond
    training; docs/theory.md#near-set) and ``fell_back`` is True; with ``fallback=None`` W is inf there. NaN
    coherence never mixes.
    """
    if not 0.0 < eps < 1.0:
        raise ValueError(f"eps must lie in (0, 1), got {eps}")
    if fallback is not None and (not np.isfinite(fallback) or fallback < 1):
        raise ValueError(f"fallback must be a finite width ≥ 1 or None, got {fallback}")
    c = np.asarray(coherence, np.float64)
    if c.ndim < 1 or c.shape[0] < 1:
        raise ValueError(f"coherence must be [n, ...] with n ≥ 1, got shape {c.shape}")
    below = c <= eps  # NaN compares False
    found = below.any(0)
    w = np.where(found, below.argmax(0) + 1.0, np.inf if fallback is None else float(fallback))
    return w, ~found
