"""The per-chunk UT transform of ``_ut`` as two fused Triton kernels (forward, and backward by recomputation).

Same inputs and outputs as :func:`kernels._ut.ut_factors`, which stays the reference. One program per
(kv head, chunk) holds the chunk's W, K (``[BT, D]``) and β in fp32 and computes, with ieee fp32 products:

    N  = strictLower(D_β W Wᵀ),   A = (I + N)⁻¹   row by row: A_i = e_i − Σ_{j<i} N_ij A_j
    U  = A D_β W,   X = A D_β strictLower(W Kᵀ),   k̃ = K − Xᵀ W,   M = Wᵀ U
    per query head of the group:  Q_W = tril(Q Wᵀ),   q̃ = Q − Q_W U,   S_d = Q Kᵀ − Q_W X

The backward recomputes N, A, U, X from (W, K, β), so autograd keeps only the inputs (the PyTorch version keeps
every BT×BT and BT×D intermediate). Given dq̃, dk̃, dM, dS_d, in reverse order of the forward:

    dU = W dM − Σ_g Q_Wᵀ dq̃,   dX = −W dk̃ᵀ − Σ_g Q_Wᵀ dS_d
    dQ_W = tril(−dq̃ Uᵀ − dS_d Xᵀ),   dQ = dq̃ + dS_d K + dQ_W W
    dK = dk̃ + Σ_g dS_dᵀ Q + dWKᵀ W,   dWK = strictLower((A D_β)ᵀ dX)
    d(A D_β) = dU Wᵀ + dX strictLower(W Kᵀ)ᵀ,   dA = d(A D_β) D_β,   dβ_j += Σ_i A_ij d(A D_β)_ij
    dN = strictLower(−Aᵀ dA Aᵀ),   dβ_i += Σ_j dN_ij (W Wᵀ)_ij,   dG = D_β dN
    dW = U dMᵀ − X dk̃ + Σ_g dQ_Wᵀ Q + (A D_β)ᵀ dU + dWK K + (dG + dGᵀ) W

Grouped query heads of one kv head are summed inside the program, so no atomics are needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _this_chunk(NC, BT: tl.constexpr, D: tl.constexpr):
    """This program's chunk n and kv head hk (64-bit), row and column ranges, and the chunk's first row."""
    n = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1).to(tl.int64)
    return n, hk, tl.arange(0, BT), tl.arange(0, D), (hk * NC + n) * BT


@triton.jit
def _chunk_factors(W, K, BETA, base, rows, dcol, BT: tl.constexpr, D: tl.constexpr):
    """Load one chunk's w, k ``[BT, D]`` and β ``[BT]``; return them with W Wᵀ, A, A D_β, U, strictLower(W Kᵀ), X."""
    w = tl.load(W + (base + rows[:, None]) * D + dcol[None, :])
    k = tl.load(K + (base + rows[:, None]) * D + dcol[None, :])
    b = tl.load(BETA + base + rows)
    strict = rows[:, None] > rows[None, :]
    gram = tl.dot(w, tl.trans(w), input_precision="ieee")
    n = tl.where(strict, b[:, None] * gram, 0.0)
    a = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for i in range(1, BT):  # forward substitution: row i of A from the finished rows j < i
        n_i = tl.sum(tl.where(rows[:, None] == i, n, 0.0), axis=0)  # N[i, :]
        a_i = tl.sum(n_i[:, None] * a, axis=0)
        a = tl.where(rows[:, None] == i, a - a_i[None, :], a)
    ad = a * b[None, :]
    u = tl.dot(ad, w, input_precision="ieee")
    wk = tl.where(strict, tl.dot(w, tl.trans(k), input_precision="ieee"), 0.0)
    x = tl.dot(ad, wk, input_precision="ieee")
    return w, k, b, gram, a, ad, u, wk, x


@triton.jit
def _ut_fwd_kernel(Q, K, W, BETA, QS, KS, M, SD, NC, GROUP: tl.constexpr, BT: tl.constexpr, D: tl.constexpr):
    n, hk, rows, dcol, base = _this_chunk(NC, BT, D)
    w, k, b, gram, a, ad, u, wk, x = _chunk_factors(W, K, BETA, base, rows, dcol, BT, D)
    k_end = k - tl.dot(tl.trans(x), w, input_precision="ieee")
    tl.store(KS + (base + rows[:, None]) * D + dcol[None, :], k_end)
    transition = tl.dot(tl.trans(w), u, input_precision="ieee")
    tl.store(M + (hk * NC + n) * D * D + dcol[:, None] * D + dcol[None, :], transition)
    lower = rows[:, None] >= rows[None, :]
    for gi in range(GROUP):
        qbase = ((hk * GROUP + gi) * NC + n) * BT
        q = tl.load(Q + (qbase + rows[:, None]) * D + dcol[None, :])
        qw = tl.where(lower, tl.dot(q, tl.trans(w), input_precision="ieee"), 0.0)
        q_start = q - tl.dot(qw, u, input_precision="ieee")
        tl.store(QS + (qbase + rows[:, None]) * D + dcol[None, :], q_start)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") - tl.dot(qw, x, input_precision="ieee")
        tl.store(SD + (qbase + rows[:, None]) * BT + rows[None, :], s)


@triton.jit
def _ut_bwd_kernel(Q, K, W, BETA, DQS, DKS, DM, DSD, DQ, DK, DW, DBETA, NC,
                   GROUP: tl.constexpr, BT: tl.constexpr, D: tl.constexpr):
    n, hk, rows, dcol, base = _this_chunk(NC, BT, D)
    w, k, b, gram, a, ad, u, wk, x = _chunk_factors(W, K, BETA, base, rows, dcol, BT, D)
    tile = (base + rows[:, None]) * D + dcol[None, :]
    dk_end = tl.load(DKS + tile)
    dm = tl.load(DM + (hk * NC + n) * D * D + dcol[:, None] * D + dcol[None, :])
    du = tl.dot(w, dm, input_precision="ieee")  # M = Wᵀ U
    dw = tl.dot(u, tl.trans(dm), input_precision="ieee")
    dx = -tl.dot(w, tl.trans(dk_end), input_precision="ieee")  # k̃ = K − Xᵀ W
    dw -= tl.dot(x, dk_end, input_precision="ieee")
    dk = dk_end
    lower = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    for gi in range(GROUP):
        qbase = ((hk * GROUP + gi) * NC + n) * BT
        qtile = (qbase + rows[:, None]) * D + dcol[None, :]
        q = tl.load(Q + qtile)
        dq_start = tl.load(DQS + qtile)
        ds = tl.load(DSD + (qbase + rows[:, None]) * BT + rows[None, :])
        qw = tl.where(lower, tl.dot(q, tl.trans(w), input_precision="ieee"), 0.0)
        dqw = -tl.dot(dq_start, tl.trans(u), input_precision="ieee") - tl.dot(ds, tl.trans(x), input_precision="ieee")
        dqw = tl.where(lower, dqw, 0.0)
        dq = dq_start + tl.dot(ds, k, input_precision="ieee") + tl.dot(dqw, w, input_precision="ieee")
        tl.store(DQ + qtile, dq)
        du -= tl.dot(tl.trans(qw), dq_start, input_precision="ieee")
        dx -= tl.dot(tl.trans(qw), ds, input_precision="ieee")
        dk += tl.dot(tl.trans(ds), q, input_precision="ieee")
        dw += tl.dot(tl.trans(dqw), q, input_precision="ieee")
    # U = A D_β W and X = A D_β strictLower(W Kᵀ)
    dad = tl.dot(du, tl.trans(w), input_precision="ieee") + tl.dot(dx, tl.trans(wk), input_precision="ieee")
    dw += tl.dot(tl.trans(ad), du, input_precision="ieee")
    dwk = tl.where(strict, tl.dot(tl.trans(ad), dx, input_precision="ieee"), 0.0)
    dw += tl.dot(dwk, k, input_precision="ieee")
    dk += tl.dot(tl.trans(dwk), w, input_precision="ieee")
    # A D_β, then A = (I + N)⁻¹ and N = strictLower(D_β W Wᵀ)
    da = dad * b[None, :]
    db = tl.sum(a * dad, axis=0)
    at = tl.trans(a)
    dn = -tl.dot(tl.dot(at, da, input_precision="ieee"), at, input_precision="ieee")
    dn = tl.where(strict, dn, 0.0)
    db += tl.sum(dn * gram, axis=1)
    dgram = dn * b[:, None]
    dw += tl.dot(dgram + tl.trans(dgram), w, input_precision="ieee")
    tl.store(DK + tile, dk)
    tl.store(DW + tile, dw)
    tl.store(DBETA + base + rows, db)


# ---------------------------------------------------------------------------------------------------------
# Custom ops, as for the scan (see ``path``): opaque to torch.compile, joined by ``register_autograd``.

def _launch_warps(D: int) -> int:
    return 8 if D >= 128 else 4


def _ut_fwd_impl(q, k, w, beta):
    H, NC, BT, D = q.shape
    Hkv = k.shape[0]
    q, k, w, beta = q.contiguous(), k.contiguous(), w.contiguous(), beta.contiguous()
    qs = torch.full_like(q, float("nan"))
    ks = torch.full_like(k, float("nan"))
    m = torch.full((Hkv, NC, D, D), float("nan"), dtype=q.dtype, device=q.device)
    sd = torch.full((H, NC, BT, BT), float("nan"), dtype=q.dtype, device=q.device)
    if NC > 0:
        _ut_fwd_kernel[(NC, Hkv)](q, k, w, beta, qs, ks, m, sd, NC, GROUP=H // Hkv, BT=BT, D=D,
                                  num_warps=_launch_warps(D))
    return qs, ks, m, sd


def _ut_fwd_fake(q, k, w, beta):
    H, NC, BT, D = q.shape
    return (torch.empty_like(q), torch.empty_like(k), q.new_empty((k.shape[0], NC, D, D)),
            q.new_empty((H, NC, BT, BT)))


def _ut_bwd_impl(dqs, dks, dm, dsd, q, k, w, beta):
    H, NC, BT, D = q.shape
    Hkv = k.shape[0]
    args = [t.contiguous() for t in (q, k, w, beta, dqs, dks, dm, dsd)]
    dq = torch.full_like(q, float("nan"))
    dk = torch.full_like(k, float("nan"))
    dw = torch.full_like(w, float("nan"))
    dbeta = torch.full_like(beta, float("nan"))
    if NC > 0:
        _ut_bwd_kernel[(NC, Hkv)](*args, dq, dk, dw, dbeta, NC, GROUP=H // Hkv, BT=BT, D=D,
                                  num_warps=_launch_warps(D))
    return dq, dk, dw, dbeta


def _ut_bwd_fake(dqs, dks, dm, dsd, q, k, w, beta):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(w), torch.empty_like(beta)


_ut_fwd = torch.library.custom_op("pathlab::path_ut_fwd", _ut_fwd_impl, mutates_args=(),
                                  schema="(Tensor q, Tensor k, Tensor w, Tensor beta) -> (Tensor, Tensor, Tensor, Tensor)")
_ut_fwd.register_fake(_ut_fwd_fake)
_ut_bwd = torch.library.custom_op(
    "pathlab::path_ut_bwd", _ut_bwd_impl, mutates_args=(),
    schema="(Tensor dqs, Tensor dks, Tensor dm, Tensor dsd, Tensor q, Tensor k, Tensor w, Tensor beta) "
           "-> (Tensor, Tensor, Tensor, Tensor)",
)
_ut_bwd.register_fake(_ut_bwd_fake)


def _ut_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)  # only the inputs: the backward recomputes the rest


def _ut_backward(ctx, dqs, dks, dm, dsd):
    q, k, w, beta = ctx.saved_tensors
    H, NC, BT, D = q.shape
    dqs = torch.zeros_like(q) if dqs is None else dqs  # an output that did not reach the loss
    dks = torch.zeros_like(k) if dks is None else dks
    dm = q.new_zeros((k.shape[0], NC, D, D)) if dm is None else dm
    dsd = q.new_zeros((H, NC, BT, BT)) if dsd is None else dsd
    return _ut_bwd(dqs, dks, dm, dsd, q, k, w, beta)


_ut_fwd.register_autograd(_ut_backward, setup_context=_ut_setup_context)


def ut_factors_triton(q, k, w, beta):
    """:func:`kernels._ut.ut_factors` by the fused kernels: same shapes (fp32 inputs, w unit-norm), same outputs."""
    return _ut_fwd(q, k, w, beta)
