"""Fused PaTH decode step in Triton: update the cached keys with H_t in place and attend, in one pass.

For each (batch, kv head) and each slice of the cache (split-K, FlashDecoding style), a program reads its
block of fp32 keys once, applies k_j ← k_j − β_t (k_jᵀ w_t) w_t to the positions j < n (the new key k_t sits at
position n untransformed), writes them back, and scores every query head of the group against the updated keys:
s_j = scale · q·k_j + (G_t − G_j). Each slice returns a partial (max, sum, Σ p v); ``combine`` merges them.
Bytes per step: the fp32 keys read and written once, the values read once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_step_kernel(
    K, V, G, Q, WN, BETA, GT, M_OUT, L_OUT, ACC_OUT,
    n, max_len, scale_log2, n_split, per_split,
    GROUP: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)  # b * Hkv + kv head
    split = tl.program_id(1)
    dcol = tl.arange(0, D)
    vcol = tl.arange(0, DV)
    grow = tl.arange(0, GROUP)
    wv = tl.load(WN + bh * D + dcol)  # fp32 unit w_t
    beta = tl.load(BETA + bh)
    q = tl.load(Q + (bh * GROUP + grow[:, None]) * D + dcol[None, :]).to(tl.float32)  # [GROUP, D]
    if HAS_GATE:
        gt = tl.load(GT + bh * GROUP + grow)  # fp64 G_t per query head
    m_i = tl.full([GROUP], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP], tl.float32)
    acc = tl.zeros([GROUP, DV], tl.float32)
    start = split * per_split
    for off in range(start, start + per_split, BLOCK):
        j = off + tl.arange(0, BLOCK)
        valid = j <= n
        kp = K + (bh * max_len + j[:, None]) * D + dcol[None, :]
        kb = tl.load(kp, mask=valid[:, None], other=0.0)  # [BLOCK, D] fp32
        coef = tl.sum(kb * wv[None, :], 1)
        upd = (j < n)[:, None]
        kb = tl.where(upd, kb - (beta * coef)[:, None] * wv[None, :], kb)
        tl.store(kp, kb, mask=upd & valid[:, None])
        s = tl.sum(q[:, None, :] * kb[None, :, :], 2) * scale_log2  # [GROUP, BLOCK]
        if HAS_GATE:
            gj = tl.load(G + (bh * GROUP + grow[:, None]) * max_len + j[None, :], mask=valid[None, :], other=0.0)
            s += ((gt[:, None] - gj) * 1.4426950408889634).to(tl.float32)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vb = tl.load(V + (bh * max_len + j[:, None]) * DV + vcol[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vb.to(tl.float32)[None, :, :], 1)
        m_i = m_new
    out = (bh * n_split + split) * GROUP + grow
    tl.store(M_OUT + out, m_i)
    tl.store(L_OUT + out, l_i)
    tl.store(ACC_OUT + out[:, None] * DV + vcol[None, :], acc)


def decode_step_triton(k_cache, v_cache, G, q, wn, beta, gate_t, n, scale, *, block=None, n_split=None):
    """Update ``k_cache[:, :, :n]`` with H_t in place and attend over positions 0 … n (k_t already at n).

    k_cache ``[B, Hkv, L, D]`` fp32 contiguous; v_cache ``[B, Hkv, L, Dv]``; G ``[B, H, L]`` fp64 (or None);
    q ``[B, H, D]``; wn ``[B, Hkv, D]`` fp32 unit; beta ``[B, Hkv]`` fp32; gate_t ``[B, H]`` fp64 = G_n or None.
    Returns o ``[B, H, Dv]`` fp32.
    """
    B, Hkv, L, D = k_cache.shape
    H, DV = q.shape[1], v_cache.shape[-1]
    group = H // Hkv
    total = n + 1
    block = block or (64 if D <= 64 else 32)
    if n_split is None:  # enough programs to fill the GPU, each with a few blocks
        n_split = max(1, min(triton.cdiv(total, block), triton.cdiv(4 * 132, B * Hkv)))
    per_split = triton.cdiv(triton.cdiv(total, n_split), block) * block
    n_split = triton.cdiv(total, per_split)
    dev = q.device
    m = torch.empty(B * Hkv, n_split, group, dtype=torch.float32, device=dev)
    l_ = torch.empty_like(m)
    acc = torch.empty(B * Hkv, n_split, group, DV, dtype=torch.float32, device=dev)
    has_gate = G is not None
    _decode_step_kernel[(B * Hkv, n_split)](
        k_cache, v_cache, G if has_gate else k_cache, q.contiguous(), wn.contiguous(), beta.contiguous(),
        gate_t.contiguous() if has_gate else k_cache, m, l_, acc,
        n, L, scale * 1.4426950408889634, n_split, per_split,
        GROUP=group, HAS_GATE=has_gate, BLOCK=block, D=D, DV=DV,
    )
    mmax = m.max(dim=1, keepdim=True).values
    wgt = torch.exp2(m - mmax)  # [B·Hkv, split, group]
    o = (acc * wgt[..., None]).sum(1) / (l_ * wgt).sum(1)[..., None]
    return o.reshape(B, H, DV)
