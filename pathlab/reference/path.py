"""Explicit fp64 PaTH: every transition H_t = I − β_t w_t w_tᵀ is formed as a D×D matrix and applied.

s_ij = scale · q_iᵀ H_i H_{i−1} ⋯ H_{j+1} k_j + (G_i − G_j), G = cumsum(g), causal softmax, o_i = Σ_j α_ij v_j.
The query's own H_i is included and the key's own H_j is not, so s_ii = scale · q_iᵀ k_i. The gate is not
multiplied by ``scale`` (FoX's convention; the public fla kernel scales it too).

Causal position by position: o_i reads only the inputs at positions ≤ i, so a NaN (or inf) at a later position
never reaches it. The logits of a query are formed for its past keys only, and o_i = Σ_{j≤i} α_ij v_j takes the
values up to i only: the T×T product P V would multiply a future NaN value by its weight 0 (0 · NaN = NaN) and
spread it to every earlier row (and, in the backward, through Σ_j α_ij dP_ij, to every earlier gradient).

Cost O(T² D²): a test oracle for T ≲ 256 that shares no code path with the blockwise algorithm.
"""

from __future__ import annotations

import torch

from pathlab._checks import check_path_inputs, check_path_values, check_scale, expand_kv_heads, normalize_w


def path_logits(q, k, w, beta, *, scale=None):
    """Unmasked PaTH logits without the gate: ``[B, H, T, T]`` fp64 (entries above the diagonal are 0)."""
    B, T, H, D = q.shape
    scale = check_scale(scale, D)
    f64 = torch.float64
    w = normalize_w(w).to(f64)
    q, k, w = q.to(f64), expand_kv_heads(k, H).to(f64), expand_kv_heads(w, H)
    beta = expand_kv_heads(beta, H).to(f64)
    eye = torch.eye(D, dtype=f64, device=q.device)
    transitions = eye - beta[..., None, None] * w[..., :, None] * w[..., None, :]  # H_t: [B, T, H, D, D]

    logits = torch.zeros(B, H, T, T, dtype=f64, device=q.device)
    carried = q.clone()  # carried[:, i] = (H_{j+1} ⋯ H_i) q_i for the current j = i − n
    for n in range(T):
        i = torch.arange(n, T, device=q.device)
        j = i - n
        logits[:, :, i, j] = (carried[:, i] * k[:, j]).sum(-1).transpose(1, 2)
        if n + 1 < T:
            # step one key further left: apply H_{j} (= H_{i−n}) to the carried query (H is symmetric)
            i_next = i[1:]
            mats = transitions[:, i_next - n]  # H_{i−n} for queries i ≥ n+1
            carried[:, i_next] = (mats @ carried[:, i_next, :, :, None]).squeeze(-1)
    return scale * logits


def path_attention(q, k, v, w, beta, g=None, *, scale=None, return_attention=False):
    """Reference PaTH / PaTH-FoX attention.

    q ``[B, T, H, D]``, k and w ``[B, T, Hkv, D]``, v ``[B, T, Hkv, Dv]``, beta ``[B, T, Hkv]`` in [0, 2],
    g ``[B, T, H]`` log forget gates ≤ 0 or None. Returns o ``[B, T, H, Dv]`` in q's dtype, or
    ``(o, logits, probs)`` (each ``[B, H, T, T]`` fp64, −inf / 0 above the diagonal) with ``return_attention``.
    """
    check_path_inputs(q, k, v, w, beta, g)
    check_path_values(beta, g)
    H = q.shape[2]
    logits = path_logits(q, k, w, beta, scale=scale)
    if g is not None:
        G = torch.cumsum(g.to(torch.float64), dim=1).transpose(1, 2)  # [B, H, T]
        logits = logits + G[:, :, :, None] - G[:, :, None, :]
    v64 = expand_kv_heads(v, H).transpose(1, 2).to(torch.float64)
    return _causal_output(logits, v64, q.dtype, return_attention)


def _causal_output(logits, v, out_dtype, return_attention):
    """o_i = Σ_{j≤i} α_ij v_j, α = causal softmax of ``logits [B, H, T, T]``, ``v [B, H, T, Dv]``: row by row over
    the values up to i only (module docstring), o ``[B, T, H, Dv]`` in ``out_dtype``; with ``return_attention``
    also the masked logits (−inf above the diagonal) and the probabilities."""
    T = logits.shape[-1]
    future = torch.ones(T, T, dtype=torch.bool, device=logits.device).triu(1)
    logits = logits.masked_fill(future, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # a row's softmax reads only its own (past) logits
    rows = [probs[:, :, i, None, : i + 1] @ v[:, :, : i + 1] for i in range(T)]  # each [B, H, 1, Dv]
    o = torch.cat(rows, dim=2) if rows else v.new_zeros(*v.shape[:2], 0, v.shape[-1])
    o = o.transpose(1, 2).to(out_dtype)
    return (o, logits, probs) if return_attention else o
