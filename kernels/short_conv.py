"""Triton kernels of PaTH's short convolution with SiLU behind the custom op ``pathlab::short_conv_silu``
(:mod:`pathlab.ops.short_conv`, where the op, its gradient and the reason for it are written out).

A causal depthwise convolution of width K over time, then SiLU, per channel c of ``x [B, T, C]``:

    z_t = Σ_k x_{t−K+1+k} f_k,   y_t = silu(z_t) = z_t σ(z_t)      (x_t = 0 for t < 0)

and its gradients, with g_t = dy_t silu'(z_t), silu'(z) = σ(z) (1 + z (1 − σ(z))):

    dx_τ = Σ_k g_{τ+K−1−k} f_k   (g_t = 0 for t ≥ T),      df_k = Σ_{b,t} g_t x_{t−K+1+k}

One program per (sequence b and a block of ``BLOCK_T`` steps, a block of ``BLOCK_C`` channels), in fp32, x of any
float dtype with unit channel stride. The backward recomputes z (it keeps nothing but x): for dx it forms g at
the K shifts t … t+K−1 of its block, each from K shifted loads of x that the cache serves after the first; for df
it writes one partial sum per program, ``[programs along B·T, C, K]``, which the op adds up (no atomics, so the
result does not depend on the order in which programs finish).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import KernelConfig
from .runtime import unwritten

# (steps, channels, warps) of a program's tile: the fastest forward+backward measured at the model's shape
# (x [64, 512, 768] bf16); with 64 steps and 4 warps the backward, which holds x and dy at several shifts, spilled
# registers. ``KernelConfig.short_conv_tile`` overrides it, for measurements.
TILE = (8, 64, 2)


def _tile(config):
    return TILE if config is None or config.short_conv_tile is None else config.short_conv_tile


@triton.jit
def _block(T, C, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """The program's sequence b (int64), its steps t ``[BLOCK_T]`` and channels c ``[BLOCK_C]``, and which
    channels exist."""
    n_tb = tl.cdiv(T, BLOCK_T)
    pid = tl.program_id(0)
    b = (pid // n_tb).to(tl.int64)
    t = (pid % n_tb) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    return b, t, c, c < C


@triton.jit
def _shifted(X, t, c, live_c, T, s_t):
    """x_t ``[BLOCK_T, BLOCK_C]`` in fp32 (X offset to one sequence), zero for t outside [0, T)."""
    live = ((t >= 0) & (t < T))[:, None] & live_c[None, :]
    return tl.load(X + t[:, None] * s_t + c[None, :], mask=live, other=0.0).to(tl.float32)


@triton.jit
def _tap(F, c, live_c, k, K: tl.constexpr):
    """f_k for the channels c (``F [C, K]`` contiguous), fp32, as a row ``[1, BLOCK_C]``."""
    return tl.load(F + c * K + k, mask=live_c, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _conv(X, F, t, c, live_c, T, s_t, K: tl.constexpr):
    """z_t = Σ_k x_{t−K+1+k} f_k."""
    z = _shifted(X, t - (K - 1), c, live_c, T, s_t) * _tap(F, c, live_c, 0, K)
    for k in tl.static_range(1, K):
        z += _shifted(X, t - (K - 1) + k, c, live_c, T, s_t) * _tap(F, c, live_c, k, K)
    return z


@triton.jit
def _short_conv_silu_fwd_kernel(X, F, Y, T, C, sx_b, sx_t, K: tl.constexpr,
                                BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """y = silu(z) into a contiguous ``Y [B, T, C]`` of Y's dtype."""
    b, t, c, live_c = _block(T, C, BLOCK_T, BLOCK_C)
    z = _conv(X + b * sx_b, F, t, c, live_c, T, sx_t, K)
    y = z * tl.sigmoid(z)
    tl.store(Y + (b * T + t[:, None]) * C + c[None, :], y.to(Y.dtype.element_ty),
             mask=(t < T)[:, None] & live_c[None, :])


@triton.jit
def _silu_grad(X, F, DY, t, c, live_c, T, s_t, sdy_t, K: tl.constexpr):
    """g_t = dy_t silu'(z_t), z recomputed from x; zero for t ≥ T."""
    z = _conv(X, F, t, c, live_c, T, s_t, K)
    s = tl.sigmoid(z)
    return _shifted(DY, t, c, live_c, T, sdy_t) * s * (1.0 + z * (1.0 - s))


@triton.jit
def _short_conv_silu_bwd_kernel(X, F, DY, DX, DF, T, C, sx_b, sx_t, sdy_b, sdy_t, K: tl.constexpr,
                                BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """dx into a contiguous ``DX [B, T, C]`` of DX's dtype; this program's part of df into ``DF [P, C, K]`` fp32,
    row P = program_id(0)."""
    b, t, c, live_c = _block(T, C, BLOCK_T, BLOCK_C)
    x = X + b * sx_b
    dy = DY + b * sdy_b
    g = _silu_grad(x, F, dy, t, c, live_c, T, sx_t, sdy_t, K)
    dx = g * _tap(F, c, live_c, K - 1, K)
    for j in tl.static_range(1, K):  # g_{t+j} reaches dx_t through f_{K−1−j}
        dx += _silu_grad(x, F, dy, t + j, c, live_c, T, sx_t, sdy_t, K) * _tap(F, c, live_c, K - 1 - j, K)
    tl.store(DX + (b * T + t[:, None]) * C + c[None, :], dx.to(DX.dtype.element_ty),
             mask=(t < T)[:, None] & live_c[None, :])
    df = DF + (tl.program_id(0).to(tl.int64) * C + c) * K
    for k in tl.static_range(K):  # g is zero for t ≥ T
        tl.store(df + k, tl.sum(g * _shifted(x, t - (K - 1) + k, c, live_c, T, sx_t), axis=0), mask=live_c)


def short_conv_silu_launch(x: torch.Tensor, taps: torch.Tensor, config: KernelConfig | None = None) -> torch.Tensor:
    """y = silu(causal depthwise conv(x, taps)); x ``[B, T, C]`` with unit channel stride, taps ``[C, K]``
    contiguous. Returns a contiguous y of x's dtype. ``config``: its ``short_conv_tile`` (None: ``TILE``)."""
    B, T, C = x.shape
    y = unwritten((B, T, C), dtype=x.dtype, device=x.device)
    block_t, block_c, warps = _tile(config)
    if y.numel():
        _short_conv_silu_fwd_kernel[(B * triton.cdiv(T, block_t), triton.cdiv(C, block_c))](
            x, taps, y, T, C, x.stride(0), x.stride(1), K=taps.shape[1], BLOCK_T=block_t, BLOCK_C=block_c,
            num_warps=warps)
    return y


def short_conv_silu_backward_launch(x: torch.Tensor, taps: torch.Tensor, dy: torch.Tensor,
                                    config: KernelConfig | None = None):
    """(dx ``[B, T, C]`` contiguous of x's dtype, dtaps ``[C, K]`` fp32) for y = short_conv_silu(x, taps); x and
    dy with unit channel stride, taps contiguous."""
    B, T, C = x.shape
    K = taps.shape[1]
    block_t, block_c, warps = _tile(config)
    grid = (B * triton.cdiv(T, block_t), triton.cdiv(C, block_c))
    dx = unwritten((B, T, C), dtype=x.dtype, device=x.device)
    parts = unwritten((grid[0], C, K), dtype=torch.float32, device=x.device)
    if dx.numel():
        _short_conv_silu_bwd_kernel[grid](x, taps, dy, dx, parts, T, C, x.stride(0), x.stride(1), dy.stride(0),
                                          dy.stride(1), K=K, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=warps)
    return dx, parts.sum(0)
