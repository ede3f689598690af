"""The per-chunk UT transform of ``_ut`` as fused Triton kernels: the inverse, the forward, the backward.

The outputs are those of :func:`kernels._ut.ut_factors`, which stays the reference; the inputs are read in place
from ``[B, T, heads, ·]`` (any strides along B, T and heads, any float dtype) through the chunk layout's token
index (``_layout.slot_tokens``), with w normalised inside (F.normalize's w / max(‖w‖, ε)). One program per
(kv head, chunk) gathers the chunk's W, K (``[BT, D]``) and β in fp32. The inverse kernel computes

    N  = strictLower(D_β W Wᵀ),   A = (I + N)⁻¹   (exact fp32, see _unit_lower_inverse_in_place)

into an fp32 buffer ``[Hkv, NC, BT, BT]``, and the forward kernel, with products in tf32 or (by default for 16-bit
inputs) in fp16 on operands scaled by powers of two (see PRECISION, ``_mm`` and ``half_operands``), forms

    U  = A D_β W,   X = A D_β strictLower(W Kᵀ),   k̃ = K − Xᵀ W,   M = Wᵀ U
    per query head of the group:  Q_W = tril(Q Wᵀ),   q̃ = Q − Q_W U,   S_d = Q Kᵀ − Q_W X

The backward runs the inverse kernel again and recomputes U, X from (W, K, β), so autograd keeps only the
inputs (the PyTorch version keeps fp32 chunk copies and every BT×BT and BT×D intermediate). Given dq̃, dk̃, dM, dS_d, in reverse order of the
forward, and last through the normalisation, dw_raw = (dW − (dW·w) w) / ‖w_raw‖ (dW / ε where ‖w_raw‖ ≤ ε):

    dU = W dM − Σ_g Q_Wᵀ dq̃,   dX = −W dk̃ᵀ − Σ_g Q_Wᵀ dS_d
    dQ_W = tril(−dq̃ Uᵀ − dS_d Xᵀ),   dQ = dq̃ + dS_d K + dQ_W W
    dK = dk̃ + Σ_g dS_dᵀ Q + dWKᵀ W,   dWK = strictLower((A D_β)ᵀ dX)
    d(A D_β) = dU Wᵀ + dX strictLower(W Kᵀ)ᵀ,   dA = d(A D_β) D_β,   dβ_j += Σ_i A_ij d(A D_β)_ij
    dN = strictLower(−Aᵀ dA Aᵀ),   dβ_i += Σ_j dN_ij (W Wᵀ)_ij,   dG = D_β dN
    dW = U dMᵀ − X dk̃ + Σ_g dQ_Wᵀ Q + (A D_β)ᵀ dU + dWK K + (dG + dGᵀ) W

The backward runs as three kernels per (chunk, kv head): the per-head products, where grouped query heads are
summed inside the program without atomics; the paths through U and X; the paths through A D_β, the inverse and
the normalisation. At D = 128, where the first needs more shared memory than an H200 has, it runs as five
(``split_backward``): the first becomes three, where dq and the group's sums run one program per query head and
the sums meet in fp32 atomics. Between kernels the gradients pass through fp32 scratch.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ._layout import slot_tokens
from ._mode import interpreting, switch, unwritten

# W Wᵀ, which feeds the inverse, takes a 3-pass tf32 product (a·b ≈ a_hi b_hi + a_hi b_lo + a_lo b_hi on the
# tensor cores, fp32-level accuracy: the inverse must not see tf32 rounding), or for 16-bit w one pass on its
# rows (``_gram_16_bit``: exact products, fp32 sums), and the inverse itself multiplies blocks in plain fp32;
# the other products take 1-pass tf32, the precision of the scan's own products, or fp16 operands of the same
# significand scaled by powers of two (``_mm``).
# Plain "ieee" fp32 products of whole tiles compile to unrolled FMA loops (minutes of compilation for the
# backward), and 3-pass products everywhere need more shared memory than an H200 has.
INVERSE_PRECISION: tl.constexpr = tl.constexpr("tf32x3")
PRECISION: tl.constexpr = tl.constexpr("tf32")


@triton.jit
def _to_half(x):
    """(h, s) with x = s·h up to fp16 rounding: h fp16, s = 2^(⌊log₂ max|x|⌋ − 14), so max|h| lies in [2¹⁴, 2¹⁵)
    and every element above max|x|·2⁻²⁸ keeps fp16's 11-bit significand, tf32's, whatever the scale of x
    (a gradient of 1e-8 included; s is a power of two, so the scaling itself is exact)."""
    e = tl.floor(tl.log2(tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0), 1e-30)))
    return (x * tl.exp2(14.0 - e)).to(tl.float16), tl.exp2(e - 14.0)  # a multiply, not a divide, per element


# The operands of the UT kernels' products (their ``HALF`` constexpr; ``half_operands`` picks one per kernel):
TF32: tl.constexpr = tl.constexpr(0)  # fp32 tiles, 1-pass tf32 products
FP16: tl.constexpr = tl.constexpr(1)  # fp16 tiles scaled by powers of two (``_to_half``): tf32's significand
BF16: tl.constexpr = tl.constexpr(2)  # bf16 tiles as they are: fp32's range, no scale, an 8-bit significand


@triton.jit
def _half_operand(x, UNIT: tl.constexpr, HALF: tl.constexpr = FP16):
    """A 16-bit operand of x and its scale: with ``HALF`` = BF16, x in bf16 (scale 1: bf16 has fp32's range);
    else ``_to_half(x)``, or for ``UNIT`` (rows or columns of w: every |element| ≤ 1) x in fp16 as it is, without
    the reduction (an element below fp16's smallest normal, 2⁻¹⁴, is off by at most 2⁻²⁵)."""
    if HALF == BF16:
        return x.to(tl.bfloat16), 1.0
    elif UNIT:
        return x.to(tl.float16), 1.0
    else:
        return _to_half(x)


@triton.jit
def _mm(a, b, HALF: tl.constexpr, A_UNIT: tl.constexpr = False, B_UNIT: tl.constexpr = False):
    """a·b in fp32 from fp32 tiles: a 1-pass tf32 product (PRECISION), or with ``HALF`` a 16-bit product of the
    operands of ``_half_operand``: with FP16 the same 11-bit operand significands as tf32, in half the shared
    memory, at twice the tensor cores' tf32 rate, for up to two reductions per product (``A_UNIT``, ``B_UNIT``: an
    operand from w, which needs none); with BF16 no reduction at all, at an 8-bit significand."""
    if HALF:
        ah, sa = _half_operand(a, A_UNIT, HALF)
        bh, sb = _half_operand(b, B_UNIT, HALF)
        return tl.dot(ah, bh) * (sa * sb)
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _operand(x, HALF: tl.constexpr, UNIT: tl.constexpr = False):
    """x as a product operand, (tile, scale): ``_half_operand(x, UNIT)`` with ``HALF``, else (x, 1). A tile that
    enters several products is made an operand once: with ``HALF`` each scale takes a reduction across the
    program's warps, and ``tl.trans`` of the fp16 tile keeps its scale. Against a scale per use (same results,
    bit for bit), built by Triton 3.6 for sm_90 the backward's first kernel has 100 barriers instead of 132
    (``benchmarks/results/kernel-resources-sm90-triton36-ut-d64-*.json``), and on an H200 a PaTH
    forward+backward took 4% less time at T = 512 and 2% less at T = 4096 (12×64;
    ``kernels-h200-ut-operands-*.json``). Without any scaling (not safe: a gradient's scale is arbitrary) the
    UT kernels took 0.48 ms less, 2.06 against 2.54 (``kernels-h200-ut-noscale.json``). The backward's heads
    kernel then also made each operand once across its helpers (dq̃, dS_d and dQ_W had been scaled in both
    ``_query_head_dq`` and ``_query_head_sums``, U, X and K again per query head): 100 → 86 barriers, 4288 →
    3312 bytes of spills, and on an H200 0.93 → 0.64 ms at T = 512, 12×64 (``kernels-h200-ut-head-operands-*``)."""
    if HALF:
        return _half_operand(x, UNIT, HALF)
    else:
        return x, 1.0


@triton.jit
def _dot(a, sa, b, sb, HALF: tl.constexpr):
    """The product of two operands of ``_operand`` (``(a, sa)``, ``(b, sb)``) in fp32, as ``_mm``."""
    if HALF:
        return tl.dot(a, b) * (sa * sb)
    else:
        return tl.dot(a, b, input_precision=PRECISION)


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
def _load_rows_as_stored(X, tok, valid, T, s_b, s_t, dcol):
    """Rows ``[BT, D]`` of ``X[b, t, :]`` (X already offset to one head) for the chunk's flat tokens b·T + t,
    in X's dtype, zeros for padding."""
    ptr = X + (tok // T) * s_b + (tok % T) * s_t
    return tl.load(ptr[:, None] + dcol[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def _load_rows(X, tok, valid, T, s_b, s_t, dcol):
    """As :func:`_load_rows_as_stored`, in fp32."""
    return _load_rows_as_stored(X, tok, valid, T, s_b, s_t, dcol).to(tl.float32)


@triton.jit
def _chunk_rows(TOK, NTOK, BT: tl.constexpr, D: tl.constexpr):
    """This program's chunk n and kv head hk, its rows' flat tokens b·T + t (NTOK for padding) and validity."""
    n = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, BT)
    tok = tl.load(TOK + n * BT + rows)
    return n, hk, rows, tl.arange(0, D), tok, tok < NTOK


@triton.jit
def _load_beta(BETA, hk, tok, valid, T, sb_b, sb_t, sb_h):
    """The chunk's β in fp32, zero for padding."""
    return tl.load(BETA + (tok // T) * sb_b + (tok % T) * sb_t + hk * sb_h, mask=valid, other=0.0).to(tl.float32)


@triton.jit
def _load_w_beta(W, BETA, hk, tok, valid, T, sw_b, sw_t, sw_h, sb_b, sb_t, sb_h, dcol):
    """The chunk's w = w_raw / max(‖w_raw‖, ε) in fp32 (F.normalize, ε = 1e-12), ‖w_raw‖ and β."""
    w_raw = _load_rows(W + hk * sw_h, tok, valid, T, sw_b, sw_t, dcol)
    norm = tl.sqrt(tl.sum(w_raw * w_raw, axis=1))
    b = _load_beta(BETA, hk, tok, valid, T, sb_b, sb_t, sb_h)
    return w_raw / tl.maximum(norm, 1e-12)[:, None], norm, b


@triton.jit
def _this_chunk(W, K, BETA, TOK, AINV, T, NTOK, sw_b, sw_t, sw_h, sk_b, sk_t, sk_h, sb_b, sb_t, sb_h,
                BT: tl.constexpr, D: tl.constexpr):
    """The chunk's rows (as ``_chunk_rows``), w, ‖w_raw‖, k, β and A (written by ``_ut_inverse_kernel``)."""
    n, hk, rows, dcol, tok, valid = _chunk_rows(TOK, NTOK, BT, D)
    w, norm, b = _load_w_beta(W, BETA, hk, tok, valid, T, sw_b, sw_t, sw_h, sb_b, sb_t, sb_h, dcol)
    k = _load_rows(K + hk * sk_h, tok, valid, T, sk_b, sk_t, dcol)
    a = tl.load(AINV + ((hk * tl.num_programs(0) + n) * BT + rows[:, None]) * BT + rows[None, :])
    return n, hk, rows, dcol, tok, valid, w, norm, k, b, a


SUB: tl.constexpr = tl.constexpr(16)  # the inverse's diagonal blocks


@triton.jit
def _diagonal_block_inverses(A, BT: tl.constexpr):
    """In place: every 16×16 diagonal block of ``A [BT, BT]`` (fp32, one matrix; strictly lower N there) becomes
    (I + N_bb)⁻¹, all blocks at once by forward substitution on a ``[BT/16, 16, 16]`` tile:
    row i ← e_i − Σ_{j<i} N_ij · row j, for i = 1 … 15 (each step two reductions, exact fp32)."""
    NB: tl.constexpr = BT // SUB
    blk = tl.arange(0, NB)[:, None, None]
    r = tl.arange(0, SUB)[None, :, None]
    c = tl.arange(0, SUB)[None, None, :]
    ptr = A + (blk * SUB + r) * BT + blk * SUB + c
    nb = tl.load(ptr)
    inv = tl.where(r == c, 1.0, 0.0) + tl.zeros((NB, SUB, SUB), tl.float32)
    for i in tl.static_range(1, SUB):
        n_i = tl.sum(tl.where(r == i, nb, 0.0), axis=1)  # row i of every block's N      [NB, 16] (block, j)
        row = tl.sum(n_i[:, :, None] * inv, axis=1)  # Σ_j N_ij · row j of the inverse   [NB, 16] (block, col)
        inv = tl.where(r == i, inv - row[:, None, :], inv)
    tl.store(ptr, inv)


@triton.jit
def _lower_left_blocks(A, BT: tl.constexpr, S: tl.constexpr):
    """In place, for every 2S×2S diagonal block of ``A [BT, BT]`` whose two S×S diagonal blocks already hold their
    inverses A_11, A_22 and whose lower-left block still holds N_21: that block becomes A_21 = −A_22 N_21 A_11
    (exact fp32 products), so the 2S×2S block holds its inverse. The blocks are independent of each other."""
    r = tl.arange(0, S)
    blk = r[:, None] * BT + r[None, :]  # offsets of the S×S block at (0, 0)
    for p in tl.static_range(BT // (2 * S)):
        top = p * 2 * S
        a11 = tl.load(A + blk + top * (BT + 1))
        a22 = tl.load(A + blk + (top + S) * (BT + 1))
        n21 = A + blk + (top + S) * BT + top
        n_a = tl.dot(tl.load(n21), a11, input_precision="ieee")
        tl.store(n21, -tl.dot(a22, n_a, input_precision="ieee"))


@triton.jit
def _unit_lower_inverse_in_place(A, BT: tl.constexpr):
    """In place: ``A [BT, BT]`` (fp32, row-major, one matrix, BT a power of two from 16) holds a strictly lower N
    on entry and (I + N)⁻¹ on exit, in exact fp32 arithmetic (no tf32), by doubling: the 16×16 diagonal blocks
    first, then each 2S×2S diagonal block from its two S×S halves, for S = 16, 32, …, BT/2:

        [[I + N_11, 0], [N_21, I + N_22]]⁻¹ = [[A_11, 0], [A_21, A_22]],   A_21 = −A_22 N_21 A_11

    That is log₂(BT/16) dependent steps of two products each (a barrier between steps: each step reads what
    the one before wrote), about BT³/3 multiply-adds with few live registers, so several programs share a
    multiprocessor. (Block rows in turn, A_ij = −A_ii Σ_k N_ik A_kj, took 0.29 against 0.27 ms for 6144
    inverses on an H200, ``benchmarks/results/ut-inverse-h200-*.json``; the earlier full-tile form, 15 masked
    BT×BT×BT products and a series in 3-pass tf32, ran one program per multiprocessor and took 6.6× as long.)
    """
    _diagonal_block_inverses(A, BT)
    tl.debug_barrier()
    if BT > 16:
        _lower_left_blocks(A, BT, 16)
        tl.debug_barrier()
    if BT > 32:
        _lower_left_blocks(A, BT, 32)
        tl.debug_barrier()
    if BT > 64:
        _lower_left_blocks(A, BT, 64)


@triton.jit
def _gram_16_bit(W, hk, tok, valid, T, sw_b, sw_t, sw_h, dcol):
    """(W_s W_sᵀ, f): the Gram matrix of the chunk's 16-bit w rows, each scaled by a power of two to a largest
    |element| in [1, 2) (exact in bf16; in fp16 only elements below 2⁻¹⁴ of their row's largest lose bits), in one
    pass with fp32 sums (the products of 16-bit numbers are exact in fp32), and the factors f with
    W Wᵀ / (max(‖w_i‖, ε) max(‖w_j‖, ε)) = f_i (W_s W_sᵀ)_ij f_j, ε = 1e-12 as in F.normalize."""
    w_raw = _load_rows_as_stored(W + hk * sw_h, tok, valid, T, sw_b, sw_t, dcol)
    w32 = w_raw.to(tl.float32)
    e = tl.floor(tl.log2(tl.maximum(tl.max(tl.abs(w32), axis=1), 1e-30)))
    w_s = w32 * tl.exp2(-e)[:, None]
    f = 1.0 / tl.maximum(tl.sqrt(tl.sum(w_s * w_s, axis=1)), 1e-12 * tl.exp2(-e))
    w_h = w_s.to(w_raw.dtype)
    return tl.dot(w_h, tl.trans(w_h)), f


@triton.jit
def _ut_inverse_kernel(W, BETA, TOK, AINV, T, NTOK, sw_b, sw_t, sw_h, sb_b, sb_t, sb_h,
                       BT: tl.constexpr, D: tl.constexpr, GRAM16: tl.constexpr):
    """A = (I + strictLower(D_β W Wᵀ))⁻¹ of one (chunk, kv head) into ``AINV [Hkv, NC, BT, BT]`` (fp32): the
    Gram matrix at fp32-level accuracy (``GRAM16``: one pass on 16-bit rows, ``_gram_16_bit``; else a 3-pass
    tf32 product of the normalised fp32 rows), stored, then inverted in place.

    A kernel of its own, so that the inverse and the products of the transform never share one program's
    registers and shared memory."""
    n, hk, rows, dcol, tok, valid = _chunk_rows(TOK, NTOK, BT, D)
    strict = rows[:, None] > rows[None, :]
    if GRAM16:
        gram, f = _gram_16_bit(W, hk, tok, valid, T, sw_b, sw_t, sw_h, dcol)
        b = _load_beta(BETA, hk, tok, valid, T, sb_b, sb_t, sb_h)
        nmat = tl.where(strict, (b * f)[:, None] * gram * f[None, :], 0.0)
    else:
        w, norm, b = _load_w_beta(W, BETA, hk, tok, valid, T, sw_b, sw_t, sw_h, sb_b, sb_t, sb_h, dcol)
        nmat = tl.where(strict, b[:, None] * tl.dot(w, tl.trans(w), input_precision=INVERSE_PRECISION), 0.0)
    a = AINV + (hk * tl.num_programs(0) + n) * BT * BT
    tl.store(a + rows[:, None] * BT + rows[None, :], nmat)
    tl.debug_barrier()
    _unit_lower_inverse_in_place(a, BT)


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
    before writing) and dw so far into ``DWP``, for ``_ut_bwd_inverse_kernel``. The inverse's paths ran in this
    kernel until the twelfth round; on an H200 the two kernels take 0.39 + 0.24 ms where the one took 0.83
    (T = 512, 12×64; ``benchmarks/results/kernels-h200-ut-split-d64-*.json``)."""
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


# ---------------------------------------------------------------------------------------------------------
# Custom ops, as for the scan (see ``path``): opaque to torch.compile, joined by ``register_autograd``.

def num_warps(D: int) -> int:
    """Warps of the UT kernels (the inverse has its own, and its gradients' kernel ``inverse_grads_warps``): 4 at
    D ≤ 64, 8 (two warp groups, each fp32 [BT, D] tile at half the registers per thread) at D = 128.
    ``PATHLAB_PATH_UT_WARPS`` overrides, for measurements. At D = 64 on an H200, 4 warps took 4.5% off a PaTH
    forward+backward at T = 512 and 2% at T = 4096, against 8 (``benchmarks/results/kernels-h200-ut-warps.json``)."""
    value = os.environ.get("PATHLAB_PATH_UT_WARPS") or ""
    if value and value not in ("1", "2", "4", "8", "16"):
        raise ValueError(f"PATHLAB_PATH_UT_WARPS must be 1, 2, 4, 8 or 16, got {value!r}")
    return int(value) if value else 4 if D <= 64 else 8


def inverse_grads_warps(D: int) -> int:
    """Warps of ``_ut_bwd_inverse_kernel``: ``num_warps(D)``, but 8 below D = 64. Built by Triton 3.6 for an H200 at
    4 warps and D ≤ 32, its product (dG + dGᵀ) W on fp16 operands comes out wrong, NaN included, while dG W alone
    is right (a standalone kernel of its steps, ``benchmarks/ut_inverse_grads_steps.py``:
    ``benchmarks/results/ut-inverse-grads-steps-h200.json``); at 2 and 8 warps, at D = 64, on tf32 operands and
    under the interpreter it is right. dG W + dGᵀ W, two products on one operand, is wrong there too. The kernel
    takes 0.24 ms at 4 warps, 0.36 at 2 and 0.44 at 8 (T = 512, B = 64, 12×64;
    ``kernels-h200-ut-inverse-warps-1-0fd04c6.json``)."""
    return 8 if D < 64 else num_warps(D)


_INVERSE_NUM_WARPS = 2  # the inverse works on 16×16 blocks; on an H200, 2 warps took 0.29 ms for 6144 inverses,
#                          4 warps 0.44 ms, 8 warps 1.13 ms (benchmarks/results/ut-transform-h200-blocked-inverse.json)


def _launch(kernel, grid, *args, BT, D, warps=None, **meta):
    """Launch one UT kernel (with ``num_warps(D)`` warps unless ``warps`` is given); a configuration whose tiles
    do not fit the GPU's shared memory gets a clear error."""
    try:
        kernel[grid](*args, BT=BT, D=D, **meta, num_warps=warps or num_warps(D))
    except OutOfResources as err:
        group = f", {meta['GROUP']} query heads per kv head" if "GROUP" in meta else ""
        raise RuntimeError(
            f"the fused UT kernels do not fit this GPU for head dim {D}{group} and block size {BT} ({err}); "
            f"use ut='torch' (or PATHLAB_PATH_UT=torch), or a smaller block_size") from err


HALF_VALUES = ("auto", "0", "fwd", "1", "bf16-bwd", "bf16")


def half_operands(backward: bool, dtype: torch.dtype) -> int:
    """The operands of the UT kernels' products in the forward (also when the backward recomputes it) or in the
    backward, for inputs (q) of ``dtype``: ``TF32`` (0), ``FP16`` (1: fp16 scaled by powers of two, ``_mm``) or
    ``BF16`` (2: bf16 unscaled). ``PATHLAB_PATH_UT_HALF`` = 1 (FP16 in every kernel), fwd (FP16 in the forward
    kernel, TF32 in the backward), 0 (TF32), bf16-bwd (FP16 forward, BF16 backward), bf16 (BF16 in every kernel) or
    auto (FP16 in every kernel for 16-bit inputs; fp32 inputs keep tf32 products, which have the same significand
    on a GPU and run in exact fp32 under the interpreter). The inverse is exact fp32 either way.

    On an H200, bf16, against tf32 products, fwd+bwd took 2.3% less time at T = 512, 12×64 (4.41 against 4.52 ms)
    and 1.5% less at T = 4096, with errors against the fp64 reference no larger (dw 2.5e-3 against 5.2e-3 at
    T = 256; ``benchmarks/results/kernels-h200-ut-half-fwd.json``, ``kernels-h200-ut-half.json``).

    BF16 (an option, not the default): no reduction for a scale, but bf16's 8-bit significand. Against FP16 on an
    H200 (bf16 inputs, T = 512, 12×64), bf16-bwd took the UT backward's chunk kernel from 0.371 to 0.300 ms and
    its inverse-gradients kernel from 0.239 to 0.223 (the heads kernel did not move: 0.616 and 0.626), 2.5% of a
    PaTH forward+backward, and the ``owt16`` model trained at 271,347 against 266,991 tokens/s (+1.6%); but the
    gradients' errors against fp64 doubled (dq 4.0e-3 against 2.4e-3, dw 6.5e-3 against 3.0e-3, dβ 5.5e-3
    against 2.6e-3; ``kernels-h200-ut-bf16-a47574d.json``, ``throughput-h200-path-ut-{fp16,bf16-bwd}-a47574d.json``).
    Under the interpreter bf16 products are wrong, so these modes are tested on the GPU only."""
    value = os.environ.get("PATHLAB_PATH_UT_HALF") or "auto"
    if value not in HALF_VALUES:
        raise ValueError(f"PATHLAB_PATH_UT_HALF must be one of {HALF_VALUES}, got {value!r}")
    if value == "auto":
        return int(FP16) if dtype != torch.float32 else int(TF32)
    if value == "bf16" or (value == "bf16-bwd" and backward):
        return int(BF16)
    return int(FP16) if value in ("1", "bf16-bwd") or (value == "fwd" and not backward) else int(TF32)


def split_backward(D):
    """Whether the UT backward runs split in five kernels instead of three (``PATHLAB_PATH_UT_SPLIT``: auto, 0, 1).

    ``auto`` splits at D > 64: at D = 128 the three-kernel form needs more shared memory than an H200 gives a
    program (227 KiB): the heads kernel, which holds dM's D×D tile beside the query heads' tiles, took 400 KiB
    with Triton 3.6 and two query heads per kv head; split, the largest takes 224 KiB
    (``benchmarks/results/kernel-resources-sm90-triton36-ut-d128-group2.json``). dU, dX, dk, dw, U, X, each
    head's dQ_W and d(A D_β) pass between the kernels through fp32 scratch."""
    return switch("PATHLAB_PATH_UT_SPLIT", D > 64)


def narrow_scratch(split, half):
    """Whether the three-kernel backward passes its scratch (dU, dX, the partial dk and dw, then d(A D_β) and dw
    so far: at D = 64, per chunk and kv head, 64 KiB of fp32 out of the heads kernel and 32 KiB out of the chunk
    kernel) as scaled fp16 tiles, half the bytes (``_store_scratch``;
    ``PATHLAB_PATH_UT_SCRATCH16``: auto = on for fp16 operands (``HALF`` = FP16) in the three-kernel form, 0, 1,
    which only takes effect there: the split form adds to its scratch by atomics, and tf32 and bf16 products take
    operands of their own). dU and dX enter only products, on the operands they are stored as, so the
    gradients through them do not change; the rest add 2⁻¹¹ relative per element, a quarter of the bf16
    rounding of the outputs, at every scale of the gradients (the scales are powers of two)."""
    return switch("PATHLAB_PATH_UT_SCRATCH16", True) and not split and half == int(FP16)


def gram_on_16_bit_rows(dtype):
    """Whether the inverse kernel forms W Wᵀ in one pass on the fp16/bf16 rows of w (``_gram_16_bit``: their
    products are exact in fp32; the norms scale the sums after) instead of three tf32 passes on the normalised
    fp32 rows (``PATHLAB_PATH_INVERSE_GRAM16``: auto = for 16-bit w, 0, 1). Not for bf16 under the interpreter,
    whose bf16 products are not exact. It takes 16 instead of 64 KiB of shared memory at D = 64 (128 KiB at
    D = 128; Triton 3.6, ``benchmarks/results/kernel-resources-sm90-triton36-inverse-f707d2d.json``), so more
    programs share a multiprocessor: on an H200 with bf16 w (T = 512, B = 64, 12×64) the kernel took 0.18
    against 0.32 ms (``kernels-h200-inverse-gram16-1-7a83877.json``, before the rows were scaled)."""
    sixteen = dtype == torch.float16 or (dtype == torch.bfloat16 and not interpreting())
    return switch("PATHLAB_PATH_INVERSE_GRAM16", True) and sixteen


def _inverse(w, beta, tokens, T, BT, out=None):
    """A = (I + strictLower(D_β W Wᵀ))⁻¹ of every (kv head, chunk): ``[Hkv, NC, BT, BT]`` fp32 (w already unit-last),
    into ``out`` if given (the kernel writes every element)."""
    B, Hkv, D = w.shape[0], w.shape[2], w.shape[3]
    NC = tokens.numel() // BT
    a = torch.empty((Hkv, NC, BT, BT), dtype=torch.float32, device=w.device) if out is None else out
    if NC > 0:
        _launch(_ut_inverse_kernel, (NC, Hkv), w, beta, tokens, a, T, B * T, *w.stride()[:3], *beta.stride(),
                BT=BT, D=D, warps=_INVERSE_NUM_WARPS, GRAM16=gram_on_16_bit_rows(w.dtype))
    return a


def _strides(q, k, w, beta):
    """(b, t, head) strides of q, k, w and β; the kernels read q, k, w rows with unit stride along D."""
    return [st for x in (q, k, w) for st in x.stride()[:3]] + list(beta.stride())


def _unit_last(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_tokens(tokens, block):
    if tokens.dtype != torch.int64 or tokens.ndim != 1 or tokens.numel() % block:
        raise ValueError(f"tokens must be int64 [NC·BT] (from _layout.slot_tokens), got {tokens.dtype} "
                         f"{tuple(tokens.shape)} for BT = {block}")


def ut_forward(q, k, w, beta, tokens, block, scan_dtype=torch.float32):
    """(q̃, k̃, M, S_d, A): the UT factors and the inverse they were formed with (``[Hkv, NC, BT, BT]`` fp32), so that
    a backward that has just recomputed the factors can hand A to :func:`ut_backward` instead of inverting again.
    k̃ and M are stored in ``scan_dtype`` (the scan's; its fp16 saves their fp32 copies: 6× one 16-bit k at
    D = 128), the rest in fp32."""
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
    a = _inverse(w, beta, tokens, T, BT)
    half = half_operands(backward=False, dtype=q.dtype)
    if NC > 0:
        _launch(_ut_fwd_kernel, (NC, Hkv), q, k, w, beta, tokens, a, qs, ks, m, sd, NC, T, B * T,
                *_strides(q, k, w, beta), GROUP=H // Hkv, BT=BT, D=D, HALF=half)
    return qs, ks, m, sd, a


def _ut_fwd_impl(q, k, w, beta, tokens, block):
    return ut_forward(q, k, w, beta, tokens, block)[:4]


def _ut_fwd_fake(q, k, w, beta, tokens, block):
    H, D, Hkv = q.shape[2], q.shape[3], k.shape[2]
    NC = tokens.numel() // block
    f32 = dict(dtype=torch.float32, device=q.device)
    return (torch.empty((H, NC, block, D), **f32), torch.empty((Hkv, NC, block, D), **f32),
            torch.empty((Hkv, NC, D, D), **f32), torch.empty((H, NC, block, block), **f32))


def ut_backward(grads, q, k, w, beta, tokens, block, a=None, *, consume=False):
    """(dq, dk, dw, dβ) from the factors' gradients ``grads = [dq̃, dk̃, dM, dS_d]``; ``a`` is the inverse from
    :func:`ut_forward` of the same inputs, or None to compute it here.

    ``consume=True`` hands the gradients over (the caller keeps no other reference): the list is emptied, dk̃'s
    buffer takes the partial dk in place when the scratch is fp32 (each program reads its rows before writing
    them; ``narrow_scratch``), and dM is freed once read (dk̃ and dM are 768 MiB of fp32 at T = 16384, 16×128)."""
    _check_tokens(tokens, block)
    B, T, H, D = q.shape
    Hkv, BT = k.shape[2], block
    NC = tokens.numel() // BT
    q, k, w = _unit_last(q), _unit_last(k), _unit_last(w)
    dqs, dks, dm, dsd = (t.contiguous() for t in grads)
    if consume:
        grads.clear()
    strides = _strides(q, k, w, beta)
    split, half = split_backward(D), half_operands(backward=True, dtype=q.dtype)
    narrow = narrow_scratch(split, half)
    out = dict(dtype=torch.float32, device=q.device)
    scratch = dict(dtype=torch.float16 if narrow else torch.float32, device=q.device)
    dk_part = dks if consume and not narrow else torch.empty((Hkv, NC, BT, D), **scratch)
    du, dw_part = (torch.empty((Hkv, NC, BT, D), **scratch) for _ in range(2))
    dx = torch.empty((Hkv, NC, BT, BT), **scratch)
    # the scratch tiles' scales (``_store_scratch``); with fp32 scratch the kernels take dx there and never read it
    scales = torch.empty((4, Hkv, NC), **out) if narrow else dx
    if NC > 0:
        a = _inverse(w, beta, tokens, T, BT) if a is None else a
        if split:
            us, xs = torch.empty_like(du), torch.empty_like(dx)  # U, X; xs then takes d(A D_β)
            _launch(_ut_bwd_end_kernel, (NC, Hkv), k, w, beta, tokens, a, dks, dm, du, dx, dk_part, dw_part, us, xs,
                    NC, T, B * T, *strides[3:], BT=BT, D=D, HALF=half)
            del dm, dks
    # every token sits in exactly one chunk row, so the kernels write every element (NaN shows one they missed)
    dq, dk, dw = (unwritten(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, w))
    dbeta = unwritten(beta.shape, dtype=beta.dtype, device=beta.device)
    if NC > 0:
        if split:
            dqw = torch.empty((H, NC, BT, BT), **out)  # each query head's dQ_W
            _launch(_ut_bwd_dq_kernel, (NC, H), k, w, beta, tokens, dqs, dsd, dq, us, xs, dqw, T, B * T,
                    *strides[3:], GROUP=H // Hkv, BT=BT, D=D, HALF=half)
            _launch(_ut_bwd_sums_kernel, (NC, H), q, w, beta, tokens, dqs, dsd, dqw, du, dx, dk_part, dw_part,
                    T, B * T, *strides[:3], *strides[6:], GROUP=H // Hkv, BT=BT, D=D, HALF=half)
        else:
            xs = dx  # takes d(A D_β): each program of the chunk kernel reads its dX before writing there
            _launch(_ut_bwd_heads_kernel, (NC, Hkv), q, k, w, beta, tokens, a, dqs, dks, dm, dsd, dq, du, dx,
                    dk_part, dw_part, scales, NC, T, B * T, *strides, GROUP=H // Hkv, BT=BT, D=D, HALF=half,
                    NARROW=narrow)
            del dqs, dks, dm, dsd  # read: with ``consume`` their memory goes back now
        _launch(_ut_bwd_chunk_kernel, (NC, Hkv), k, w, beta, tokens, a, du, dx, dk_part, dw_part, dk, xs, scales,
                NC, T, B * T, *strides[3:], BT=BT, D=D, HALF=half, NARROW=narrow)
        _launch(_ut_bwd_inverse_kernel, (NC, Hkv), w, beta, tokens, a, xs, dw_part, dw, dbeta, scales, NC, T, B * T,
                *strides[6:], BT=BT, D=D, HALF=half, NARROW=narrow, warps=inverse_grads_warps(D))
    return dq, dk, dw, dbeta


def _ut_bwd_impl(dqs, dks, dm, dsd, q, k, w, beta, tokens, block):
    return ut_backward([dqs, dks, dm, dsd], q, k, w, beta, tokens, block)


def _ut_bwd_fake(dqs, dks, dm, dsd, q, k, w, beta, tokens, block):
    return tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, w, beta))


_ut_fwd = torch.library.custom_op(
    "pathlab::path_ut_fwd", _ut_fwd_impl, mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor w, Tensor beta, Tensor tokens, int block) -> (Tensor, Tensor, Tensor, Tensor)",
)
_ut_fwd.register_fake(_ut_fwd_fake)
_ut_bwd = torch.library.custom_op(
    "pathlab::path_ut_bwd", _ut_bwd_impl, mutates_args=(),
    schema="(Tensor dqs, Tensor dks, Tensor dm, Tensor dsd, Tensor q, Tensor k, Tensor w, Tensor beta, "
           "Tensor tokens, int block) -> (Tensor, Tensor, Tensor, Tensor)",
)
_ut_bwd.register_fake(_ut_bwd_fake)


def _ut_setup_context(ctx, inputs, output):
    q, k, w, beta, tokens, block = inputs
    ctx.save_for_backward(q, k, w, beta, tokens)  # only the inputs: the backward recomputes the rest
    ctx.block = block


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
    return (*_ut_bwd(dqs, dks, dm, dsd, q, k, w, beta, tokens, BT), None, None)


_ut_fwd.register_autograd(_ut_backward, setup_context=_ut_setup_context)


def ut_factors_triton(q, k, w, beta, layout):
    """The UT factors of :func:`kernels._ut.ut_factors`, read straight from the token layout.

    q ``[B, T, H, D]``, k and raw (unnormalised) w ``[B, T, Hkv, D]``, beta ``[B, T, Hkv]``, any float dtype
    and strides; ``layout`` from :func:`kernels._layout.build_layout`. The kernels gather each chunk's rows, cast
    them to fp32 and normalise w, so no chunk-layout copy of the inputs is made or kept for the backward.
    Returns q̃ ``[H, NC, BT, D]``, k̃ ``[Hkv, NC, BT, D]``, M ``[Hkv, NC, D, D]``, S_d ``[H, NC, BT, BT]`` (fp32),
    as ``ut_factors(to_chunks(q), to_chunks(k), to_chunks(normalize(w)), to_chunks(beta))``.
    """
    B, T = q.shape[:2]
    return _ut_fwd(q, k, w, beta, slot_tokens(layout, B, T), layout.chunk)
