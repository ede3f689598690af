"""PaTH decode steps in Triton.

Immediate step (``PathDecodeCache(defer=0)``): for each (batch, kv head) and each slice of the cache (split-K,
FlashDecoding style), a program reads its block of fp32 keys once, applies k_j ← k_j − β_t (k_jᵀ w_t) w_t to the
positions j < n (the new key k_t sits at position n untransformed), writes them back, and scores every query head
of the group against the updated keys: s_j = scale · q·k_j + (G_t − G_j). Each slice returns a partial
(max, sum, Σ p v), merged by a few torch ops. Bytes per step: the fp32 keys read and written once, the values read
once.

Deferred step (``defer=R ≥ 1``, the default): see the section further down; the keys are read once per step in
the shadow's precision and rewritten only every R steps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import DEFAULT, KernelConfig, launch, pick


@triton.jit
def _softmax_start(GROUP: tl.constexpr, DV: tl.constexpr):
    """The empty online softmax of ``GROUP`` query rows: running max −inf, sum 0, ``Σ p v`` 0."""
    return (tl.full([GROUP], float("-inf"), tl.float32), tl.zeros([GROUP], tl.float32),
            tl.zeros([GROUP, DV], tl.float32))


@triton.jit
def _softmax_block(s, vb, m_i, l_i, acc):
    """One block of an online softmax: scores ``s [GROUP, BLOCK]`` (base 2, −inf where masked) and values
    ``vb [BLOCK, DV]`` update the running max ``m_i``, sum ``l_i`` and ``acc = Σ p v``; returns the three."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vb.to(tl.float32)[None, :, :], 1)
    return m_new, l_i, acc


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
    m_i, l_i, acc = _softmax_start(GROUP, DV)
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
        vb = tl.load(V + (bh * max_len + j[:, None]) * DV + vcol[None, :], mask=valid[:, None], other=0.0)
        m_i, l_i, acc = _softmax_block(s, vb, m_i, l_i, acc)
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
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 132  # interpreter
        n_split = max(1, min(triton.cdiv(total, block), triton.cdiv(4 * sms, B * Hkv)))
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


# --------------------------------------------------------------------------------------------------------------
# Deferred transitions (``PathDecodeCache(defer=R)``, R ≥ 1): the cache holds keys carried to a base step τ and a
# low-precision shadow of them; the pending product M = H_{τ+1} ⋯ H_n (D×D) and the recent keys carried to the
# current step (≤ R rows) live beside it. Positions are 0-based: the base keys are 0 … base−1 (base = τ + 1),
# the token of the step sits at n. A step is three launches:
#
#   _deferred_prep_kernel    one program per (batch, kv head): M ← M H_n, q_τ = M q for every query head of the
#                            group (written, pre-scaled, for the next kernel), recent keys ← · H_n and append k_n,
#                            store v_n and G_n, score the recent keys (positions base … n) with q itself → partial 0
#   _deferred_attend_dot_kernel  split-K over the base keys 0 … base−1: reads the shadow keys and the values once, scores
#                            with q_τ, one partial (max, sum, Σ p v) per split → partials 1 … n_split
#   _deferred_merge_kernel   one program per (batch, kv head): merges the partials, writes o in q's dtype, and
#                            advances the step counter n → n + 1
#
# and every R steps ``fold_triton`` carries the base keys to the current step, K ← K M (rows; fp32 dot product
# without TF32), appends the recent keys, rewrites the shadow and moves the base counter to n (one launch).
# Scores are kept in base 2: q_τ and q are scaled by scale · log2(e) and the gate by log2(e).
#
# The step's counters live on the device: POS = [n, base] (int32, ``DeferredWorkspace.pos``), read by the three
# step kernels, never passed as Python scalars, and the launch grids do not depend on them (the split-K grid is
# sized from max_len; each split covers ⌈base / n_split⌉ keys rounded up to a key block, so splits past the live
# keys are empty and leave the empty partial m = −inf, l = 0). Every launch of a step is therefore the same at
# every step, which is what lets one CUDA graph replay them (``PathDecodeCache(cuda_graph=True)``).

_LOG2E = 1.4426950408889634


@triton.jit
def _deferred_prep_kernel(
    Q, KIN, VIN, WIN, BETA, GIN, VC, GC, MT, RK, QT, MP, LP, AP, POS,
    sq_b, sk_b, sv_b, sw_b, sbeta_b, sg_b,
    max_len, scale_log2, n_slots,
    HKV: tl.constexpr, GROUP: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, CH: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr, HAS_GATE: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)  # b * HKV + kv head
    b = bh // HKV
    hk = bh % HKV
    n = tl.load(POS)  # the token's position
    base = tl.load(POS + 1)  # base keys 0 … base−1
    r = n - base  # pending (recent) keys before this token
    dcol = tl.arange(0, D)
    vcol = tl.arange(0, DV)
    w = tl.load(WIN + b * sw_b + hk * D + dcol).to(tl.float32)
    w = w / tl.maximum(tl.sqrt(tl.sum(w * w, 0)), 1e-12)  # the raw direction, normalised as F.normalize does
    beta = tl.load(BETA + b * sbeta_b + hk).to(tl.float32)

    grow = tl.arange(0, GROUP)
    head = bh * GROUP + grow  # b * H + query head
    q = tl.load(Q + b * sq_b + (hk * GROUP + grow)[:, None] * D + dcol[None, :]).to(tl.float32)  # [GROUP, D]

    # M ← M H_n = M − β (M w) wᵀ and q_τ = M q, row block by row block (both act on the rows of M independently)
    for c in tl.static_range(0, D, CH):
        rows = c + tl.arange(0, CH)
        mp = MT + bh * D * D + rows[:, None] * D + dcol[None, :]
        mc = tl.load(mp)
        mc = mc - (beta * tl.sum(mc * w[None, :], 1))[:, None] * w[None, :]
        tl.store(mp, mc)
        qt = tl.sum(q[:, None, :] * mc[None, :, :], 2) * scale_log2  # [GROUP, CH]
        tl.store(QT + head[:, None] * D + rows[None, :], qt)

    # recent keys (positions base … n−1 in rows 0 … r−1) carried by H_n, k_n appended as row r
    j = tl.arange(0, RP)
    old = j < r
    live = j <= r
    rp = RK + (bh * R + j[:, None]) * D + dcol[None, :]
    rk = tl.load(rp, mask=old[:, None], other=0.0)
    rk = rk - (beta * tl.sum(rk * w[None, :], 1))[:, None] * w[None, :]
    k_new = tl.load(KIN + b * sk_b + hk * D + dcol).to(tl.float32)
    rk = tl.where((j == r)[:, None], k_new[None, :], rk)
    tl.store(rp, rk, mask=live[:, None] & (j < R)[:, None])

    # the value cache holds v_n from now on; the recent part reads it back rounded to the cache dtype
    v_new = tl.load(VIN + b * sv_b + hk * DV + vcol).to(VC.dtype.element_ty)
    tl.store(VC + (bh * max_len + n) * DV + vcol, v_new)
    vr = tl.load(VC + (bh * max_len + base + j[:, None]) * DV + vcol[None, :], mask=old[:, None], other=0.0)
    vr = tl.where((j == r)[:, None], v_new.to(tl.float32)[None, :], vr.to(tl.float32))  # [RP, DV]

    s = tl.sum(q[:, None, :] * rk[None, :, :], 2) * scale_log2  # [GROUP, RP]
    if HAS_GATE:
        g_prev = tl.load(GC + head * max_len + tl.maximum(n - 1, 0))
        g_prev = tl.where(n > 0, g_prev, 0.0)
        g_t = g_prev + tl.load(GIN + b * sg_b + hk * GROUP + grow).to(tl.float64)  # [GROUP] fp64
        tl.store(GC + head * max_len + n, g_t)  # G_n, read by the attend kernel
        g_j = tl.load(GC + head[:, None] * max_len + base + j[None, :], mask=old[None, :], other=0.0)
        g_j = tl.where((j == r)[None, :], g_t[:, None], g_j)
        s += ((g_t[:, None] - g_j) * 1.4426950408889634).to(tl.float32)
    s = tl.where(live[None, :], s, float("-inf"))
    m = tl.max(s, 1)
    p = tl.math.exp2(s - m[:, None])
    slot = (bh * n_slots) * GROUP + grow  # slot 0 of this (batch, kv head)
    tl.store(MP + slot, m)
    tl.store(LP + slot, tl.sum(p, 1))
    tl.store(AP + slot[:, None] * DV + vcol[None, :], tl.sum(p[:, :, None] * vr[None, :, :], 1))


@triton.jit
def _split_keys(POS, BLOCK: tl.constexpr):
    """This program's (batch · kv head, position n, first and end key) of the base keys 0 … base−1, cut into
    ``tl.num_programs(1)`` splits of whole key blocks; end ≤ first for the splits past the live keys."""
    bh = tl.program_id(0).to(tl.int64)
    n = tl.load(POS)
    base = tl.load(POS + 1)
    per_split = tl.cdiv(tl.cdiv(base, tl.num_programs(1)), BLOCK) * BLOCK
    start = tl.program_id(1) * per_split
    return bh, n, start, tl.minimum(start + per_split, base)


@triton.jit
def _deferred_attend_dot_kernel(
    KS, VC, GC, QT, MP, LP, AP, POS,
    max_len, n_slots,
    GROUP: tl.constexpr, GP: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr,
    DV: tl.constexpr, NATIVE_K: tl.constexpr, NATIVE_V: tl.constexpr,
):
    """Split-K attention over the base keys on tensor cores, one partial (max, sum, Σ p v) per split: the
    ``GROUP`` query rows padded to ``GP`` ≥ 16 (zero rows, never stored), scores ``S = q_τ Kᵀ`` and ``P V`` as
    ``tl.dot`` in 3-pass TF32 (fp32-level accuracy: the keys and values are exact in TF32, q_τ and P are split in
    two TF32 parts).

    ``NATIVE_K`` / ``NATIVE_V`` (fp16 or bf16 keys / values): the product takes the cache's own dtype instead, with
    q_τ (P) split in two parts of that dtype, hi + lo (q_τ = hi + lo to 2⁻²² relative in fp16, 2⁻¹⁶ in bf16),
    two products accumulated in fp32: no conversion of the key and value blocks on their way to the tensor cores."""
    bh, n, start, end = _split_keys(POS, BLOCK)
    dcol = tl.arange(0, D)
    vcol = tl.arange(0, DV)
    grow = tl.arange(0, GP)
    real = grow < GROUP
    head = bh * GROUP + grow
    qt = tl.load(QT + head[:, None] * D + dcol[None, :], mask=real[:, None], other=0.0)  # [GP, D] fp32
    if NATIVE_K:
        q_hi = qt.to(KS.dtype.element_ty)
        q_lo = (qt - q_hi.to(tl.float32)).to(KS.dtype.element_ty)
    if HAS_GATE:
        g_t = tl.load(GC + head * max_len + n, mask=real, other=0.0)
    m_i, l_i, acc = _softmax_start(GP, DV)
    for off in range(start, end, BLOCK):
        j = off + tl.arange(0, BLOCK)
        valid = j < end
        kb = tl.load(KS + (bh * max_len + j[:, None]) * D + dcol[None, :], mask=valid[:, None], other=0.0)
        if NATIVE_K:
            s = tl.dot(q_hi, tl.trans(kb)) + tl.dot(q_lo, tl.trans(kb))  # [GP, BLOCK] fp32
        else:
            s = tl.dot(qt, tl.trans(kb.to(tl.float32)), input_precision="tf32x3")
        if HAS_GATE:
            g_j = tl.load(GC + head[:, None] * max_len + j[None, :], mask=real[:, None] & valid[None, :], other=0.0)
            s += ((g_t[:, None] - g_j) * 1.4426950408889634).to(tl.float32)
        s = tl.where(valid[None, :], s, float("-inf"))
        vb = tl.load(VC + (bh * max_len + j[:, None]) * DV + vcol[None, :], mask=valid[:, None], other=0.0)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if NATIVE_V:
            p_hi = p.to(VC.dtype.element_ty)
            p_lo = (p - p_hi.to(tl.float32)).to(VC.dtype.element_ty)
            pv = tl.dot(p_hi, vb) + tl.dot(p_lo, vb)
        else:
            pv = tl.dot(p, vb.to(tl.float32), input_precision="tf32x3")
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    slot = (bh * n_slots + 1 + tl.program_id(1)) * GROUP + grow
    tl.store(MP + slot, m_i, mask=real)
    tl.store(LP + slot, l_i, mask=real)
    tl.store(AP + slot[:, None] * DV + vcol[None, :], acc, mask=real[:, None])


@triton.jit
def _deferred_merge_kernel(
    MP, LP, AP, O, POS, n_slots,
    GROUP: tl.constexpr, DV: tl.constexpr, SC: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    grow = tl.arange(0, GROUP)
    vcol = tl.arange(0, DV)
    m_i, l_i, acc = _softmax_start(GROUP, DV)
    # every slot, empty splits included (m = −inf, l = 0: weight 0); slot 0 (the recent part, with the token
    # itself) is always finite, so the running max is finite after the first tile
    for s0 in range(0, n_slots, SC):
        s = s0 + tl.arange(0, SC)
        used = s < n_slots
        slot = (bh * n_slots + s[:, None]) * GROUP + grow[None, :]  # [SC, GROUP]
        m = tl.load(MP + slot, mask=used[:, None], other=float("-inf"))
        m_new = tl.maximum(m_i, tl.max(m, 0))
        alpha = tl.math.exp2(m_i - m_new)
        wgt = tl.math.exp2(m - m_new[None, :])
        l_i = l_i * alpha + tl.sum(tl.load(LP + slot, mask=used[:, None], other=0.0) * wgt, 0)
        a = tl.load(AP + slot[:, :, None] * DV + vcol[None, None, :], mask=used[:, None, None], other=0.0)
        acc = acc * alpha[:, None] + tl.sum(a * wgt[:, :, None], 0)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(O + (bh * GROUP + grow)[:, None] * DV + vcol[None, :], o.to(O.dtype.element_ty))
    if tl.program_id(0) == 0:  # the step is done: n → n + 1 (the last launch of the step; this kernel reads no counter)
        tl.store(POS, tl.load(POS) + 1)


@triton.jit(do_not_specialize=["n", "base"])
def _fold_kernel(
    K, KS, MT, RK, POS, n, base, max_len,
    R: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, HAS_SHADOW: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    dcol = tl.arange(0, D)
    old = j < base
    recent = (j >= base) & (j < n)
    kp = K + (bh * max_len + j[:, None]) * D + dcol[None, :]
    kb = tl.load(kp, mask=old[:, None], other=0.0)
    mt = tl.load(MT + bh * D * D + dcol[:, None] * D + dcol[None, :])
    kn = tl.dot(kb, mt, input_precision="ieee")  # rows K ← K M, full fp32
    rk = tl.load(RK + (bh * R + (j - base)[:, None]) * D + dcol[None, :], mask=recent[:, None], other=0.0)
    kn = tl.where(recent[:, None], rk, kn)
    live = (j < n)[:, None]
    tl.store(kp, kn, mask=live)
    if HAS_SHADOW:
        tl.store(KS + (bh * max_len + j[:, None]) * D + dcol[None, :], kn.to(KS.dtype.element_ty), mask=live)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):  # base → n (the fold reads its counters as arguments)
        tl.store(POS + 1, n)


def _pow2(x):
    return 1 << max(0, int(x) - 1).bit_length()


def _pow2_floor(x):
    return 1 << (int(x).bit_length() - 1)


def attend_config(head_dim, device, config: KernelConfig = DEFAULT):
    """(key block, num_warps, num_stages, programs, products) of the split-K attention over the base keys; products
    (``dot``): 1 tensor cores in 3-pass TF32, 2 tensor cores in the caches' fp16/bf16 with the query and P split in
    two parts (:func:`attend`).

    Default: blocks of 64 keys (32 above head dim 64), 4 warps, 3 stages (the loads are pipelined), 16 programs per
    SM (over batch × kv heads × splits), products in the caches' own dtype (dot = 2), which reads the keys as fast
    as SDPA reads the same bytes. Under the interpreter, whose bf16 ``tl.dot`` is wrong: dot = 1 and 8 programs,
    enough to exercise the merge. ``config.decode_attend`` overrides a leading part of (block, warps, stages,
    programs per SM) and ``config.decode_native`` the products (``benchmarks/sweep_decode_attend.py`` measures
    the choices).
    """
    cuda = device.type == "cuda"
    block, warps, stages, per_sm = launch(config.decode_attend, (64 if head_dim <= 64 else 32, 4, 3, 16))
    dot = 2 if pick(config.decode_native, cuda) else 1
    if cuda:
        programs = per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        programs = 8
    return block, warps, stages, programs, dot


class DeferredWorkspace:
    """Per-cache scratch of the deferred step, its launch constants (fixed per cache, so computed once) and the
    step's counters on the device.

    q_τ ``[B·Hkv, group, D]`` and the partials (max, sum, Σ p v) per slot: slot 0 is the recent part, slots 1 …
    ``max_split`` the splits of the base keys (the split-K grid always has ``max_split`` programs per batch and kv
    head, sized from max_len). ``pos`` = [n, base] int32: the position of the next token and the number of base
    keys, read by the step kernels; the merge kernel advances n, the fold kernel sets base, and the cache writes
    both on prefill and reset (:meth:`set_pos`).
    """

    def __init__(self, batch, n_kv_heads, group, head_dim, value_dim, max_len, defer, device,
                 config: KernelConfig | None = None):
        device = torch.device(device)
        bh = batch * n_kv_heads
        launch_config = attend_config(head_dim, device, config or DEFAULT)
        self.block, self.attend_warps, self.attend_stages, programs, self.attend_dot = launch_config
        self.max_split = max(1, min(triton.cdiv(max_len, self.block), triton.cdiv(programs, bh)))
        self.n_slots = 1 + self.max_split
        self.rp = _pow2(max(defer, 2))  # rows of the recent-key tile
        self.ch = _pow2_floor(max(1, min(head_dim, 8192 // (group * head_dim))))  # rows of M per chunk
        self.prep_warps = 8 if group * self.rp * head_dim > 8192 else 4
        self.sc = min(_pow2(self.n_slots), _pow2_floor(max(1, 4096 // (group * value_dim))))  # slots per merge tile
        self.qt = torch.empty(bh, group, head_dim, dtype=torch.float32, device=device)
        self.m = torch.empty(bh, self.n_slots, group, dtype=torch.float32, device=device)
        self.l = torch.empty_like(self.m)
        self.acc = torch.empty(bh, self.n_slots, group, value_dim, dtype=torch.float32, device=device)
        self.pos = torch.zeros(2, dtype=torch.int32, device=device)

    def set_pos(self, n, base):
        """Write the device counters (prefill, reset): one small host-to-device copy."""
        self.pos.copy_(torch.tensor([n, base], dtype=torch.int32))

    def live_splits(self, base):
        """How many of the ``max_split`` splits hold base keys (0 … base−1): the others are empty. For tests."""
        if base == 0:
            return 0
        per_split = triton.cdiv(triton.cdiv(base, self.max_split), self.block) * self.block
        return triton.cdiv(base, per_split)


def _rows(t):
    """A one-token input ``[B, 1, heads(, dim)]`` whose heads are packed (unit stride inside a head); returns it
    (copied only when it is not) and its batch stride. No view is made: the token axis has size 1."""
    st = t.stride()
    if st[-1] != 1 or (t.dim() == 4 and st[-2] != t.shape[-1]):
        t = t.contiguous()
        st = t.stride()
    return t, st[0]


def deferred_step_triton(ws, k_attend, v_cache, G, M, rk, q, k, v, w, beta, g, scale):
    """One deferred decode step for the token at position n = ``ws.pos[0]``: three launches (prep, split-K attend,
    merge), none of which takes a per-step Python value, so a CUDA graph of them serves every step.

    ws: :class:`DeferredWorkspace` (its ``pos`` = [n, base] is read, and n advanced by one); k_attend
    ``[B, Hkv, L, D]``: the keys scored for positions < base (the shadow, or the fp32 master); v_cache
    ``[B, Hkv, L, Dv]``; G ``[B, H, L]`` fp64 or None; M ``[B, Hkv, D, D]`` fp32 (H_{τ+1} ⋯ H_{n−1}, I when nothing
    is pending); rk ``[B, Hkv, R, D]`` fp32 (rows 0 … n−base−1 pending). q, k, v, w, beta, g: the token's inputs
    ``[B, 1, …]`` as :meth:`pathlab.decoding.PathDecodeCache.step` takes them (w raw). Updates M, rk,
    v_cache[:, :, n] and G[:, :, n] in place. Returns o ``[B, 1, H, Dv]`` in q's dtype.
    """
    B, Hkv, L, D = k_attend.shape
    H, DV = q.shape[2], v_cache.shape[-1]
    group = H // Hkv
    has_gate = g is not None
    (qr, sq), (kr, sk), (vr, sv), (wr, sw), (br, sb) = (_rows(t) for t in (q, k, v, w, beta))
    gr, sg = _rows(g) if has_gate else (qr, 0)
    gc = G if has_gate else v_cache
    _deferred_prep_kernel[(B * Hkv,)](
        qr, kr, vr, wr, br, gr, v_cache, gc, M, rk, ws.qt, ws.m, ws.l, ws.acc, ws.pos,
        sq, sk, sv, sw, sb, sg,
        L, scale * _LOG2E, ws.n_slots,
        HKV=Hkv, GROUP=group, R=rk.shape[2], RP=ws.rp, CH=ws.ch, D=D, DV=DV, HAS_GATE=has_gate,
        num_warps=ws.prep_warps,
    )
    attend(k_attend, v_cache, gc, ws.qt, ws.m, ws.l, ws.acc, ws.pos, L, ws.n_slots, B * Hkv, ws.max_split,
           group=group, has_gate=has_gate, block=ws.block, warps=ws.attend_warps, stages=ws.attend_stages,
           dot=ws.attend_dot)
    o = torch.empty(B, 1, H, DV, dtype=q.dtype, device=q.device)
    _deferred_merge_kernel[(B * Hkv,)](
        ws.m, ws.l, ws.acc, o, ws.pos, ws.n_slots,
        GROUP=group, DV=DV, SC=ws.sc,
    )
    return o


def attend(keys, values, gc, qt, m, l, acc, pos, max_len, n_slots, bh, splits, *, group, has_gate, block, warps,
           stages, dot):
    """Launch the split-K attention over the base keys: ``splits`` programs per (batch, kv head), each writing the
    partial (max, sum, Σ p v) of its slot (``_deferred_attend_dot_kernel``). ``dot``: 1 tensor cores in 3-pass
    TF32, 2 tensor cores in the caches' own fp16/bf16 where they have it."""
    D, DV = keys.shape[-1], values.shape[-1]
    common = dict(HAS_GATE=has_gate, BLOCK=block, D=D, DV=DV, num_warps=warps, num_stages=stages)
    args = (keys, values, gc, qt, m, l, acc, pos, max_len, n_slots)
    if dot not in (1, 2):
        raise ValueError(f"dot must be 1 (3-pass TF32) or 2 (the caches' 16-bit dtype), got {dot!r}")
    half = (torch.float16, torch.bfloat16)
    _deferred_attend_dot_kernel[(bh, splits)](*args, GROUP=group, GP=max(16, _pow2(group)),
                                              NATIVE_K=dot == 2 and keys.dtype in half,
                                              NATIVE_V=dot == 2 and values.dtype in half, **common)


def fold_triton(ws, k_master, k_shadow, M, rk, n, base):
    """Carry the base keys 0 … base−1 by M (rows K ← K M, fp32 without TF32), move the pending keys (rows of rk,
    already carried to the current step) to positions base … n−1, rewrite the shadow of 0 … n−1 and set the device
    base counter ``ws.pos[1]`` to n. One launch; n and base are the host's (the fold runs outside a step graph)."""
    B, Hkv, L, D = k_master.shape
    block = 64 if D <= 64 else 32
    has_shadow = k_shadow is not None
    _fold_kernel[(B * Hkv, triton.cdiv(n, block))](
        k_master, k_shadow if has_shadow else k_master, M, rk, ws.pos, n, base, L,
        R=rk.shape[2], D=D, BLOCK=block, HAS_SHADOW=has_shadow,
    )
