"""What the fused UT kernels share: product operands, row loaders, the inverse kernel, launch choices.

The kernels (``ut_forward``, ``ut_backward``) compute the per-chunk UT transform of :func:`kernels.ut_torch.ut_factors`
(the reference) with the inputs read in place from ``[B, T, heads, ·]`` (any strides along B, T and heads, any
float dtype) through the chunk layout's token index (``layout.slot_tokens``), w normalised inside (F.normalize's
w / max(‖w‖, ε)). One program per (chunk, kv head) gathers the chunk's W, K (``[BT, D]``) and β in fp32. The
inverse kernel here computes

    N  = strictLower(D_β W Wᵀ),   A = (I + N)⁻¹   (exact fp32, see _unit_lower_inverse_in_place)

into an fp32 buffer ``[Hkv, NC, BT, BT]``, in a kernel of its own so that the inverse and the transform's
products never share one program's registers and shared memory.

Precision: W Wᵀ, which feeds the inverse, takes a 3-pass tf32 product (fp32-level accuracy: the inverse must not
see tf32 rounding), or for 16-bit w one pass on its rows (``_gram_16_bit``: exact products, fp32 sums); the
inverse multiplies blocks in exact fp32. The other products take 1-pass tf32, the precision of the scan's own
products, or for 16-bit inputs fp16 operands of the same 11-bit significand scaled by powers of two (``_mm``):
half the shared memory at twice the tensor-core rate. Plain "ieee" fp32 products of whole tiles compile to
unrolled FMA loops (minutes of compilation), and 3-pass products everywhere need more shared memory than an H200
has.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from .config import DEFAULT, KernelConfig, pick
from .runtime import interpreting

INVERSE_PRECISION: tl.constexpr = tl.constexpr("tf32x3")
PRECISION: tl.constexpr = tl.constexpr("tf32")


@triton.jit
def _to_half(x):
    """(h, s) with x = s·h up to fp16 rounding: h fp16, s = 2^(⌊log₂ max|x|⌋ − 14), so max|h| lies in [2¹⁴, 2¹⁵)
    and every element above max|x|·2⁻²⁸ keeps fp16's 11-bit significand, tf32's, whatever the scale of x
    (a gradient of 1e-8 included; s is a power of two, so the scaling itself is exact)."""
    e = tl.floor(tl.log2(tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0), 1e-30)))
    return (x * tl.exp2(14.0 - e)).to(tl.float16), tl.exp2(e - 14.0)  # a multiply, not a divide, per element


# The operands of the UT kernels' products (their ``HALF`` constexpr; ``half_operands`` picks one):
TF32: tl.constexpr = tl.constexpr(0)  # fp32 tiles, 1-pass tf32 products
FP16: tl.constexpr = tl.constexpr(1)  # fp16 tiles scaled by powers of two (``_to_half``): tf32's significand


@triton.jit
def _half_operand(x, UNIT: tl.constexpr, HALF: tl.constexpr = FP16):
    """A 16-bit operand of x and its scale: ``_to_half(x)``, or for ``UNIT`` (rows or columns of w: every
    |element| ≤ 1) x in fp16 as it is, without the reduction (an element below fp16's smallest normal, 2⁻¹⁴, is off
    by at most 2⁻²⁵)."""
    if UNIT:
        return x.to(tl.float16), 1.0
    else:
        return _to_half(x)


@triton.jit
def _mm(a, b, HALF: tl.constexpr, A_UNIT: tl.constexpr = False, B_UNIT: tl.constexpr = False):
    """a·b in fp32 from fp32 tiles: a 1-pass tf32 product (PRECISION), or with ``HALF`` a 16-bit product of the
    operands of ``_half_operand``: the same 11-bit operand significands as tf32, in half the shared memory, at
    twice the tensor cores' tf32 rate, for up to two reductions per product (``A_UNIT``, ``B_UNIT``: an operand
    from w, which needs none)."""
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
    program's warps (a barrier each), and ``tl.trans`` of the fp16 tile keeps its scale. The scaling itself is
    needed: a gradient's scale is arbitrary."""
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


@triton.jit
def _split_half(x):
    """(hi, lo, s): x = s·(hi + lo) to about 2⁻²² of max|x|, hi and lo fp16, s a power of two (as ``_to_half``):
    hi holds the top 11 significand bits of x/s and lo (the exact fp32 remainder, rounded) the next 11."""
    e = tl.floor(tl.log2(tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0), 1e-30)))
    xs = x * tl.exp2(14.0 - e)
    hi = xs.to(tl.float16)
    return hi, (xs - hi.to(tl.float32)).to(tl.float16), tl.exp2(e - 14.0)


@triton.jit
def _dot_split(a, b):
    """a·b of fp32 tiles at fp32-level accuracy from 16-bit products: each operand split in two fp16 parts
    (``_split_half``) and three products, hi·hi + hi·lo + lo·hi, summed in fp32 (lo·lo lies below 2⁻²² of the
    result). The same operand bytes as one fp32 tile, three times the products of ``_mm``."""
    ah, al, sa = _split_half(a)
    bh, bl, sb = _split_half(b)
    acc = tl.dot(al, bh)
    acc = tl.dot(ah, bl, acc)
    return tl.dot(ah, bh, acc) * (sa * sb)


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
    multiprocessor (block rows in turn, or the full tile as a series, ran slower).
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


def num_warps(D: int, config: KernelConfig = DEFAULT) -> int:
    """Warps of the UT kernels (the inverse has its own, and its gradients' kernel ``ut_backward.inverse_grads_warps``):
    4 at D ≤ 64, 8 at D = 128 (two warp groups, each fp32 [BT, D] tile at half the registers per thread), unless
    ``config.ut_warps`` says."""
    return config.ut_warps or (4 if D <= 64 else 8)


_INVERSE_NUM_WARPS = 2  # the inverse works on 16×16 blocks: 2 warps run it fastest, more wait on its barriers


def _launch(kernel, grid, *args, BT, D, warps=None, config: KernelConfig = DEFAULT, **meta):
    """Launch one UT kernel (with ``num_warps(D, config)`` warps unless ``warps`` is given); a configuration whose
    tiles do not fit the GPU's shared memory gets a clear error."""
    try:
        kernel[grid](*args, BT=BT, D=D, **meta, num_warps=warps or num_warps(D, config))
    except OutOfResources as err:
        group = f", {meta['GROUP']} query heads per kv head" if "GROUP" in meta else ""
        raise RuntimeError(
            f"the fused UT kernels do not fit this GPU for head dim {D}{group} and block size {BT} ({err}); "
            f"use ut='torch', or a smaller block_size") from err


def half_operands(dtype: torch.dtype, config: KernelConfig = DEFAULT) -> int:
    """The operands of the UT kernels' products for inputs (q) of ``dtype``: ``FP16`` (fp16 scaled by powers of
    two, ``_mm``) for 16-bit inputs, ``TF32`` for fp32 inputs, whose tf32 products have the same significand on a
    GPU and run in exact fp32 under the interpreter (``config.ut_half`` pins one). The inverse is exact fp32 either
    way. fp16 operands take half the shared memory at twice the tensor-core rate, with no larger errors against
    fp64."""
    return int(FP16) if pick(config.ut_half, dtype != torch.float32) else int(TF32)


def gram_on_16_bit_rows(dtype, config: KernelConfig = DEFAULT):
    """Whether the inverse kernel forms W Wᵀ in one pass on the fp16/bf16 rows of w (``_gram_16_bit``: their
    products are exact in fp32; the norms scale the sums after) instead of three tf32 passes on the normalised
    fp32 rows: for 16-bit w (not bf16 under the interpreter, whose bf16 products are not exact), unless
    ``config.gram16`` says. It takes a quarter of the shared memory, so more programs share a multiprocessor."""
    sixteen = dtype == torch.float16 or (dtype == torch.bfloat16 and not interpreting())
    return pick(config.gram16, True) and sixteen


def _inverse(w, beta, tokens, T, BT, out=None, config: KernelConfig = DEFAULT):
    """A = (I + strictLower(D_β W Wᵀ))⁻¹ of every (kv head, chunk): ``[Hkv, NC, BT, BT]`` fp32 (w already unit-last),
    into ``out`` if given (the kernel writes every element)."""
    B, Hkv, D = w.shape[0], w.shape[2], w.shape[3]
    NC = tokens.numel() // BT
    a = torch.empty((Hkv, NC, BT, BT), dtype=torch.float32, device=w.device) if out is None else out
    if NC > 0:
        _launch(_ut_inverse_kernel, (NC, Hkv), w, beta, tokens, a, T, B * T, *w.stride()[:3], *beta.stride(),
                BT=BT, D=D, warps=_INVERSE_NUM_WARPS, GRAM16=gram_on_16_bit_rows(w.dtype, config))
    return a


def _strides(q, k, w, beta):
    """(b, t, head) strides of q, k, w and β; the kernels read q, k, w rows with unit stride along D."""
    return [st for x in (q, k, w) for st in x.stride()[:3]] + list(beta.stride())


def _unit_last(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_tokens(tokens, block):
    if tokens.dtype != torch.int64 or tokens.ndim != 1 or tokens.numel() % block:
        raise ValueError(f"tokens must be int64 [NC·BT] (from layout.slot_tokens), got {tokens.dtype} "
                         f"{tuple(tokens.shape)} for BT = {block}")
