"""Positional building blocks: RoPE frequencies, ALiBi slopes, accumulated phases and block rotations.

Rotations act on the pairs (x[..., b], x[..., b + D/2]), b = 0 … D/2 − 1 (the "half split"), with
R(φ) = [[cos φ, −sin φ], [sin φ, cos φ]].
"""

from __future__ import annotations

import math

import torch

TWO_PI = 2.0 * math.pi


def rope_frequencies(head_dim: int, base: float = 10000.0, device=None) -> torch.Tensor:
    """ω_b = base^(−2b/D), b = 0 … D/2 − 1, in fp64: ``[D/2]``."""
    if head_dim % 2 != 0 or head_dim <= 0:
        raise ValueError(f"rotations need an even head dim, got {head_dim}")
    if not base > 1:
        raise ValueError(f"rope base must be > 1, got {base!r}")
    b = torch.arange(head_dim // 2, dtype=torch.float64, device=device)
    return base ** (-2.0 * b / head_dim)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi head slopes m_h (Press et al.): for H a power of two m_h = 2^(−8h/H), h = 1 … H; otherwise the
    slopes of the nearest lower power of two c, then every other slope of 2c: ``[H]`` fp32."""
    if not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"n_heads must be a positive integer, got {n_heads!r}")

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    c = 2 ** int(math.floor(math.log2(n_heads)))
    slopes = power_of_two(c)
    if c < n_heads:
        slopes += power_of_two(2 * c)[0::2][: n_heads - c]
    return torch.tensor(slopes, dtype=torch.float32)


def accumulate_phases(theta: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Φ_t = Σ_{s≤t} θ_s along ``dim``, summed in fp64 and reduced mod 2π (so fp32 cos/sin stay accurate at 65K)."""
    return torch.remainder(torch.cumsum(theta.to(torch.float64), dim=dim), TWO_PI)


def rope_phases(length: int, head_dim: int, base: float = 10000.0, device=None) -> torch.Tensor:
    """RoPE as an accumulated rotation with constant steps: Φ_t = t·ω (mod 2π), fp64 ``[T, D/2]``."""
    t = torch.arange(length, dtype=torch.float64, device=device)
    return torch.remainder(t[:, None] * rope_frequencies(head_dim, base, device=device)[None, :], TWO_PI)


def rotate(x: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
    """Apply R(φ_b) to each pair (x_b, x_{b+D/2}). ``x [..., D]``, ``phase`` broadcastable to ``[..., D/2]``.

    cos/sin are taken in fp32 (fp64 for fp64 inputs) of the already-reduced phase, then cast to x's dtype.
    """
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos, sin = torch.cos(phase.to(work)), torch.sin(phase.to(work))
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].to(work), x[..., half:].to(work)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)
