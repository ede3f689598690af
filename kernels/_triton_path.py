"""Triton kernels of the PaTH scan: forward (right-to-left with an online softmax) and backward.

Inputs are in the chunk layout of ``_layout`` (``[heads, NC, BT, ·]``, contiguous) and come from the UT
transform of ``_ut``: per chunk n the carried queries q̃ (fp32), the carried keys k̃, the chunk's transition
P_n = H_last ⋯ H_first = I − M_n as M_n = Wᵀ U (``[heads, NC, D, D]``) and the intra-chunk logits S_d.

Forward, one program per (query chunk c, query head):
    o, l, m from the diagonal block (S_d, causal), then for key chunks m = c−1 … 0:
        S = q k̃_mᵀ · scale + (G_i − G_j);  online softmax;  o += P V_m
        q ← q − q M_m                        (carry the queries across chunk m; q stays fp32)
    and the log-sum-exp (base 2) is stored for the backward.

Backward, persistent programs, one work item per (query chunk c, query head). Let q⁽ᵐ⁾ be the carried query
state while visiting key chunk m, q⁽ᵐ⁻¹⁾ = q⁽ᵐ⁾ P_m with P_m = I − M_m, and λ⁽ᵐ⁾ = ∂L/∂q⁽ᵐ⁾ restricted to the
keys of chunks ≤ m. Then, with dS = P ∘ (dP − δ):
    λ⁽ᵐ⁾ = λ⁽ᵐ⁻¹⁾ − λ⁽ᵐ⁻¹⁾ M_mᵀ + scale · dS_m k̃_m        (ascending m, λ⁽⁻¹⁾ = 0; dq̃ = λ⁽ᶜ⁻¹⁾)
    dM_m −= q⁽ᵐ⁾ᵀ λ⁽ᵐ⁻¹⁾                                      (one D×D product; dW, dU follow from M = Wᵀ U)
    dk̃_m += scale · dS_mᵀ q⁽ᵐ⁾,   dV_m += P_mᵀ dO
Eight matrix products per (query chunk, key chunk) pair: the replayed carry, S, dP, dV, dk̃, dM, and λ's two
updates (with the factors W and U it was twelve: the carry and λ's update took two each, dW and dU four).
The states q⁽ᵐ⁾ are produced right to left but λ runs left to right, and P_m is singular when some β = 1, so
the states cannot be recovered by inverting P_m. Each item therefore first replays the forward carry (right to
left) and writes q⁽ᶜ⁻¹⁾ … q⁽⁰⁾ into a scratch row owned by its *program*, then runs the λ scan left to right
reading them back. The scratch is ``programs × max_chunks × BT × D`` (fp16 for fp16/bf16 inputs): with a
fixed number of persistent programs (a few per SM) the extra memory is O(T·D), independent of B and H, and it
is reused by every item the program handles. Key-side sums from different query chunks and from grouped query
heads meet in fp32 atomics (dk̃, dV, dM, dG).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _path_fwd_kernel(
    QS, KS, V, M, SD, GL, GO, O, LSE, CHUNK_FIRST, CHUNK_INDEX,
    NC, scale_log2,
    GROUP: tl.constexpr, HAS_GATE: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    PREC: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    hk = h // GROUP
    c = tl.load(CHUNK_INDEX + n)
    first = tl.load(CHUNK_FIRST + n).to(tl.int64)
    rows = tl.arange(0, BT)
    dcol = tl.arange(0, D)
    vcol = tl.arange(0, DV)
    tile_dd = dcol[:, None] * D + dcol[None, :]
    lowp = KS.dtype.element_ty

    q = tl.load(QS + ((h * NC + n) * BT + rows[:, None]) * D + dcol[None, :])  # fp32 [BT, D]
    s = tl.load(SD + ((h * NC + n) * BT + rows[:, None]) * BT + rows[None, :]) * scale_log2
    if HAS_GATE:
        gq = tl.load(GL + (h * NC + n) * BT + rows) * 1.4426950408889634
        go_c = tl.load(GO + h * NC + n)  # fp64
        s += gq[:, None] - gq[None, :]
    s = tl.where(rows[:, None] >= rows[None, :], s, float("-inf"))
    m_i = tl.max(s, 1)
    p = tl.math.exp2(s - m_i[:, None])
    l_i = tl.sum(p, 1)
    v = tl.load(V + ((hk * NC + n) * BT + rows[:, None]) * DV + vcol[None, :])
    acc = tl.dot(p.to(v.dtype), v, input_precision=PREC)

    for mm in range(0, c):
        m = c - 1 - mm
        kn = first + m
        ql = q.to(lowp)
        kt = tl.load(KS + ((hk * NC + kn) * BT + rows[:, None]) * D + dcol[None, :])
        s = tl.dot(ql, tl.trans(kt), input_precision=PREC) * scale_log2
        if HAS_GATE:
            gk = tl.load(GL + (h * NC + kn) * BT + rows) * 1.4426950408889634
            shift = ((go_c - tl.load(GO + h * NC + kn)) * 1.4426950408889634).to(tl.float32)
            s += gq[:, None] - gk[None, :] + shift
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + ((hk * NC + kn) * BT + rows[:, None]) * DV + vcol[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
        if m > 0:  # move the queries across chunk m: q ← q − q M_m
            trans_m = tl.load(M + (hk * NC + kn) * D * D + tile_dd)
            q = q - tl.dot(ql, trans_m, input_precision=PREC)

    o = acc / l_i[:, None]
    tl.store(O + ((h * NC + n) * BT + rows[:, None]) * DV + vcol[None, :], o.to(O.dtype.element_ty))
    tl.store(LSE + (h * NC + n) * BT + rows, m_i + tl.math.log2(l_i))


@triton.jit
def _accumulate(NO_ATOMICS: tl.constexpr, ACQ_REL: tl.constexpr, ptr, val):
    """ptr += val from many programs at once. The sums are read only after the kernel ends, so the atomics need
    no ordering: "relaxed" lets them retire without the memory fences of Triton's default "acq_rel"
    (``ACQ_REL`` keeps the default, for the side-by-side measurement)."""
    if NO_ATOMICS:
        tl.store(ptr, val)
    elif ACQ_REL:
        tl.atomic_add(ptr, val)
    else:
        tl.atomic_add(ptr, val, sem="relaxed")


@triton.jit
def _bwd_key_side(ql, kt, do, lse, delta, gq, go_c, h, hk, kn, GL, GO, V, DVV, DKS, DG, NC, scale, scale_log2,
                  rows, tile_d, tile_v, HAS_GATE: tl.constexpr, BT: tl.constexpr, D: tl.constexpr,
                  DV: tl.constexpr, PREC: tl.constexpr, NO_ATOMICS: tl.constexpr, ACQ_REL: tl.constexpr):
    """One chunk pair, query state q⁽ᵐ⁾ = ``ql`` and keys k̃_m = ``kt``: dS = P ∘ (dP − δ) with P = exp2(S − lse)
    and dP = dO V_mᵀ, and its key-side sums dV_m += Pᵀ dO, dk̃_m += scale · dSᵀ q⁽ᵐ⁾, dG_m −= Σ_i dS_i· (gate).
    Returns dS in dO's dtype and its row sums Σ_j dS_ij (the query side of dG)."""
    gradp = do.dtype
    s = tl.dot(ql, tl.trans(kt), input_precision=PREC) * scale_log2
    if HAS_GATE:
        gk = tl.load(GL + (h * NC + kn) * BT + rows) * 1.4426950408889634
        shift = ((go_c - tl.load(GO + h * NC + kn)) * 1.4426950408889634).to(tl.float32)
        s += gq[:, None] - gk[None, :] + shift
    p = tl.math.exp2(s - lse[:, None])
    vm = tl.load(V + (hk * NC + kn) * BT * DV + tile_v)
    dp = tl.dot(do, tl.trans(vm), input_precision=PREC)
    ds = p * (dp - delta[:, None])  # ∂L/∂logit
    _accumulate(NO_ATOMICS, ACQ_REL, DVV + (hk * NC + kn) * BT * DV + tile_v,
                tl.dot(tl.trans(p.to(gradp)), do, input_precision=PREC))
    dsg = ds.to(gradp)
    _accumulate(NO_ATOMICS, ACQ_REL, DKS + (hk * NC + kn) * BT * D + tile_d,
                tl.dot(tl.trans(dsg), ql.to(gradp), input_precision=PREC) * scale)
    ds_rows = tl.zeros([BT], dtype=tl.float32)
    if HAS_GATE:
        ds_rows = tl.sum(ds, 1)
        _accumulate(NO_ATOMICS, ACQ_REL, DG + (h * NC + kn) * BT + rows, -tl.sum(ds, 0))
    return dsg, ds_rows


@triton.jit
def _path_bwd_kernel(
    QS, KS, V, M, SD, GL, GO, DO, LSE, DELTA,
    DQS, DKS, DVV, DM, DSD, DG, SCRATCH,
    CHUNK_FIRST, CHUNK_INDEX, ORDER,
    NC, NH, n_items, max_chunks, scale, scale_log2,
    GROUP: tl.constexpr, HAS_GATE: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    PREC: tl.constexpr, PREC32: tl.constexpr, LAMBDA_BF16: tl.constexpr = False, NO_ATOMICS: tl.constexpr = False,
    ACQ_REL: tl.constexpr = False,
):
    # LAMBDA_BF16: λ's two products on bf16 operands instead of tf32 (see path._lambda_precision); NO_ATOMICS
    # (profiling only, wrong gradients): plain stores instead of the key-side atomics; ACQ_REL (measurement
    # only): Triton's default acq_rel atomics instead of relaxed ones
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    rows = tl.arange(0, BT)
    dcol = tl.arange(0, D)
    vcol = tl.arange(0, DV)
    lowp = KS.dtype.element_ty  # q-states, k̃ and M inside the scan
    gradp = DO.dtype.element_ty  # dS, dO, P in the gradient products (input dtype: keeps bf16's range)
    tile_d = rows[:, None] * D + dcol[None, :]
    tile_v = rows[:, None] * DV + vcol[None, :]
    tile_dd = dcol[:, None] * D + dcol[None, :]
    scratch = SCRATCH + pid.to(tl.int64) * max_chunks * BT * D

    for item in range(pid, n_items, nprog):
        n = tl.load(ORDER + item // NH).to(tl.int64)
        h = (item % NH).to(tl.int64)
        hk = h // GROUP
        c = tl.load(CHUNK_INDEX + n)
        first = tl.load(CHUNK_FIRST + n).to(tl.int64)
        do = tl.load(DO + (h * NC + n) * BT * DV + tile_v)
        lse = tl.load(LSE + (h * NC + n) * BT + rows)
        delta = tl.load(DELTA + (h * NC + n) * BT + rows)
        dg_row = tl.zeros([BT], dtype=tl.float32)
        if HAS_GATE:
            gq = tl.load(GL + (h * NC + n) * BT + rows) * 1.4426950408889634
            go_c = tl.load(GO + h * NC + n)
        else:
            gq = dg_row
            go_c = 0.0
        lam = tl.zeros([BT, D], dtype=tl.float32)
        q = tl.load(QS + (h * NC + n) * BT * D + tile_d)

        # 1. replay the forward carry right to left; keep q⁽ᵐ⁾ (as used in the forward's dots) in scratch
        for mm in range(0, c):
            m = c - 1 - mm
            kn = first + m
            ql = q.to(lowp)
            tl.store(scratch + m * BT * D + tile_d, ql)
            if m > 0:
                trans_m = tl.load(M + (hk * NC + kn) * D * D + tile_dd)
                q = q - tl.dot(ql, trans_m, input_precision=PREC)
        tl.debug_barrier()  # scratch writes visible to the whole program

        # 2. left to right: λ, and the key-side gradients
        for m in range(0, c):
            kn = first + m
            ql = tl.load(scratch + m * BT * D + tile_d)
            kt = tl.load(KS + (hk * NC + kn) * BT * D + tile_d)
            dsg, ds_rows = _bwd_key_side(ql, kt, do, lse, delta, gq, go_c, h, hk, kn, GL, GO, V, DVV, DKS, DG,
                                         NC, scale, scale_log2, rows, tile_d, tile_v, HAS_GATE, BT, D, DV,
                                         PREC, NO_ATOMICS, ACQ_REL)
            dg_row += ds_rows
            if m > 0:  # transition P_m = I − M_m sits between q⁽ᵐ⁾ and q⁽ᵐ⁻¹⁾; λ holds λ⁽ᵐ⁻¹⁾ here
                mt = tl.load(M + (hk * NC + kn) * D * D + tile_dd)
                if LAMBDA_BF16:  # λ's two products on bf16 operands (fp32 range, 8-bit mantissa)
                    lam_l = lam.to(tl.bfloat16)
                    _accumulate(NO_ATOMICS, ACQ_REL, DM + (hk * NC + kn) * D * D + tile_dd,
                                -tl.dot(tl.trans(ql.to(tl.bfloat16)), lam_l))
                    lam = lam - tl.dot(lam_l, tl.trans(mt.to(tl.bfloat16)))  # λ Pᵀ = λ − λ Mᵀ
                else:
                    _accumulate(NO_ATOMICS, ACQ_REL, DM + (hk * NC + kn) * D * D + tile_dd,
                                -tl.dot(tl.trans(ql.to(tl.float32)), lam, input_precision=PREC32))
                    lam = lam - tl.dot(lam, tl.trans(mt.to(tl.float32)), input_precision=PREC32)
            lam += tl.dot(dsg, kt.to(gradp), input_precision=PREC) * scale

        # 3. the diagonal block (intra-chunk logits S_d)
        s = tl.load(SD + ((h * NC + n) * BT + rows[:, None]) * BT + rows[None, :]) * scale_log2
        if HAS_GATE:
            s += gq[:, None] - gq[None, :]
        causal = rows[:, None] >= rows[None, :]
        p = tl.where(causal, tl.math.exp2(s - lse[:, None]), 0.0)
        vc = tl.load(V + (hk * NC + n) * BT * DV + tile_v)
        dp = tl.dot(do, tl.trans(vc), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        tl.store(DSD + ((h * NC + n) * BT + rows[:, None]) * BT + rows[None, :], ds * scale)
        _accumulate(NO_ATOMICS, ACQ_REL, DVV + (hk * NC + n) * BT * DV + tile_v,
                      tl.dot(tl.trans(p.to(gradp)), do, input_precision=PREC))
        tl.store(DQS + (h * NC + n) * BT * D + tile_d, lam)
        if HAS_GATE:
            dg_row += tl.sum(ds, 1)
            _accumulate(NO_ATOMICS, ACQ_REL, DG + (h * NC + n) * BT + rows, dg_row - tl.sum(ds, 0))
        tl.debug_barrier()  # this item's scratch reads finish before the next item overwrites it


# ---------------------------------------------------------------------------------------------------------
# The backward with tensor descriptors (TMA on Hopper): tiles are loaded by descriptor and the key-side sums
# are TMA reductions, so no [BT, D] tile of addresses or offsets lives in registers.


@triton.jit
def _reduce_tile(INTERPRETED: tl.constexpr, desc, row, val):
    """desc[row : row + block, :] += val from many programs at once (a TMA reduction). The interpreter has no
    descriptor reductions, but it runs one program at a time, so a load, add and store is the same sum there."""
    if INTERPRETED:
        desc.store([row, 0], desc.load([row, 0]) + val)
    else:
        desc.atomic_add([row, 0], val)


@triton.jit
def _path_bwd_kernel_tma(
    QS, KS, V, M, SD, GL, GO, DO, LSE, DELTA,
    DQS, DKS, DVV, DM, DSD, DG, SCRATCH,
    CHUNK_FIRST, CHUNK_INDEX, ORDER,
    NC, NH, n_items, max_chunks, scale, scale_log2,
    GROUP: tl.constexpr, HAS_GATE: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    PREC: tl.constexpr, PREC32: tl.constexpr, LAMBDA_BF16: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """``_path_bwd_kernel`` with 2-D tensor descriptors: QS, DQS ``[H·NC·BT, D]``, KS, DKS ``[Hkv·NC·BT, D]``,
    V, DVV ``[Hkv·NC·BT, DV]``, M, DM ``[Hkv·NC·D, D]``, DO ``[H·NC·BT, DV]``, SD, DSD ``[H·NC·BT, BT]``
    (row coordinates are 32-bit: fewer than 2³¹ rows). SCRATCH stays a pointer: the replay's writes and the
    λ scan's reads of it are ordinary stores and loads, ordered by a barrier."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    rows = tl.arange(0, BT)
    dcol = tl.arange(0, D)
    lowp = SCRATCH.dtype.element_ty
    gradp = DO.dtype
    tile_d = rows[:, None] * D + dcol[None, :]
    scratch = SCRATCH + pid.to(tl.int64) * max_chunks * BT * D

    for item in range(pid, n_items, nprog):
        n = tl.load(ORDER + item // NH).to(tl.int64)
        h = (item % NH).to(tl.int64)
        hk = h // GROUP
        c = tl.load(CHUNK_INDEX + n)
        first = tl.load(CHUNK_FIRST + n).to(tl.int64)
        qrow = ((h * NC + n) * BT).to(tl.int32)
        do = DO.load([qrow, 0])
        lse = tl.load(LSE + (h * NC + n) * BT + rows)
        delta = tl.load(DELTA + (h * NC + n) * BT + rows)
        dg_row = tl.zeros([BT], dtype=tl.float32)
        if HAS_GATE:
            gq = tl.load(GL + (h * NC + n) * BT + rows) * 1.4426950408889634
            go_c = tl.load(GO + h * NC + n)
        else:
            gq = dg_row
            go_c = 0.0
        lam = tl.zeros([BT, D], dtype=tl.float32)
        q = QS.load([qrow, 0])

        # 1. replay the forward carry right to left; keep q⁽ᵐ⁾ (as used in the forward's dots) in scratch
        for mm in range(0, c):
            m = c - 1 - mm
            kn = first + m
            ql = q.to(lowp)
            tl.store(scratch + m * BT * D + tile_d, ql)
            # (at m = 0 the carried state is not needed; computing it anyway keeps the loop free of branches,
            # so that the loads of M can be pipelined)
            q = q - tl.dot(ql, M.load([((hk * NC + kn) * D).to(tl.int32), 0]), input_precision=PREC)
        tl.debug_barrier()  # scratch writes visible to the whole program

        # 2. left to right: λ, and the key-side gradients. The next state is loaded one pair ahead.
        ql_next = tl.load(scratch + tile_d)
        for m in range(0, c):
            kn = first + m
            krow = ((hk * NC + kn) * BT).to(tl.int32)
            ql = ql_next
            ql_next = tl.load(scratch + tl.minimum(m + 1, c - 1) * BT * D + tile_d)
            kt = KS.load([krow, 0])
            s = tl.dot(ql, tl.trans(kt), input_precision=PREC) * scale_log2
            if HAS_GATE:
                gk = tl.load(GL + (h * NC + kn) * BT + rows) * 1.4426950408889634
                shift = ((go_c - tl.load(GO + h * NC + kn)) * 1.4426950408889634).to(tl.float32)
                s += gq[:, None] - gk[None, :] + shift
            p = tl.math.exp2(s - lse[:, None])
            dp = tl.dot(do, tl.trans(V.load([krow, 0])), input_precision=PREC)
            ds = p * (dp - delta[:, None])  # ∂L/∂logit
            _reduce_tile(INTERPRETED, DVV, krow, tl.dot(tl.trans(p.to(gradp)), do, input_precision=PREC))
            dsg = ds.to(gradp)
            _reduce_tile(INTERPRETED, DKS, krow, tl.dot(tl.trans(dsg), ql.to(gradp), input_precision=PREC) * scale)
            if HAS_GATE:
                dg_row += tl.sum(ds, 1)
                tl.atomic_add(DG + (h * NC + kn) * BT + rows, -tl.sum(ds, 0), sem="relaxed")
            # transition P_m = I − M_m sits between q⁽ᵐ⁾ and q⁽ᵐ⁻¹⁾; λ holds λ⁽ᵐ⁻¹⁾ here (zero at m = 0, where
            # both products vanish: no branch, as above)
            mrow = ((hk * NC + kn) * D).to(tl.int32)
            mt = M.load([mrow, 0])
            if LAMBDA_BF16:  # λ's two products on bf16 operands (fp32 range, 8-bit mantissa)
                lam_l = lam.to(tl.bfloat16)
                _reduce_tile(INTERPRETED, DM, mrow, -tl.dot(tl.trans(ql.to(tl.bfloat16)), lam_l))
                lam = lam - tl.dot(lam_l, tl.trans(mt.to(tl.bfloat16)))  # λ Pᵀ = λ − λ Mᵀ
            else:
                _reduce_tile(INTERPRETED, DM, mrow, -tl.dot(tl.trans(ql.to(tl.float32)), lam, input_precision=PREC32))
                lam = lam - tl.dot(lam, tl.trans(mt.to(tl.float32)), input_precision=PREC32)
            lam += tl.dot(dsg, kt.to(gradp), input_precision=PREC) * scale

        # 3. the diagonal block (intra-chunk logits S_d)
        s = SD.load([qrow, 0]) * scale_log2
        if HAS_GATE:
            s += gq[:, None] - gq[None, :]
        causal = rows[:, None] >= rows[None, :]
        p = tl.where(causal, tl.math.exp2(s - lse[:, None]), 0.0)
        crow = ((hk * NC + n) * BT).to(tl.int32)
        dp = tl.dot(do, tl.trans(V.load([crow, 0])), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        DSD.store([qrow, 0], ds * scale)
        _reduce_tile(INTERPRETED, DVV, crow, tl.dot(tl.trans(p.to(gradp)), do, input_precision=PREC))
        DQS.store([qrow, 0], lam)
        if HAS_GATE:
            dg_row += tl.sum(ds, 1)
            tl.atomic_add(DG + (h * NC + n) * BT + rows, dg_row - tl.sum(ds, 0), sem="relaxed")
        tl.debug_barrier()  # this item's scratch reads finish before the next item overwrites it
