"""M2: learned spectral gaps and mixing windows of a trained rotation model.

For step angles θ_{t,h,b} read from the model on real text (Φ = cumsum θ in fp64):

    γ_{h,b}   = |mean_t e^{iθ_{t,h,b}}|                         (ψ estimate, the per-block spectral gap)
    c_{h,b}(n) = |mean_t e^{i(Φ_{t+n,h,b} − Φ_{t,h,b})}|         (the empirical coherence at path length n)
    W_{h,b}(ε) = min{n : c_{h,b}(n) ≤ ε}                        (and the i.i.d. prediction ⌈ln ε / ln γ⌉)

c(n) is an autocorrelation of z_t = e^{iΦ_t}, computed with an FFT in O(T log T) per block.
"""

from __future__ import annotations

import numpy as np
import torch

from pathlab.probes.mixing import mixing_window


def phase_autocorrelation(theta: torch.Tensor, n_max: int) -> np.ndarray:
    """c(n) = |mean_{b,t} e^{i(Φ_{t+n} − Φ_t)}| for n = 1 … n_max, θ ``[B, T, H, Db]`` -> ``[n_max, H, Db]``."""
    B, T = theta.shape[:2]
    if not 1 <= n_max < T:
        raise ValueError(f"n_max must lie in [1, T) = [1, {T}), got {n_max}")
    phi = torch.cumsum(theta.to(torch.float64), dim=1)
    z = torch.polar(torch.ones_like(phi), torch.remainder(phi, 2 * np.pi))  # [B, T, H, Db] complex128
    size = 1 << int(np.ceil(np.log2(2 * T)))
    f = torch.fft.fft(z, n=size, dim=1)
    corr = torch.fft.ifft(f.conj() * f, dim=1)[:, 1:n_max + 1]  # Σ_t z_{t+n} conj(z_t)
    counts = torch.arange(T - 1, T - n_max - 1, -1, dtype=torch.float64)[:, None, None]
    return (corr.sum(0) / (B * counts)).abs().numpy()


def angle_statistics(theta: torch.Tensor, n_max: int, eps: float = 0.05) -> dict:
    """γ, c(n), empirical and predicted windows per head and block from step angles ``[B, T, H, Db]``."""
    gamma = torch.exp(torch.complex(torch.zeros_like(theta, dtype=torch.float64), theta.to(torch.float64)))
    gamma = gamma.mean(dim=(0, 1)).abs().numpy()  # [H, Db]
    c = phase_autocorrelation(theta, n_max)  # [n, H, Db]
    below = c <= eps
    w_emp = np.where(below.any(0), below.argmax(0) + 1.0, np.inf)
    return {"gamma": gamma, "coherence": c, "W_emp": w_emp, "W_pred": mixing_window(gamma, eps),
            "mean_angle": theta.to(torch.float64).mean(dim=(0, 1)).numpy()}
