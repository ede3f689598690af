"""Per-chunk UT transform in PyTorch (fp32): the cheap O(T·(BT + D)) part of the PaTH kernel.

For a chunk with rows W ∈ R^{BT×D} (unit rows), D_β = diag(β):

    A  = (I + strictLower(D_β W Wᵀ))⁻¹        unit lower-triangular solve, fp32
    U  = A D_β W                               H_last ⋯ H_first = I − Wᵀ U
    M  = Wᵀ U                                  the chunk's transition P = I − M   [D, D]
    q̃  = Q − tril(Q Wᵀ) U                      q_rᵀ H_r ⋯ H_first   (query carried to the chunk start)
    k̃  = K − (A D_β strictLower(W Kᵀ))ᵀ W      H_last ⋯ H_{r+1} k_r (key carried to the chunk end)
    S_d = Q Kᵀ − tril(Q Wᵀ) A D_β strictLower(W Kᵀ)   intra-chunk logits (unscaled; masked by the kernel)

The scan carries a query across a whole chunk with one D×D product, q ← q − q M (instead of (q Wᵀ) U, two
products), and its backward returns one D×D gradient dM per chunk instead of dW and dU. Autograd differentiates
through this module; the Triton scan (``scan``) returns the gradients of q̃, k̃, M and S_d, so M = Wᵀ U
and the triangular solve's backward (dN = −Aᵀ dA Aᵀ on the strict lower part) are PyTorch's.
"""

from __future__ import annotations

import torch


def ut_factors(q, k, w, beta):
    """q ``[H, NC, BT, D]``; k, w ``[Hkv, NC, BT, D]``; beta ``[Hkv, NC, BT]``; all fp32, w unit-norm.

    Returns q̃ ``[H, NC, BT, D]``, k̃ ``[Hkv, NC, BT, D]``, M ``[Hkv, NC, D, D]``, S_d ``[H, NC, BT, BT]``.
    Query head h uses kv head h // (H / Hkv).
    """
    H, NC, BT, D = q.shape
    Hkv = k.shape[0]
    group = H // Hkv
    ones = torch.ones(BT, BT, dtype=torch.bool, device=q.device)
    lower, strict = ones.tril(), ones.tril(-1)
    eye = torch.eye(BT, dtype=q.dtype, device=q.device)
    L = eye + (beta[..., :, None] * (w @ w.transpose(-1, -2))).masked_fill(~strict, 0.0)
    A = torch.linalg.solve_triangular(L, eye.expand_as(L), upper=False, unitriangular=True)
    AD = A * beta[..., None, :]  # A D_β                                       [Hkv, NC, BT, BT]
    U = AD @ w  #                                                                [Hkv, NC, BT, D]
    ad_wk = AD @ (w @ k.transpose(-1, -2)).masked_fill(~strict, 0.0)  # A D_β strictLower(W Kᵀ)
    k_end = k - ad_wk.transpose(-1, -2) @ w
    qg = q.reshape(Hkv, group, NC, BT, D)
    qw = (qg @ w[:, None].transpose(-1, -2)).masked_fill(~lower, 0.0)  # tril(Q Wᵀ)  [Hkv, G, NC, BT, BT]
    q_start = qg - qw @ U[:, None]
    s_diag = qg @ k[:, None].transpose(-1, -2) - qw @ ad_wk[:, None]
    transition = w.transpose(-1, -2) @ U  # M = Wᵀ U                               [Hkv, NC, D, D]
    return q_start.reshape(H, NC, BT, D), k_end, transition, s_diag.reshape(H, NC, BT, BT)
