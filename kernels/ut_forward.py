"""The fused UT transform's forward kernel: the factors of every (chunk, kv head) from the inputs in place.

With A from the inverse kernel (``ut_common``), one program per (chunk, kv head) forms

    U  = A D_β W,   X = A D_β strictLower(W Kᵀ),   k̃ = K − Xᵀ W,   M = Wᵀ U
    per query head of the group:  Q_W = tril(Q Wᵀ),   q̃ = Q − Q_W U,   S_d = Q Kᵀ − Q_W X

with products on the operands that ``ut_common.half_operands`` picks: 11-bit significands, so every factor is off
by about 2⁻¹¹ of its size. For q̃, k̃ and S_d that error grows with |q| and |k|, and so do the logit errors it
makes: S_d is off by about 4·10⁻⁴ of |q|·|k| (with q, k × 200 at D = 64, some 14 nats RMS), where a softmax row
resolves differences of a fraction of a nat. A query head whose chunk bound max_i ‖q_i‖ · max_j ‖k_j‖ · scale
exceeds ``WIDE_LOGITS`` nats therefore forms its q̃ and S_d, and its kv head k̃, from products at fp32 level
(``_ut_fwd_split_kernel``: each operand in two fp16 parts, three products per product), a second kernel over the
chunks that rewrites those factors where the first kernel's bound says so, with no host synchronisation; below the
bound (unit-variance q and k at D = 64 give about 15) the chunk keeps the 16-bit products, and the second kernel
only reads its bounds. ``KernelConfig.ut_split_logits`` pins it on or off. Outputs are those of
:func:`kernels.ut_torch.ut_factors`: q̃ ``[H, NC, BT, D]``, k̃ ``[Hkv, NC, BT, D]``, M ``[Hkv, NC, D, D]``,
S_d ``[H, NC, BT, BT]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import DEFAULT
from .runtime import unwritten
from .ut_common import (_dot, _dot_split, _launch, _load_rows, _operand, _this_chunk, _check_tokens, _inverse,
                        _strides, _unit_last, half_operands)

# nats: a chunk whose logits may reach this takes fp32-level products; below it the 16-bit products leave S_d off
# by about 2.5·10⁻⁵ of the bound (RMS, measured at norm 1), under 3·10⁻³ nats
WIDE_LOGITS = 128.0


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
def _largest_row_norm(x):
    """max_i ‖x_i‖ of a tile ``[BT, D]``."""
    return tl.max(tl.sqrt(tl.sum(x * x, axis=1)), axis=0)


@triton.jit
def _ut_fwd_kernel(
    Q, K, W, BETA, TOK, AINV, QS, KS, M, SD, BOUND, NC, T, NTOK,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sw_b, sw_t, sw_h, sb_b, sb_t, sb_h,
    GROUP: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
):
    """The factors of one (chunk, kv head), and per query head h the bound max‖q_i‖ · max‖k_j‖ into
    ``BOUND [H, NC]`` for ``_ut_fwd_split_kernel``."""
    n, hk, rows, dcol, tok, valid, w, norm, k, b, a = _this_chunk(
        W, K, BETA, TOK, AINV, T, NTOK, sw_b, sw_t, sw_h, sk_b, sk_t, sk_h, sb_b, sb_t, sb_h, BT, D)
    k_norm = _largest_row_norm(k)
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
        tl.store(BOUND + h * NC + n, _largest_row_norm(q) * k_norm)


@triton.jit
def _ut_fwd_split_kernel(
    Q, K, W, BETA, TOK, AINV, QS, KS, SD, BOUND, NC, T, NTOK,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sw_b, sw_t, sw_h, sb_b, sb_t, sb_h, wide,
    GROUP: tl.constexpr, BT: tl.constexpr, D: tl.constexpr,
):
    """After ``_ut_fwd_kernel``, for one (chunk, kv head): where a query head's bound exceeds ``wide``, its q̃ and
    S_d again from fp32-level products (``_dot_split``), and the kv head's k̃ where any of the group's does:

        Q_W = tril(Q Wᵀ),   X = (A D_β) strictLower(W Kᵀ),   q̃ = Q − Q_W (A D_β) W,   S_d = Q Kᵀ − Q_W X,
        k̃ = K − Xᵀ W

    A kernel of its own, so that the 16-bit kernel keeps its registers and shared memory; a chunk below the bound
    reads its group's bounds and ends."""
    n = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1).to(tl.int64)
    largest = tl.load(BOUND + hk * GROUP * NC + n)
    for gi in range(1, GROUP):
        largest = tl.maximum(largest, tl.load(BOUND + (hk * GROUP + gi) * NC + n))
    if largest > wide:
        _, _, rows, dcol, tok, valid, w, _, k, b, a = _this_chunk(
            W, K, BETA, TOK, AINV, T, NTOK, sw_b, sw_t, sw_h, sk_b, sk_t, sk_h, sb_b, sb_t, sb_h, BT, D)
        ad = a * b[None, :]
        x = _dot_split(ad, tl.where(rows[:, None] > rows[None, :], _dot_split(w, tl.trans(k)), 0.0))
        tl.store(KS + ((hk * NC + n) * BT + rows[:, None]) * D + dcol[None, :], k - _dot_split(tl.trans(x), w))
        u = _dot_split(ad, w)
        for gi in range(GROUP):
            h = hk * GROUP + gi
            if tl.load(BOUND + h * NC + n) > wide:
                q = _load_rows(Q + h * sq_h, tok, valid, T, sq_b, sq_t, dcol)
                qw = tl.where(rows[:, None] >= rows[None, :], _dot_split(q, tl.trans(w)), 0.0)
                qrow = (h * NC + n) * BT + rows[:, None]
                tl.store(QS + qrow * D + dcol[None, :], q - _dot_split(qw, u))
                tl.store(SD + qrow * BT + rows[None, :], _dot_split(q, tl.trans(k)) - _dot_split(qw, x))


def wide_bound(scale: float, config=DEFAULT) -> float:
    """The kernel's ``wide``: max‖q_i‖ · max‖k_j‖ above which a chunk's q̃, k̃ and S_d take fp32-level products,
    ``WIDE_LOGITS / scale`` (0 or ∞ where ``config.ut_split_logits`` pins the split products on or off)."""
    if config.ut_split_logits is not None:
        return 0.0 if config.ut_split_logits else float("inf")
    return WIDE_LOGITS / scale


def ut_forward(q, k, w, beta, tokens, block, scan_dtype=torch.float32, config=DEFAULT, scale=None):
    """(q̃, k̃, M, S_d, A): the UT factors and the inverse they were formed with (``[Hkv, NC, BT, BT]`` fp32), so that
    a backward that has just recomputed the factors can hand A to :func:`ut_backward` instead of inverting again.
    q ``[B, T, H, D]``, k and raw w ``[B, T, Hkv, D]``, beta ``[B, T, Hkv]`` (any float dtype and strides), tokens
    from ``layout.slot_tokens``. k̃ and M are stored in ``scan_dtype`` (the scan's: no fp32 copies of them), the
    rest in fp32. ``scale`` (default 1/√D), the logits' scale, sets which chunks take fp32-level products
    (``wide_bound``)."""
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
    bound = unwritten((H, NC), **f32)
    a = _inverse(w, beta, tokens, T, BT, config=config)
    half = half_operands(q.dtype, config)
    if NC > 0:
        args = (q, k, w, beta, tokens, a)
        _launch(_ut_fwd_kernel, (NC, Hkv), *args, qs, ks, m, sd, bound, NC, T, B * T, *_strides(q, k, w, beta),
                GROUP=H // Hkv, BT=BT, D=D, HALF=half, config=config)
        wide = wide_bound(D ** -0.5 if scale is None else scale, config)
        if wide < float("inf"):
            _launch(_ut_fwd_split_kernel, (NC, Hkv), *args, qs, ks, sd, bound, NC, T, B * T,
                    *_strides(q, k, w, beta), wide, GROUP=H // Hkv, BT=BT, D=D, config=config)
    return qs, ks, m, sd, a
