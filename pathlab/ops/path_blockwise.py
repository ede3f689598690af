"""Blockwise PaTH in plain PyTorch: the UT-transform algorithm, O(T·D) memory per head beyond the output.

Per chunk of C tokens with rows W ∈ R^{C×D}, D_β = diag(β):

    A = (I + strictLower(D_β W Wᵀ))⁻¹              (unit lower-triangular solve)
    U = A D_β W,       H_last ⋯ H_first = I − Wᵀ U  (the UT / WY form of the chunk product)
    q̃ = Q − tril(Q Wᵀ) U                           (row r: q_rᵀ H_r ⋯ H_first, carried to the chunk start)
    k̃ = K − (A D_β strictLower(W Kᵀ))ᵀ W           (row r: H_last ⋯ H_{r+1} k_r, carried to the chunk end)
    S_intra = tril(Q Kᵀ) − tril(Q Wᵀ) A D_β strictLower(W Kᵀ)

A principal block of a triangular inverse is the inverse of that block, so the masked products above give
the transport over any sub-interval of a chunk. Across chunks, a query chunk scans key chunks right to left:
S_m = q̃ k̃_mᵀ, then q̃ ← q̃ − (q̃ W_mᵀ) U_m moves the queries across chunk m.

The forget gate enters as G_i − G_j with G the prefix sum of g. G is summed in fp64 and each query chunk
subtracts its first G before rounding to the working dtype: in fp32, G itself (large and negative with strong
gates) would carry an absolute error of about 6e-8·|G| into every logit, whatever the distance i − j.

Causality is chunk by chunk (``pathlab.ops.path``, "Non-finite inputs"): a NaN in v_t, w_t or β_t reaches every
row of t's chunk through the products with masked triangles (P V, U = A D_β W, q̃), none before the chunk.
The diagonal block's future keys are masked after the gate is added, so a NaN g_t stays at t and later.

Memory: the per-chunk factors are O(T·(C + D)). Each query chunk's scan runs under activation
checkpointing, so autograd keeps only that chunk's output and recomputes its scan (O(T·(C + D)) at a time)
during the backward: nothing of size T×T is ever held.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from pathlab._checks import expand_kv_heads


def chunk_factors(q, k, w, beta):
    """UT factors per chunk. Inputs ``[B, H, N, C, D]`` (beta ``[B, H, N, C]``), w unit-norm.

    Returns (q̃, k̃, U, S_intra) with S_intra the unscaled, unmasked intra-chunk logits ``[B, H, N, C, C]``.
    """
    C = q.shape[-2]
    ones = torch.ones(C, C, dtype=torch.bool, device=q.device)
    lower, strict = ones.tril(), ones.tril(-1)
    ww = w @ w.transpose(-1, -2)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    L = eye + (beta[..., :, None] * ww).masked_fill(~strict, 0.0)
    A = torch.linalg.solve_triangular(L, eye.expand_as(L), upper=False, unitriangular=True)
    AD = A * beta[..., None, :]  # A D_β
    U = AD @ w
    qw = (q @ w.transpose(-1, -2)).masked_fill(~lower, 0.0)
    wk = (w @ k.transpose(-1, -2)).masked_fill(~strict, 0.0)
    ad_wk = AD @ wk
    q_start = q - qw @ U
    k_end = k - ad_wk.transpose(-1, -2) @ w
    s_intra = q @ k.transpose(-1, -2) - qw @ ad_wk
    return q_start, k_end, U, s_intra


def _query_chunk(n: int, scale: float, q_start, s_intra, k_end, w, u, v, gate_q, gate_k):
    """Output of query chunk n. q_start/s_intra: this chunk's ``[B, H, C, D]``/``[B, H, C, C]``; k_end, w, u:
    chunks 0 … n−1 ``[B, H, n, C, D]``; v: chunks 0 … n ``[B, H, (n+1)C, Dv]``; gate_q ``[B, H, C]`` and
    gate_k ``[B, H, (n+1)C]`` (G_i and G_j in fp64) or None."""
    C = s_intra.shape[-1]
    blocks = [s_intra]  # right-most block first; reversed below
    carried = q_start
    for m in range(n - 1, -1, -1):
        blocks.append(carried @ k_end[:, :, m].transpose(-1, -2))
        if m > 0:
            carried = carried - (carried @ w[:, :, m].transpose(-1, -2)) @ u[:, :, m]
    logits = scale * torch.cat(blocks[::-1], dim=-1)  # [B, H, C, (n+1)C], keys in order
    if gate_q is not None:  # G_i − G_j, relative to the chunk's first G_i in fp64, then rounded
        ref = gate_q[..., :1]
        gq, gk = (gate_q - ref).to(logits.dtype), (gate_k - ref).to(logits.dtype)
        logits = logits + gq[..., :, None] - gk[..., None, :]
    # the future keys (of the diagonal block) masked after the gate is added: a NaN or inf G_j of a later position
    # then never meets the mask's −inf (−inf + NaN is NaN, and the row's softmax with it)
    n_keys = logits.shape[-1]
    future = torch.ones(C, n_keys, dtype=torch.bool, device=logits.device).triu(n_keys - C + 1)
    logits = logits.masked_fill(future, float("-inf"))
    return torch.softmax(logits, dim=-1) @ v


def path_attention_blockwise(q, k, v, w, beta, g=None, *, scale: float, chunk_size: int = 64):
    """PaTH / PaTH-FoX by the blockwise UT algorithm (see the module docstring).

    q ``[B, T, H, D]``; k, w ``[B, T, Hkv, D]`` (w unit-norm); v ``[B, T, Hkv, Dv]``; beta ``[B, T, Hkv]``;
    g ``[B, T, H]`` or None. Works in fp64 for fp64 inputs and fp32 otherwise; returns q's dtype.
    """
    B, T, H, D = q.shape
    C = int(chunk_size)
    if C < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    N = -(-T // C)
    pad = N * C - T

    def heads_first(t):  # [B, T, H, ...] -> [B, H, T_padded, ...]; padding is transparent (β = 0, g = 0)
        t = t.to(work).transpose(1, 2)
        return F.pad(t, (0, 0, 0, pad)) if t.ndim == 4 else F.pad(t, (0, pad))

    qh = heads_first(q)
    kh, vh, wh = (heads_first(expand_kv_heads(t, H)) for t in (k, v, w))
    bh = heads_first(expand_kv_heads(beta, H))

    def chunks(t):
        return t.reshape(B, H, N, C, *t.shape[3:])

    q_start, k_end, u, s_intra = chunk_factors(chunks(qh), chunks(kh), chunks(wh), chunks(bh))
    wc = chunks(wh)
    G = None
    if g is not None:  # [B, H, T_padded] fp64 prefix sums (padding: g = 0)
        G = F.pad(torch.cumsum(g.to(torch.float64), dim=1).transpose(1, 2), (0, pad))

    need_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (q, k, v, w, beta) + ((g,) if g is not None else ())
    )
    outputs = []
    for n in range(N):
        args = (
            q_start[:, :, n], s_intra[:, :, n], k_end[:, :, :n], wc[:, :, :n], u[:, :, :n],
            vh[:, :, : (n + 1) * C],
            None if G is None else G[:, :, n * C : (n + 1) * C],
            None if G is None else G[:, :, : (n + 1) * C],
        )
        if need_grad:
            outputs.append(checkpoint(_query_chunk, n, scale, *args, use_reentrant=False))
        else:
            outputs.append(_query_chunk(n, scale, *args))
    o = torch.cat(outputs, dim=2)[:, :, :T]  # [B, H, T, Dv]
    return o.transpose(1, 2).to(q.dtype)
