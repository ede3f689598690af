"""The fused UT transform's backward kernels: (dq, dk, dw, dβ) from the factors' gradients.

The backward runs the inverse kernel again (unless the caller hands it A) and recomputes U, X from (W, K, β), so
autograd keeps only the inputs. Given dq̃, dk̃, dM, dS_d, in reverse order of the forward (``ut_forward``), and last
through the normalisation, dw_raw = (dW − (dW·w) w) / ‖w_raw‖ (dW / ε where ‖w_raw‖ ≤ ε):

    dU = W dM − Σ_g Q_Wᵀ dq̃,   dX = −W dk̃ᵀ − Σ_g Q_Wᵀ dS_d
    dQ_W = tril(−dq̃ Uᵀ − dS_d Xᵀ),   dQ = dq̃ + dS_d K + dQ_W W
    dK = dk̃ + Σ_g dS_dᵀ Q + dWKᵀ W,   dWK = strictLower((A D_β)ᵀ dX)
    d(A D_β) = dU Wᵀ + dX strictLower(W Kᵀ)ᵀ,   dA = d(A D_β) D_β,   dβ_j += Σ_i A_ij d(A D_β)_ij
    dN = strictLower(−Aᵀ dA Aᵀ),   dβ_i += Σ_j dN_ij (W Wᵀ)_ij,   dG = D_β dN
    dW = U dMᵀ − X dk̃ + Σ_g dQ_Wᵀ Q + (A D_β)ᵀ dU + dWK K + (dG + dGᵀ) W

Three kernels per (chunk, kv head): the per-head products (grouped query heads summed inside the program, no
atomics); the paths through U and X; the paths through A D_β, the inverse and the normalisation. Where the first
needs more shared memory than a GPU gives a program (D = 128), it runs as five (``split_backward``): dq and the
group's sums then run one program per query head and the sums meet in fp32 atomics. Between kernels the gradients
pass through scratch (fp32, or scaled fp16 tiles: ``narrow_scratch``).

Also the UT transform alone as a differentiable custom op pair (``pathlab::path_ut_fwd``/``_bwd``), for tests and
benchmarks of the transform by itself: :func:`ut_factors_triton`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import DEFAULT, config_id, config_of, pick
from .layout import slot_tokens
from .runtime import unwritten
from .ut_common import (FP16, _dot, _check_tokens, _chunk_rows, _inverse, _launch, _load_rows, _load_w_beta, _mm,
                        _operand, _strides, _this_chunk, _to_half, _unit_last, half_operands, num_warps)
from .ut_forward import _chunk_factors, ut_forward


# Scratch between the backward's kernels (dU, dX, the partial dk and dw, d(A D_β)): fp32 tiles, or with ``NARROW``
# (``narrow_scratch``) each tile as its scaled fp16 operand of ``_to_half`` and the scale, one fp32 per tile, in
# ``SC [4, Hkv, NC]``: slot 0 dU, 1 dX and then d(A D_β) over it, 2 the partial dk, 3 the partial dw and then dw
# so far.


@triton.jit
def _store_scratch(X, SC, offs, slot, x, NARROW: tl.constexpr):
    """x ``[BT, ·]`` fp32 into scratch X at ``offs``, or with ``NARROW`` as ``_to_half(x)``: the fp16 tile there and
    its scale at ``SC + slot`` (``slot``: the flat index of (slot, kv head, chunk) in ``SC``)."""
    if NARROW:
        xh, xs = _to_half(x)
        tl.store(X + offs, xh)
        tl.store(SC + slot, xs)
    else:
        tl.store(X + offs, x)


@triton.jit
def _scratch_operand(X, SC, offs, slot, NARROW: tl.constexpr, HALF: tl.constexpr):
    """A scratch tile as a product operand (``_operand``): with ``NARROW`` the stored fp16 tile and scale as they
    are (no reduction: the same operand ``_operand`` makes of the fp32 tile)."""
    if NARROW:
        return tl.load(X + offs), tl.load(SC + slot)
    else:
        return _operand(tl.load(X + offs), HALF)


@triton.jit
def _scratch_value(X, SC, offs, slot, NARROW: tl.constexpr):
    """A scratch tile in fp32 (with ``NARROW`` the fp16 tile times its scale: 2⁻¹¹ relative per element)."""
    if NARROW:
        return tl.load(X + offs).to(tl.float32) * tl.load(SC + slot)
    else:
        return tl.load(X + offs)


@triton.jit
def _end_gradients(w_h, u_h, u_s, x_h, x_s, dk_end, dm, HALF: tl.constexpr):
    """The paths through k̃ = K − Xᵀ W and M = Wᵀ U, from operands (``_operand``) of w, U and X: (dU, dX, dK,
    dW) so far."""
    dm_h, dm_s = _operand(dm, HALF)
    dke_h, dke_s = _operand(dk_end, HALF)
    du = _dot(w_h, 1.0, dm_h, dm_s, HALF)  # M = Wᵀ U
    dw = _dot(u_h, u_s, tl.trans(dm_h), dm_s, HALF)
    dx = -_dot(w_h, 1.0, tl.trans(dke_h), dke_s, HALF)  # k̃ = K − Xᵀ W
    dw -= _dot(x_h, x_s, dke_h, dke_s, HALF)
    return du, dx, dk_end, dw


@triton.jit
def _chunk_end_gradients(W, K, BETA, TOK, AINV, DKS, DM, NC, T, NTOK, sw_b, sw_t, sw_h, sk_b, sk_t, sk_h,
                         sb_b, sb_t, sb_h, BT: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr):
    """The program's chunk (as ``_this_chunk``), U and X, the operands of w, U, X and K (``_operand``; w's scale
    is 1), the offsets of its ``[BT, D]`` rows and :func:`_end_gradients` from its dk̃ and dM."""
    n, hk, rows, dcol, tok, valid, w, norm, k, b, a = _this_chunk(
        W, K, BETA, TOK, AINV, T, NTOK, sw_b, sw_t, sw_h, sk_b, sk_t, sk_h, sb_b, sb_t, sb_h, BT, D)
    u, x, w_h, k_h, k_s = _chunk_factors(a, w, k, b, rows, HALF)
    u_h, u_s = _operand(u, HALF)
    x_h, x_s = _operand(x, HALF)
    chunk = ((hk * NC + n) * BT + rows[:, None]) * D + dcol[None, :]
    dm = tl.load(DM + (hk * NC + n) * D * D + dcol[:, None] * D + dcol[None, :])
    du, dx, dk, dw = _end_gradients(w_h, u_h, u_s, x_h, x_s, tl.load(DKS + chunk), dm, HALF)
    return (n, hk, rows, dcol, tok, valid, u, x, w_h, u_h, u_s, x_h, x_s, k_h, k_s, chunk,
            du, dx, dk, dw)


@triton.jit
def _ut_bwd_end_kernel(
    K, W, BETA, TOK, AINV, DKS, DM, DU, DX, DKP, DWP, US, XS, NC, T, NTOK,
    sk_b, sk_t, sk_h, sw_b, sw_t, sw_h, sb_b, sb_t, sb_h,
    BT: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
):
    """Backward, split form (large D), first part: :func:`_end_gradients` into the fp32 scratch that
    ``_ut_bwd_sums_kernel`` adds to, and U, X for ``_ut_bwd_dq_kernel``; its own kernel so that no program
    holds dM's D×D tile, or the tiles that form U and X, beside the query heads' tiles."""
    n, hk, rows, dcol, tok, valid, u, x, w_h, u_h, u_s, x_h, x_s, k_h, k_s, chunk, du, dx, dk, dw = \
        _chunk_end_gradients(W, K, BETA, TOK, AINV, DKS, DM, NC, T, NTOK, sw_b, sw_t, sw_h, sk_b, sk_t, sk_h,
                             sb_b, sb_t, sb_h, BT, D, HALF)
    square = ((hk * NC + n) * BT + rows[:, None]) * BT + rows[None, :]
    tl.store(US + chunk, u)
    tl.store(XS + square, x)
    tl.store(DU + chunk, du)
    tl.store(DX + square, dx)
    tl.store(DKP + chunk, dk)
    tl.store(DWP + chunk, dw)


@triton.jit
def _query_head_dq(dq_start, dqs_h, dqs_s, ds_h, ds_s, u_h, u_s, x_h, x_s, k_h, k_s, w_h, lower,
                   HALF: tl.constexpr):
    """One query head's dQ (final) and dQ_W = tril(−dq̃ Uᵀ − dS_d Xᵀ), this also as an operand (``_operand``),
    from dq̃ and the operands of dq̃, dS_d, U, X, K and w (the scale of w's is 1)."""
    dqw = -(_dot(dqs_h, dqs_s, tl.trans(u_h), u_s, HALF) + _dot(ds_h, ds_s, tl.trans(x_h), x_s, HALF))
    dqw = tl.where(lower, dqw, 0.0)
    dqw_h, dqw_s = _operand(dqw, HALF)
    dq = dq_start + _dot(ds_h, ds_s, k_h, k_s, HALF) + _dot(dqw_h, dqw_s, w_h, 1.0, HALF)
    return dq, dqw, dqw_h, dqw_s


@triton.jit
def _query_head_sums(q, w_h, dqs_h, dqs_s, ds_h, ds_s, dqw_h, dqw_s, lower, du, dx, dk, dw, HALF: tl.constexpr):
    """One query head's terms of dU, dX, dK and dW (the sums over the group), from q and the operands of w,
    dq̃, dS_d and dQ_W."""
    q_h, q_s = _operand(q, HALF)
    qw_h, qw_s = _operand(tl.where(lower, _dot(q_h, q_s, tl.trans(w_h), 1.0, HALF), 0.0), HALF)
    du -= _dot(tl.trans(qw_h), qw_s, dqs_h, dqs_s, HALF)
    dx -= _dot(tl.trans(qw_h), qw_s, ds_h, ds_s, HALF)
    dk += _dot(tl.trans(ds_h), ds_s, q_h, q_s, HALF)
    dw += _dot(tl.trans(dqw_h), dqw_s, q_h, q_s, HALF)
    return du, dx, dk, dw


@triton.jit
def _ut_bwd_heads_kernel(
    Q, K, W, BETA, TOK, AINV, DQS, DKS, DM, DSD, DQ, DU, DX, DKP, DWP, SC, NC, T, NTOK,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sw_b, sw_t, sw_h, sb_b, sb_t, sb_h,
    GROUP: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, NARROW: tl.constexpr = False,
):
    """Backward, first half: dq of every query head of the group (final), and dU, dX and the partial dk, dw
    (everything but the paths through A D_β and W Kᵀ) into scratch ``[Hkv, NC, BT, ·]`` (``_store_scratch``)."""
    n, hk, rows, dcol, tok, valid, u, x, w_h, u_h, u_s, x_h, x_s, k_h, k_s, chunk, du, dx, dk, dw = \
        _chunk_end_gradients(W, K, BETA, TOK, AINV, DKS, DM, NC, T, NTOK, sw_b, sw_t, sw_h, sk_b, sk_t, sk_h,
                             sb_b, sb_t, sb_h, BT, D, HALF)
    lower = rows[:, None] >= rows[None, :]
    H = GROUP * tl.num_programs(1)
    for gi in range(GROUP):
        h = hk * GROUP + gi
        qrow = (h * NC + n) * BT + rows[:, None]
        dq_start = tl.load(DQS + qrow * D + dcol[None, :])
        dqs_h, dqs_s = _operand(dq_start, HALF)
        ds_h, ds_s = _operand(tl.load(DSD + qrow * BT + rows[None, :]), HALF)
        dq, dqw, dqw_h, dqw_s = _query_head_dq(dq_start, dqs_h, dqs_s, ds_h, ds_s, u_h, u_s, x_h, x_s, k_h, k_s,
                                               w_h, lower, HALF)
        tl.store(DQ + (tok[:, None] * H + h) * D + dcol[None, :], dq, mask=valid[:, None])  # contiguous [B, T, H, D]
        q = _load_rows(Q + h * sq_h, tok, valid, T, sq_b, sq_t, dcol)
        du, dx, dk, dw = _query_head_sums(q, w_h, dqs_h, dqs_s, ds_h, ds_s, dqw_h, dqw_s, lower, du, dx, dk, dw,
                                          HALF)
    tile, NT = hk * NC + n, NC * tl.num_programs(1)
    _store_scratch(DU, SC, chunk, tile, du, NARROW)
    _store_scratch(DX, SC, ((hk * NC + n) * BT + rows[:, None]) * BT + rows[None, :], NT + tile, dx, NARROW)
    _store_scratch(DKP, SC, chunk, 2 * NT + tile, dk, NARROW)
    _store_scratch(DWP, SC, chunk, 3 * NT + tile, dw, NARROW)


@triton.jit
def _query_head_chunk(W, BETA, TOK, T, NTOK, sw_b, sw_t, sw_h, sb_b, sb_t, sb_h,
                      GROUP: tl.constexpr, BT: tl.constexpr, D: tl.constexpr):
    """For a program (chunk n, query head h) of a ``(NC, H)`` grid: n, h, its kv head, rows, columns, the rows'
    flat tokens and validity, w (as ``_load_w_beta``), and the offsets of the chunk's ``[BT, D]`` and
    ``[BT, BT]`` blocks in the kv heads' buffers and in the query head's."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    NC = tl.num_programs(0)
    hk = h // GROUP
    rows = tl.arange(0, BT)
    dcol = tl.arange(0, D)
    tok = tl.load(TOK + n * BT + rows)
    valid = tok < NTOK
    w, norm, b = _load_w_beta(W, BETA, hk, tok, valid, T, sw_b, sw_t, sw_h, sb_b, sb_t, sb_h, dcol)
    kv_row = (hk * NC + n) * BT + rows[:, None]
    head_row = (h * NC + n) * BT + rows[:, None]
    return (n, h, hk, rows, dcol, tok, valid, w, kv_row * D + dcol[None, :], head_row * D + dcol[None, :],
            kv_row * BT + rows[None, :], head_row * BT + rows[None, :])


@triton.jit
def _ut_bwd_dq_kernel(
    K, W, BETA, TOK, DQS, DSD, DQ, US, XS, DQW, T, NTOK,
    sk_b, sk_t, sk_h, sw_b, sw_t, sw_h, sb_b, sb_t, sb_h,
    GROUP: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
):
    """Backward, split form: one program per (chunk, query head): dq (final) from U and X (``US``, ``XS``, from
    ``_ut_bwd_end_kernel``), and dQ_W into ``DQW [H, NC, BT, BT]`` for ``_ut_bwd_sums_kernel``."""
    n, h, hk, rows, dcol, tok, valid, w, kv_chunk, head_chunk, kv_square, head_square = _query_head_chunk(
        W, BETA, TOK, T, NTOK, sw_b, sw_t, sw_h, sb_b, sb_t, sb_h, GROUP, BT, D)
    w_h, _ = _operand(w, HALF, True)
    dq_start = tl.load(DQS + head_chunk)
    dq, dqw, dqw_h, dqw_s = _query_head_dq(
        dq_start, *_operand(dq_start, HALF), *_operand(tl.load(DSD + head_square), HALF),
        *_operand(tl.load(US + kv_chunk), HALF), *_operand(tl.load(XS + kv_square), HALF),
        *_operand(_load_rows(K + hk * sk_h, tok, valid, T, sk_b, sk_t, dcol), HALF), w_h,
        rows[:, None] >= rows[None, :], HALF)
    tl.store(DQ + (tok[:, None] * tl.num_programs(1) + h) * D + dcol[None, :], dq, mask=valid[:, None])
    tl.store(DQW + head_square, dqw)


@triton.jit
def _ut_bwd_sums_kernel(
    Q, W, BETA, TOK, DQS, DSD, DQW, DU, DX, DKP, DWP, T, NTOK,
    sq_b, sq_t, sq_h, sw_b, sw_t, sw_h, sb_b, sb_t, sb_h,
    GROUP: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
):
    """Backward, split form: one program per (chunk, query head) adds :func:`_query_head_sums` to the scratch
    that ``_ut_bwd_end_kernel`` wrote, by fp32 atomics (the heads of a group meet there; no loop over the
    group, whose loop-invariant tiles took more shared memory than an H200 has with Triton 3.6)."""
    n, h, hk, rows, dcol, tok, valid, w, kv_chunk, head_chunk, kv_square, head_square = _query_head_chunk(
        W, BETA, TOK, T, NTOK, sw_b, sw_t, sw_h, sb_b, sb_t, sb_h, GROUP, BT, D)
    q = _load_rows(Q + h * sq_h, tok, valid, T, sq_b, sq_t, dcol)
    zero_d = tl.zeros((BT, D), tl.float32)
    w_h, _ = _operand(w, HALF, True)
    du, dx, dk, dw = _query_head_sums(q, w_h, *_operand(tl.load(DQS + head_chunk), HALF),
                                      *_operand(tl.load(DSD + head_square), HALF),
                                      *_operand(tl.load(DQW + head_square), HALF), rows[:, None] >= rows[None, :],
                                      zero_d, tl.zeros((BT, BT), tl.float32), zero_d, zero_d, HALF)
    tl.atomic_add(DU + kv_chunk, du, sem="relaxed")
    tl.atomic_add(DX + kv_square, dx, sem="relaxed")
    tl.atomic_add(DKP + kv_chunk, dk, sem="relaxed")
    tl.atomic_add(DWP + kv_chunk, dw, sem="relaxed")


@triton.jit
def _ut_bwd_chunk_kernel(
    K, W, BETA, TOK, AINV, DU, DX, DKP, DWP, DK, DAD, SC, NC, T, NTOK,
    sk_b, sk_t, sk_h, sw_b, sw_t, sw_h, sb_b, sb_t, sb_h,
    BT: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, NARROW: tl.constexpr = False,
):
    """Backward, the paths through U = A D_β W and X = A D_β strictLower(W Kᵀ) from dU, dX and the partial dk,
    dw: writes dk in the token layout, and d(A D_β) into ``DAD`` (which may be ``DX``: each program reads its dX
    before writing) and dw so far into ``DWP``, for ``_ut_bwd_inverse_kernel`` (a kernel of its own: the two
    together take less time than one that holds both sets of tiles)."""
    n, hk, rows, dcol, tok, valid, w, norm, k, b, a = _this_chunk(
        W, K, BETA, TOK, AINV, T, NTOK, sw_b, sw_t, sw_h, sk_b, sk_t, sk_h, sb_b, sb_t, sb_h, BT, D)
    strict = rows[:, None] > rows[None, :]
    w_h, w_s = _operand(w, HALF, True)
    k_h, k_s = _operand(k, HALF)
    adt_h, adt_s = _operand(tl.trans(a * b[None, :]), HALF)  # (A D_β)ᵀ
    wk = tl.where(strict, _dot(w_h, w_s, tl.trans(k_h), k_s, HALF), 0.0)
    chunk = ((hk * NC + n) * BT + rows[:, None]) * D + dcol[None, :]
    square = ((hk * NC + n) * BT + rows[:, None]) * BT + rows[None, :]
    tile, NT = hk * NC + n, NC * tl.num_programs(1)
    du_h, du_s = _scratch_operand(DU, SC, chunk, tile, NARROW, HALF)
    dx_h, dx_s = _scratch_operand(DX, SC, square, NT + tile, NARROW, HALF)
    dk = _scratch_value(DKP, SC, chunk, 2 * NT + tile, NARROW)
    dw = _scratch_value(DWP, SC, chunk, 3 * NT + tile, NARROW)
    # U = A D_β W and X = A D_β strictLower(W Kᵀ)
    dad = _dot(du_h, du_s, tl.trans(w_h), w_s, HALF) + _dot(dx_h, dx_s, *_operand(tl.trans(wk), HALF), HALF)
    dw += _dot(adt_h, adt_s, du_h, du_s, HALF)
    dwk_h, dwk_s = _operand(tl.where(strict, _dot(adt_h, adt_s, dx_h, dx_s, HALF), 0.0), HALF)
    dw += _dot(dwk_h, dwk_s, k_h, k_s, HALF)
    dk += _dot(tl.trans(dwk_h), dwk_s, w_h, w_s, HALF)
    HKV = tl.num_programs(1)
    tl.store(DK + (tok[:, None] * HKV + hk) * D + dcol[None, :], dk, mask=valid[:, None])
    _store_scratch(DAD, SC, square, NT + tile, dad, NARROW)
    _store_scratch(DWP, SC, chunk, 3 * NT + tile, dw, NARROW)


@triton.jit
def _inverse_and_norm_gradients(a, b, w, norm, dad, dw, tok, valid, hk, dcol, DW, DBETA,
                                BT: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr):
    """From d(A D_β) and dw so far: the paths through A D_β, A = (I + N)⁻¹, N = strictLower(D_β W Wᵀ) and
    the normalisation of w; stores dw and dβ in the token layout."""
    rows = tl.arange(0, BT)
    strict = rows[:, None] > rows[None, :]
    da = dad * b[None, :]
    db = tl.sum(a * dad, axis=0)
    at_h, at_s = _operand(tl.trans(a), HALF)
    dn = -_dot(*_operand(_dot(at_h, at_s, *_operand(da, HALF), HALF), HALF), at_h, at_s, HALF)
    dn = tl.where(strict, dn, 0.0)
    db += tl.sum(dn * _mm(w, tl.trans(w), HALF, A_UNIT=True, B_UNIT=True), axis=1)
    dgram = dn * b[:, None]
    dw += _mm(dgram + tl.trans(dgram), w, HALF, B_UNIT=True)
    # w = w_raw / max(‖w_raw‖, ε): project out the radial part where the norm is above ε
    radial = tl.where(norm > 1e-12, tl.sum(dw * w, axis=1), 0.0)
    dw = (dw - radial[:, None] * w) / tl.maximum(norm, 1e-12)[:, None]
    HKV = tl.num_programs(1)
    tl.store(DW + (tok[:, None] * HKV + hk) * D + dcol[None, :], dw, mask=valid[:, None])
    tl.store(DBETA + tok * HKV + hk, db, mask=valid)


@triton.jit
def _ut_bwd_inverse_kernel(
    W, BETA, TOK, AINV, DAD, DWP, DW, DBETA, SC, NC, T, NTOK, sw_b, sw_t, sw_h, sb_b, sb_t, sb_h,
    BT: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, NARROW: tl.constexpr = False,
):
    """Backward, last part: ``_inverse_and_norm_gradients`` from the d(A D_β) and dw that
    ``_ut_bwd_chunk_kernel`` left in scratch."""
    n, hk, rows, dcol, tok, valid = _chunk_rows(TOK, NTOK, BT, D)
    w, norm, b = _load_w_beta(W, BETA, hk, tok, valid, T, sw_b, sw_t, sw_h, sb_b, sb_t, sb_h, dcol)
    square = ((hk * NC + n) * BT + rows[:, None]) * BT + rows[None, :]
    a = tl.load(AINV + square)
    tile, NT = hk * NC + n, NC * tl.num_programs(1)
    dad = _scratch_value(DAD, SC, square, NT + tile, NARROW)
    dw = _scratch_value(DWP, SC, ((hk * NC + n) * BT + rows[:, None]) * D + dcol[None, :], 3 * NT + tile, NARROW)
    _inverse_and_norm_gradients(a, b, w, norm, dad, dw, tok, valid, hk, dcol, DW, DBETA, BT, D, HALF)


def inverse_grads_warps(D: int, config=DEFAULT) -> int:
    """Warps of ``_ut_bwd_inverse_kernel``: ``num_warps(D)``, but 8 below D = 64, whatever the config says. Built by
    Triton 3.6 for an H200 at 4 warps and D ≤ 32, its product (dG + dGᵀ) W on fp16 operands comes out wrong, NaN
    included (``benchmarks/ut_inverse_grads_steps.py`` reproduces it); at 2 and 8 warps, at D = 64, on tf32
    operands and under the interpreter it is right."""
    return 8 if D < 64 else num_warps(D, config)


def split_backward(D, config=DEFAULT):
    """Whether the UT backward runs split in five kernels instead of three: at D > 64 (``config.ut_split`` pins
    it), where the three-kernel form needs more shared memory than an H200 gives a program (its heads kernel
    holds dM's D×D tile beside the query heads' tiles). dU, dX, dk, dw, U, X, each head's dQ_W and d(A D_β) then
    pass between the kernels through fp32 scratch."""
    return pick(config.ut_split, D > 64)


def narrow_scratch(split, half, config=DEFAULT):
    """Whether the three-kernel backward passes its scratch (dU, dX, the partial dk and dw, then d(A D_β) and dw
    so far) as scaled fp16 tiles, half the bytes (``_store_scratch``): with fp16 operands (``HALF`` = FP16) in the
    three-kernel form (``config.ut_scratch16`` can turn it off; the split form adds to its scratch by atomics and
    never narrows it). dU and dX enter only products, on the operands they are stored as, so the gradients through
    them do not change; the rest add 2⁻¹¹ relative per element, a quarter of the bf16 rounding of the outputs, at
    every scale of the gradients (the scales are powers of two)."""
    return pick(config.ut_scratch16, True) and not split and half == int(FP16)


def ut_backward(grads, q, k, w, beta, tokens, block, a=None, *, consume=False, config=DEFAULT):
    """(dq, dk, dw, dβ) from the factors' gradients ``grads = [dq̃, dk̃, dM, dS_d]``; ``a`` is the inverse from
    :func:`ut_forward` of the same inputs, or None to compute it here. Shapes as in :func:`ut_forward`; dq, dk,
    dw, dβ are written in the inputs' shapes, contiguous, in their dtypes.

    ``consume=True`` hands the gradients over (the caller keeps no other reference): the list is emptied, dk̃'s
    buffer takes the partial dk in place when the scratch is fp32 (each program reads its rows before writing
    them; ``narrow_scratch``), and dM is freed once read (dk̃ and dM are the largest buffers of a long sequence)."""
    _check_tokens(tokens, block)
    B, T, H, D = q.shape
    Hkv, BT = k.shape[2], block
    NC = tokens.numel() // BT
    q, k, w = _unit_last(q), _unit_last(k), _unit_last(w)
    dqs, dks, dm, dsd = (t.contiguous() for t in grads)
    if consume:
        grads.clear()
    strides = _strides(q, k, w, beta)
    split, half = split_backward(D, config), half_operands(q.dtype, config)
    narrow = narrow_scratch(split, half, config)
    out = dict(dtype=torch.float32, device=q.device)
    scratch = dict(dtype=torch.float16 if narrow else torch.float32, device=q.device)
    dk_part = dks if consume and not narrow else torch.empty((Hkv, NC, BT, D), **scratch)
    du, dw_part = (torch.empty((Hkv, NC, BT, D), **scratch) for _ in range(2))
    dx = torch.empty((Hkv, NC, BT, BT), **scratch)
    # the scratch tiles' scales (``_store_scratch``); with fp32 scratch the kernels take dx there and never read it
    scales = torch.empty((4, Hkv, NC), **out) if narrow else dx
    if NC > 0:
        a = _inverse(w, beta, tokens, T, BT, config=config) if a is None else a
        if split:
            us, xs = torch.empty_like(du), torch.empty_like(dx)  # U, X; xs then takes d(A D_β)
            _launch(_ut_bwd_end_kernel, (NC, Hkv), k, w, beta, tokens, a, dks, dm, du, dx, dk_part, dw_part, us, xs,
                    NC, T, B * T, *strides[3:], BT=BT, D=D, HALF=half, config=config)
            del dm, dks
    # every token sits in exactly one chunk row, so the kernels write every element (NaN shows one they missed)
    dq, dk, dw = (unwritten(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, w))
    dbeta = unwritten(beta.shape, dtype=beta.dtype, device=beta.device)
    if NC > 0:
        if split:
            dqw = torch.empty((H, NC, BT, BT), **out)  # each query head's dQ_W
            _launch(_ut_bwd_dq_kernel, (NC, H), k, w, beta, tokens, dqs, dsd, dq, us, xs, dqw, T, B * T,
                    *strides[3:], GROUP=H // Hkv, BT=BT, D=D, HALF=half, config=config)
            _launch(_ut_bwd_sums_kernel, (NC, H), q, w, beta, tokens, dqs, dsd, dqw, du, dx, dk_part, dw_part,
                    T, B * T, *strides[:3], *strides[6:], GROUP=H // Hkv, BT=BT, D=D, HALF=half, config=config)
        else:
            xs = dx  # takes d(A D_β): each program of the chunk kernel reads its dX before writing there
            _launch(_ut_bwd_heads_kernel, (NC, Hkv), q, k, w, beta, tokens, a, dqs, dks, dm, dsd, dq, du, dx,
                    dk_part, dw_part, scales, NC, T, B * T, *strides, GROUP=H // Hkv, BT=BT, D=D, HALF=half,
                    NARROW=narrow, config=config)
            del dqs, dks, dm, dsd  # read: with ``consume`` their memory goes back now
        _launch(_ut_bwd_chunk_kernel, (NC, Hkv), k, w, beta, tokens, a, du, dx, dk_part, dw_part, dk, xs, scales,
                NC, T, B * T, *strides[3:], BT=BT, D=D, HALF=half, NARROW=narrow, config=config)
        _launch(_ut_bwd_inverse_kernel, (NC, Hkv), w, beta, tokens, a, xs, dw_part, dw, dbeta, scales, NC, T, B * T,
                *strides[6:], BT=BT, D=D, HALF=half, NARROW=narrow, warps=inverse_grads_warps(D, config))
    return dq, dk, dw, dbeta


# ---------------------------------------------------------------------------------------------------------
# The UT transform alone as custom ops (opaque to torch.compile), joined by ``register_autograd``.

def _ut_fwd_impl(q, k, w, beta, tokens, block, config=0):
    return ut_forward(q, k, w, beta, tokens, block, config=config_of(config))[:4]


def _ut_fwd_fake(q, k, w, beta, tokens, block, config=0):
    H, D, Hkv = q.shape[2], q.shape[3], k.shape[2]
    NC = tokens.numel() // block
    f32 = dict(dtype=torch.float32, device=q.device)
    return (torch.empty((H, NC, block, D), **f32), torch.empty((Hkv, NC, block, D), **f32),
            torch.empty((Hkv, NC, D, D), **f32), torch.empty((H, NC, block, block), **f32))


def _ut_bwd_impl(dqs, dks, dm, dsd, q, k, w, beta, tokens, block, config=0):
    return ut_backward([dqs, dks, dm, dsd], q, k, w, beta, tokens, block, config=config_of(config))


def _ut_bwd_fake(dqs, dks, dm, dsd, q, k, w, beta, tokens, block, config=0):
    return tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, w, beta))


_ut_fwd = torch.library.custom_op(
    "pathlab::path_ut_fwd", _ut_fwd_impl, mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor w, Tensor beta, Tensor tokens, int block, int config=0) "
           "-> (Tensor, Tensor, Tensor, Tensor)",
)
_ut_fwd.register_fake(_ut_fwd_fake)
_ut_bwd = torch.library.custom_op(
    "pathlab::path_ut_bwd", _ut_bwd_impl, mutates_args=(),
    schema="(Tensor dqs, Tensor dks, Tensor dm, Tensor dsd, Tensor q, Tensor k, Tensor w, Tensor beta, "
           "Tensor tokens, int block, int config=0) -> (Tensor, Tensor, Tensor, Tensor)",
)
_ut_bwd.register_fake(_ut_bwd_fake)


def _ut_setup_context(ctx, inputs, output):
    q, k, w, beta, tokens, block, *config = inputs
    ctx.save_for_backward(q, k, w, beta, tokens)  # only the inputs: the backward recomputes the rest
    ctx.block, ctx.config = block, (config[0] if config else 0)


def _ut_backward(ctx, dqs, dks, dm, dsd):
    q, k, w, beta, tokens = ctx.saved_tensors
    H, D, Hkv, BT = q.shape[2], q.shape[3], k.shape[2], ctx.block
    NC = tokens.numel() // BT
    f32 = dict(dtype=torch.float32, device=q.device)
    # an output that did not reach the loss has no gradient: count it as zero
    dqs = torch.zeros((H, NC, BT, D), **f32) if dqs is None else dqs
    dks = torch.zeros((Hkv, NC, BT, D), **f32) if dks is None else dks
    dm = torch.zeros((Hkv, NC, D, D), **f32) if dm is None else dm
    dsd = torch.zeros((H, NC, BT, BT), **f32) if dsd is None else dsd
    return (*_ut_bwd(dqs, dks, dm, dsd, q, k, w, beta, tokens, BT, ctx.config), None, None, None)


_ut_fwd.register_autograd(_ut_backward, setup_context=_ut_setup_context)


def ut_factors_triton(q, k, w, beta, layout, config=None):
    """The UT factors of :func:`kernels.ut_torch.ut_factors`, read straight from the token layout.

    q ``[B, T, H, D]``, k and raw (unnormalised) w ``[B, T, Hkv, D]``, beta ``[B, T, Hkv]``, any float dtype
    and strides; ``layout`` from :func:`kernels.layout.build_layout`; ``config`` a :class:`KernelConfig` or None.
    The kernels gather each chunk's rows, cast them to fp32 and normalise w, so no chunk-layout copy of the inputs
    is made or kept for the backward. Returns q̃ ``[H, NC, BT, D]``, k̃ ``[Hkv, NC, BT, D]``, M ``[Hkv, NC, D, D]``,
    S_d ``[H, NC, BT, BT]`` (fp32), as ``ut_factors(to_chunks(q), to_chunks(k), to_chunks(normalize(w)),
    to_chunks(beta))``. Chunks whose logits at the scale 1/√D may exceed ``ut_forward.WIDE_LOGITS`` take
    fp32-level products.
    """
    B, T = q.shape[:2]
    return _ut_fwd(q, k, w, beta, slot_tokens(layout, B, T), layout.chunk, config_id(config))
