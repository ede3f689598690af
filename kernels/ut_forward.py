"""The fused UT transform's forward kernel: the factors of every (chunk, kv head) from the inputs in place.

With A from the inverse kernel (``ut_common``), one program per (chunk, kv head) forms

    U  = A D_β W,   X = A D_β strictLower(W Kᵀ),   k̃ = K − Xᵀ W,   M = Wᵀ U
    per query head of the group:  Q_W = tril(Q Wᵀ),   q̃ = Q − Q_W U,   S_d = Q Kᵀ − Q_W X

with products on the operands that ``ut_common.half_operands`` picks. Outputs are those of
:func:`kernels.ut_torch.ut_factors`: q̃ ``[H, NC, BT, D]``, k̃ ``[Hkv, NC, BT, D]``, M ``[Hkv, NC, D, D]``,
S_d ``[H, NC, BT, BT]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import DEFAULT
from .runtime import unwritten
from .ut_common import (_dot, _launch, _load_rows, _operand, _this_chunk, _check_tokens, _inverse, _strides,
                        _unit_last, half_operands)


@triton.jit
def _chunk_factors(a, w, k, b, rows, HALF: tl.constexpr):
    """U = A D_β W and X = A D_β strictLower(W Kᵀ), and w and k as operands (``_operand``: w_h, whose scale is 1,
    and k_h, k_s)."""
    ad = a * b[None, :]
    ad_h, ad_s = _operand(ad, HALF)
    w_h, w_s = _operand(w, HALF, True)
    k_h, k_s = _operand(k, HALF)
    u = _dot(ad_h, ad_s, w_h, w_s, HALF)
    wk = tl.where(rows[:, None] > rows[None, :], _dot(w_h, w_s, tl.trans(k_h), k_s, HALF), 0.0)
    x = _dot(ad_h, ad_s, *_operand(wk, HALF), HALF)
    return u, x, w_h, k_h, k_s


@triton.jit
def _ut_fwd_kernel(
    Q, K, W, BETA, TOK, AINV, QS, KS, M, SD, NC, T, NTOK,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sw_b, sw_t, sw_h, sb_b, sb_t, sb_h,
    GROUP: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
):
    n, hk, rows, dcol, tok, valid, w, norm, k, b, a = _this_chunk(
        W, K, BETA, TOK, AINV, T, NTOK, sw_b, sw_t, sw_h, sk_b, sk_t, sk_h, sb_b, sb_t, sb_h, BT, D)
    u, x, w_h, k_h, k_s = _chunk_factors(a, w, k, b, rows, HALF)
    u_h, u_s = _operand(u, HALF)
    x_h, x_s = _operand(x, HALF)
    out = ((hk * NC + n) * BT + rows[:, None]) * D + dcol[None, :]
    tl.store(KS + out, k - _dot(tl.trans(x_h), x_s, w_h, 1.0, HALF))
    tl.store(M + (hk * NC + n) * D * D + dcol[:, None] * D + dcol[None, :],
             _dot(tl.trans(w_h), 1.0, u_h, u_s, HALF))
    lower = rows[:, None] >= rows[None, :]
    for gi in range(GROUP):
        h = hk * GROUP + gi
        q = _load_rows(Q + h * sq_h, tok, valid, T, sq_b, sq_t, dcol)
        q_h, q_s = _operand(q, HALF)
        qw_h, qw_s = _operand(tl.where(lower, _dot(q_h, q_s, tl.trans(w_h), 1.0, HALF), 0.0), HALF)
        qrow = (h * NC + n) * BT + rows[:, None]
        tl.store(QS + qrow * D + dcol[None, :], q - _dot(qw_h, qw_s, u_h, u_s, HALF))
        s = _dot(q_h, q_s, tl.trans(k_h), k_s, HALF) - _dot(qw_h, qw_s, x_h, x_s, HALF)
        tl.store(SD + qrow * BT + rows[None, :], s)


def ut_forward(q, k, w, beta, tokens, block, scan_dtype=torch.float32, config=DEFAULT):
    """(q̃, k̃, M, S_d, A): the UT factors and the inverse they were formed with (``[Hkv, NC, BT, BT]`` fp32), so that
    a backward that has just recomputed the factors can hand A to :func:`ut_backward` instead of inverting again.
    q ``[B, T, H, D]``, k and raw w ``[B, T, Hkv, D]``, beta ``[B, T, Hkv]`` (any float dtype and strides), tokens
    from ``layout.slot_tokens``. k̃ and M are stored in ``scan_dtype`` (the scan's: no fp32 copies of them), the
    rest in fp32."""
    _check_tokens(tokens, block)
    B, T, H, D = q.shape
    Hkv, BT = k.shape[2], block
    NC = tokens.numel() // BT
    q, k, w = _unit_last(q), _unit_last(k), _unit_last(w)
    f32 = dict(dtype=torch.float32, device=q.device)
    qs = unwritten((H, NC, BT, D), **f32)
    ks = unwritten((Hkv, NC, BT, D), dtype=scan_dtype, device=q.device)
    m = unwritten((Hkv, NC, D, D), dtype=scan_dtype, device=q.device)
    sd = unwritten((H, NC, BT, BT), **f32)
    a = _inverse(w, beta, tokens, T, BT, config=config)
    half = half_operands(q.dtype, config)
    if NC > 0:
        _launch(_ut_fwd_kernel, (NC, Hkv), q, k, w, beta, tokens, a, qs, ks, m, sd, NC, T, B * T,
                *_strides(q, k, w, beta), GROUP=H // Hkv, BT=BT, D=D, HALF=half, config=config)
    return qs, ks, m, sd, a
