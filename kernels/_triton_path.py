"""Triton kernels of the PaTH scan: forward (right-to-left with an online softmax) and backward.

The UT factors are in the chunk layout of ``_layout`` (``[heads, NC, BT, ·]``, contiguous) and come from the
UT transform (``_ut``, ``_triton_ut``): per chunk n the carried queries q̃ (fp32), the carried keys k̃, the
chunk's transition P_n = H_last ⋯ H_first = I − M_n as M_n = Wᵀ U (``[heads, NC, D, D]``) and the intra-chunk
logits S_d.

Rows of o and dO (and δ) are written and read where they are: o and dO are touched once per work item, so
no chunk copy of them is made. Row i of chunk n holds token r = ``TOK[n·BT + i]`` (``GATHER``; padding holds
r = NTOK and is masked: dO and o read as zero there, o is not written), or r = n·BT + i (no padding, no index to
read); (token r, head h) sits at r·s_t + h·s_h. So the same kernels serve ``[B, T, heads, ·]`` tensors whose
(b, t) rows are evenly spaced (s_b = T·s_t), with r = b·T + t (``_layout.slot_tokens``), and contiguous
chunk-layout tensors (s_t = row length, s_h = NC·BT·row length).

Rows of v. v is read once per chunk *pair*, addressed by row as well, with its own strides (s_t, s_h): in v's
layout ``[B, T, Hkv, Dv]`` (``V_ROWS``; its rows through ``TOK`` where the layout has padding, ``V_GATHER``) or
in a chunk copy made by the op (``path.v_in_token_rows`` chooses). Key chunks m < c are whole chunks (only a
sequence's last chunk has padding), so their rows are one sequence's consecutive tokens, found from the first,
and need no mask. dV is summed in the chunk layout (fp32) and copied back to v's layout by the op: summed in
v's layout, by atomics on rows a token row apart, the backward kernel took 0.08 ms longer at T = 512, 12×64,
than the copy it saves (``benchmarks/results/kernels-h200-dv-rows-*.json``).

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

δ. dS = P ∘ (dP − δ) with δ_i = dO_i · o_i, and where a row's softmax is saturated (one key j* holds the whole
weight, the others 0 or below fp32's ε, as with large |q|·|k|) o_i = v_j* bit for bit and the true dS_ij* is ~0:
dP_ij* − δ_i is then a difference of two sums of the same products, whose rounding must agree. δ summed in an
order of its own (tl.sum of dO ∘ o) left ε·|dP| there, which dq multiplies by |k̃|, dk̃ by |q| and dw, dβ (through
S_d and the UT backward) by |q|·|k|: at ×200 norms dβ came out at the size of the unsaturated gradients
(``tests/test_kernels.py``, large norms). So δ is the diagonal of dO oᵀ taken by the product that forms
dP = dO Vᵀ (same operand dtypes, tile shape [BT, Dv] × [Dv, BT] and precision; ``_row_dots``): in the scan
(``DELTA_HERE``) or in the pass before it (``_delta_kernel``, BT rows at a time). The product has BT² · Dv
multiply-adds per work item against the eight products of every pair. PyTorch's δ (``path._delta_mode``
"torch") keeps the old rounding.

The carried states. For short sequences the forward can keep what the replay would produce: each pair's q⁽ᵐ⁾
as its dots used it (``KEEP_STATES``), c of them for query chunk c, in a ``[H, rows, BT, D]`` buffer that the
op saves for the backward, which then reads them (``FWD_STATES``) and skips the replay, its c − 1 dependent
products and its scratch. Chunk c of a sequence whose chunk 0 is chunk ``first`` keeps its states at rows
base(first) + c(c−1)/2 + m, base(f) = ⌈f·(max_chunks − 1)/2⌉ (``_layout.state_base``: sequences never share a
row). The buffer grows as T²: ``path.forward_states`` decides.

The gate (PaTH-FoX). G_i = offset_c + G_local_i for row i of chunk c (``_layout.chunk_gate``: offsets in fp64,
local sums in fp32), so a pair's gate term is G_i − G_j = G_local_i − (G_local_j − (offset_c − offset_m)); the
key-side part is formed once per key column (``_key_gate``). The forward loads it one pair ahead of its use
(``GATE_AHEAD``: on an H200 the forward took 1–4% less time at 12×64 and 9% less at 16×128); done in the
backward too, where every register is taken, forward+backward took 2–7% longer
(``benchmarks/results/kernels-h200-gate-ahead.json``, ``kernels-h200-delta-pass.json``). Leaving the
query's own G_local_i out of the logits (softmax does not see a constant per row) would save an addition per
element, but where a chunk's local gate sums are large the logits then lose their low bits (a gate of −10⁴
cost 1e-4 of relative error in o). The backward's ∂L/∂G_i = Σ_j dS_ij − Σ_k dS_ki sums dS by row and by
column. In exact arithmetic the row sums are zero (Σ_j P_ij (dP_ij − δ_i) = dO_i · o_i − δ_i), but δ comes
from o rounded to the input dtype and the row sums cancel that rounding: without them dG's bf16 error against
fp64 went from 2.9e-3 to 2.0e-2 (same file).

The items come longest first (``ORDER``), dealt out round by round in a snake: program p takes the p-th item of
even rounds and the p-th from the end of odd ones (of a last, partial round, among the programs it reaches).
Dealt in one direction every round, the first program would take the longest item of each round: with 512 items
for 132 programs (one kv head at T = 16384, B = 2) its pairs would be 26% above the mean, with 8192 (all 16
heads) 2%; in a snake, the rounds' differences cancel in pairs (1.5% and 0.0%;
``benchmarks/schedule_balance.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _chunk_tokens(TOK, n, rows, BT: tl.constexpr, NTOK, GATHER: tl.constexpr):
    """The rows r of chunk n (``[BT]``, int64) and which of them hold a token: ``TOK[n·BT + i]`` with
    ``r < NTOK`` (padding holds NTOK) when ``GATHER``, else n·BT + i, all valid."""
    if GATHER:
        tok = tl.load(TOK + n * BT + rows)
        return tok, tok < NTOK
    else:
        return n * BT + rows, rows < BT


@triton.jit
def _whole_chunk_start(TOK, kn, BT: tl.constexpr, GATHER: tl.constexpr):
    """The first row r of chunk kn when it is a whole chunk, as key chunks m < c are (only a sequence's last
    chunk has padding): its rows are r … r + BT − 1, one sequence's consecutive tokens (``TOK[kn·BT]`` when
    ``GATHER``, else kn·BT)."""
    if GATHER:
        return tl.load(TOK + kn * BT).to(tl.int64)
    else:
        return kn * BT


@triton.jit
def _v_chunk_base(TOK, hk, kn, s_h, NC, BT: tl.constexpr, DV: tl.constexpr, S_T: tl.constexpr,
                  V_ROWS: tl.constexpr, V_GATHER: tl.constexpr):
    """Offset of row 0 of whole chunk kn of kv head hk in V or dV (module docstring, "Rows of v"): in v's layout
    (``V_ROWS``) hk·s_h + r·S_T with r its first row (:func:`_whole_chunk_start`), in the chunk layout
    (hk·NC + kn)·BT·DV; the chunk's rows follow S_T apart (S_T = DV in the chunk layout)."""
    if V_ROWS:
        return hk * s_h + _whole_chunk_start(TOK, kn, BT, V_GATHER) * S_T
    else:
        return (hk * NC + kn) * BT * DV


@triton.jit
def _load_rows(X, tok, valid, s_t, col, MASKED: tl.constexpr):
    """The tile ``X[tok·s_t + col]`` (``[BT, len(col)]``), zeros in rows that are not ``valid`` if ``MASKED``."""
    ptr = X + tok[:, None] * s_t + col[None, :]
    if MASKED:
        return tl.load(ptr, mask=valid[:, None], other=0.0)
    else:
        return tl.load(ptr)


@triton.jit
def _store_rows(X, tok, valid, s_t, col, val, MASKED: tl.constexpr):
    """``X[tok·s_t + col] = val``, skipping rows that are not ``valid`` if ``MASKED``."""
    ptr = X + tok[:, None] * s_t + col[None, :]
    if MASKED:
        tl.store(ptr, val, mask=valid[:, None])
    else:
        tl.store(ptr, val)


@triton.jit
def _state_base(first, c, max_chunks):
    """First row of chunk c's carried states in its head's ``[rows, BT, D]`` (``_layout.state_base``: a sequence
    starting at chunk ``first`` begins at ⌈first·(max_chunks − 1)/2⌉, chunk c at c(c−1)/2 after that)."""
    return (first * (max_chunks - 1) + 1) // 2 + c * (c - 1) // 2


@triton.jit
def _key_gate(GL, GO, h, NC, kn, go_c, rows, BT: tl.constexpr):
    """The keys' side of the gate term of query chunk c with key chunk kn (module docstring, "The gate"), base 2:
    (G_j − offset_c) · log₂e = (G_local_j − (offset_c − offset_kn)) · log₂e, ``[BT]`` fp32, the offsets'
    difference taken in fp64 (``go_c`` = offset_c)."""
    shift = (go_c - tl.load(GO + h * NC + kn)).to(tl.float32)
    return (tl.load(GL + (h * NC + kn) * BT + rows) - shift) * 1.4426950408889634


@triton.jit
def _path_fwd_kernel(
    QS, KS, V, M, SD, GL, GO, O, LSE, CHUNK_FIRST, CHUNK_INDEX, TOK, STATES,
    NC, NTOK, so_t, so_h, sv_h, scale_log2, n_state_rows, max_chunks,
    GROUP: tl.constexpr, HAS_GATE: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    PREC: tl.constexpr, GATHER: tl.constexpr, SV_T: tl.constexpr, V_ROWS: tl.constexpr = False,
    V_GATHER: tl.constexpr = False, GATE_AHEAD: tl.constexpr = True, KEEP_STATES: tl.constexpr = False,
):
    """O is written by row (module docstring, "Rows of o and dO"): (token r, query head h) at r·so_t + h·so_h;
    V is read in v's layout if ``V_ROWS``, (token r, kv head) at r·SV_T + hk·sv_h, its rows through ``TOK`` if
    ``V_GATHER``, else in the chunk layout (module docstring, "Rows of v"). GATE_AHEAD: each pair's gate loaded
    one pair ahead (module docstring, "The gate"). KEEP_STATES: each carried state q⁽ᵐ⁾ as the pair's dots use
    it is stored into ``STATES`` (``[H, n_state_rows, BT, D]``, module docstring, "The carried states")."""
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
        key_gate = _key_gate(GL, GO, h, NC, first + tl.maximum(c - 1, 0), go_c, rows, BT)
    s = tl.where(rows[:, None] >= rows[None, :], s, float("-inf"))
    m_i = tl.max(s, 1)
    p = tl.math.exp2(s - m_i[:, None])
    l_i = tl.sum(p, 1)
    if V_GATHER:  # the query chunk may be a sequence's last, with padding
        vtok, vvalid = _chunk_tokens(TOK, n, rows, BT, NTOK, True)
        v = _load_rows(V + hk * sv_h, vtok, vvalid, SV_T, vcol, True)
    else:
        v = tl.load(V + _v_chunk_base(TOK, hk, n, sv_h, NC, BT, DV, SV_T, V_ROWS, False)
                    + rows[:, None] * SV_T + vcol[None, :])
    acc = tl.dot(p.to(v.dtype), v, input_precision=PREC)
    if KEEP_STATES:
        states = STATES + (h * n_state_rows + _state_base(first, c, max_chunks)) * BT * D

    for mm in range(0, c):
        m = c - 1 - mm
        kn = first + m
        ql = q.to(lowp)
        if KEEP_STATES:
            tl.store(states + m * BT * D + rows[:, None] * D + dcol[None, :], ql)
        kt = tl.load(KS + ((hk * NC + kn) * BT + rows[:, None]) * D + dcol[None, :])
        s = tl.dot(ql, tl.trans(kt), input_precision=PREC) * scale_log2
        if HAS_GATE:
            if not GATE_AHEAD:
                key_gate = _key_gate(GL, GO, h, NC, kn, go_c, rows, BT)
            s += gq[:, None] - key_gate[None, :]
            if GATE_AHEAD:  # the next pair's (the loads' latency hides behind this pair's dots)
                key_gate = _key_gate(GL, GO, h, NC, first + tl.maximum(m - 1, 0), go_c, rows, BT)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + _v_chunk_base(TOK, hk, kn, sv_h, NC, BT, DV, SV_T, V_ROWS, V_GATHER)
                    + rows[:, None] * SV_T + vcol[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
        # move the queries across chunk m: q ← q − q M_m (not needed after m = 0; done anyway, so that the loop
        # has no branch and its loads of M can be pipelined)
        q = q - tl.dot(ql, tl.load(M + (hk * NC + kn) * D * D + tile_dd), input_precision=PREC)

    o = acc / l_i[:, None]
    tok, valid = _chunk_tokens(TOK, n, rows, BT, NTOK, GATHER)
    _store_rows(O + h * so_h, tok, valid, so_t, vcol, o.to(O.dtype.element_ty), GATHER)
    tl.store(LSE + (h * NC + n) * BT + rows, m_i + tl.math.log2(l_i))


@triton.jit
def _row_dots(do, o, rows, PREC: tl.constexpr):
    """δ_i = dO_i · o_i (fp32, ``[len(rows)]``) as the diagonal of the product dO oᵀ, the product that forms
    dP = dO Vᵀ (same operands' dtype, shape and precision), not as a sum of its own (module docstring, "δ")."""
    prod = tl.dot(do, tl.trans(o), input_precision=PREC)
    return tl.sum(tl.where(rows[:, None] == rows[None, :], prod, 0.0), 1)  # one term per row: exact


@triton.jit
def _delta_kernel(DO, O, DELTA, n_rows, DV: tl.constexpr, ROWS: tl.constexpr, PREC: tl.constexpr):
    """δ_r = dO_r · o_r (fp32) for ``ROWS`` rows of contiguous ``[n_rows, DV]`` dO and o (in their dtype): the
    backward's row term, in one pass over both before the scan (when the scan does not form it itself;
    ``path._delta_mode``). ``ROWS`` = the scan's BT and ``PREC`` its precision, so that δ comes from the product
    that forms dP (:func:`_row_dots`)."""
    rows = tl.arange(0, ROWS)
    r = tl.program_id(0).to(tl.int64) * ROWS + rows
    col = tl.arange(0, DV)
    valid = r < n_rows
    do = tl.load(DO + r[:, None] * DV + col[None, :], mask=valid[:, None], other=0.0)
    o = tl.load(O + r[:, None] * DV + col[None, :], mask=valid[:, None], other=0.0)
    tl.store(DELTA + r, _row_dots(do, o, rows, PREC), mask=valid)


@triton.jit
def _accumulate(NO_ATOMICS: tl.constexpr, ACQ_REL: tl.constexpr, ptr, val):
    """ptr += val from many programs at once. The sums are read only after the kernel ends, so the atomics need
    no ordering: "relaxed" lets them retire without the memory fences of Triton's default "acq_rel"
    (``ACQ_REL`` keeps the default, for the side-by-side measurement; ``NO_ATOMICS``, for profiling only,
    stores instead: wrong sums)."""
    if NO_ATOMICS:
        tl.store(ptr, val)
    elif ACQ_REL:
        tl.atomic_add(ptr, val)
    else:
        tl.atomic_add(ptr, val, sem="relaxed")


@triton.jit
def _bwd_pair(ql, lam, dg_row, do, lse, delta, gq, go_c, KS, V, M, GL, GO, TOK, DVV, DKS, DM, DG, h, hk, NC, first,
              m, rows, tile_d, tile_v, tile_dv, tile_dd, sv_h, scale, scale_log2, HAS_GATE: tl.constexpr,
              BT: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, PREC: tl.constexpr, PREC32: tl.constexpr,
              LAMBDA_BF16: tl.constexpr, NO_ATOMICS: tl.constexpr, ACQ_REL: tl.constexpr, SV_T: tl.constexpr,
              V_ROWS: tl.constexpr, V_GATHER: tl.constexpr, CARRIED: tl.constexpr):
    """One pair of the backward's λ scan (module docstring): key chunk m (whole, sequence chunk ``first + m``)
    for the carried queries ``ql`` = q⁽ᵐ⁾ (scan dtype). Adds the pair's dV, dk̃, dM (and dG) to the key side and
    returns λ⁽ᵐ⁾ from ``lam`` = λ⁽ᵐ⁻¹⁾, and the query rows' dG so far. ``CARRIED`` is False at m = 0, where
    λ⁽⁻¹⁾ = 0 (``lam`` holds zeros): λ's two products and dM, all zero there, are left out."""
    kn = first + m
    krow = (hk * NC + kn) * BT
    gradp = do.dtype  # dS, dO, P in the gradient products (input dtype: keeps bf16's range)
    kt = tl.load(KS + krow * D + tile_d)
    s = tl.dot(ql, tl.trans(kt), input_precision=PREC) * scale_log2
    if HAS_GATE:  # loaded here, not a pair ahead as in the forward (module docstring, "The gate")
        s += gq[:, None] - _key_gate(GL, GO, h, NC, kn, go_c, rows, BT)[None, :]
    p = tl.math.exp2(s - lse[:, None])
    vt = tl.load(V + _v_chunk_base(TOK, hk, kn, sv_h, NC, BT, DV, SV_T, V_ROWS, V_GATHER) + tile_v)
    dp = tl.dot(do, tl.trans(vt), input_precision=PREC)
    ds = p * (dp - delta[:, None])  # ∂L/∂logit
    _accumulate(NO_ATOMICS, ACQ_REL, DVV + _v_chunk_base(TOK, hk, kn, 0, NC, BT, DV, DV, False, False) + tile_dv,
                tl.dot(tl.trans(p.to(gradp)), do, input_precision=PREC))
    dsg = ds.to(gradp)
    _accumulate(NO_ATOMICS, ACQ_REL, DKS + krow * D + tile_d,
                tl.dot(tl.trans(dsg), ql.to(gradp), input_precision=PREC) * scale)
    if HAS_GATE:
        dg_row += tl.sum(ds, 1)
        _accumulate(NO_ATOMICS, ACQ_REL, DG + (h * NC + kn) * BT + rows, -tl.sum(ds, 0))
    if CARRIED:  # P_m = I − M_m sits between q⁽ᵐ⁾ and q⁽ᵐ⁻¹⁾
        mrow = (hk * NC + kn) * D
        mt = tl.load(M + mrow * D + tile_dd)
        if LAMBDA_BF16:  # λ's two products on bf16 operands (fp32 range, 8-bit mantissa)
            lam_l = lam.to(tl.bfloat16)
            dm = -tl.dot(tl.trans(ql.to(tl.bfloat16)), lam_l)
            lam = lam - tl.dot(lam_l, tl.trans(mt.to(tl.bfloat16)))  # λ Pᵀ = λ − λ Mᵀ
        else:
            dm = -tl.dot(tl.trans(ql.to(tl.float32)), lam, input_precision=PREC32)
            lam = lam - tl.dot(lam, tl.trans(mt.to(tl.float32)), input_precision=PREC32)
        _accumulate(NO_ATOMICS, ACQ_REL, DM + mrow * D + tile_dd, dm)
    lam += tl.dot(dsg, kt.to(gradp), input_precision=PREC) * scale
    return lam, dg_row


@triton.jit
def _path_bwd_kernel(
    QS, KS, V, M, SD, GL, GO, DO, O, LSE, DELTA,
    DQS, DKS, DVV, DM, DSD, DG, SCRATCH, STATES,
    CHUNK_FIRST, CHUNK_INDEX, ORDER, TOK,
    NC, NH, n_items, max_chunks, NTOK, so_t, so_h, sdl_t, sdl_h, sv_h, scale, scale_log2, n_state_rows,
    GROUP: tl.constexpr, HAS_GATE: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    PREC: tl.constexpr, PREC32: tl.constexpr, LAMBDA_BF16: tl.constexpr = False, PREFETCH: tl.constexpr = True,
    NO_ATOMICS: tl.constexpr = False, ACQ_REL: tl.constexpr = False, SNAKE: tl.constexpr = True,
    DELTA_HERE: tl.constexpr = True, GATHER: tl.constexpr = False, SV_T: tl.constexpr = 0,
    V_ROWS: tl.constexpr = False, V_GATHER: tl.constexpr = False, FWD_STATES: tl.constexpr = False,
):
    """LAMBDA_BF16: λ's two products on bf16 operands instead of tf32 (see path._lambda_precision). PREFETCH: the
    λ scan loads the next carried state from scratch one pair ahead, so that its latency is hidden. NO_ATOMICS
    (profiling only, wrong gradients) and ACQ_REL (measurement only): see :func:`_accumulate`. SNAKE: the items
    dealt in a snake (module docstring), else in one direction every round. DELTA_HERE: δ_i = dO_i · o_i from
    ``O``, else read from ``DELTA`` (see path._delta_mode). Rows of O, dO (O's strides) and δ as in the
    forward (module docstring): (token r, query head h) at r·s_t + h·s_h. Rows of V as in the forward
    (``V_ROWS``, ``V_GATHER``, strides (SV_T, sv_h)); its gradient DVV is summed in the chunk layout.
    FWD_STATES: the carried states are read from the forward's ``STATES`` (module docstring, "The carried
    states") instead of replayed into ``SCRATCH``."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    rows = tl.arange(0, BT)
    dcol = tl.arange(0, D)
    vcol = tl.arange(0, DV)
    lowp = SCRATCH.dtype.element_ty  # q-states, k̃ and M inside the scan
    gradp = DO.dtype.element_ty  # dS, dO, P in the gradient products (input dtype: keeps bf16's range)
    tile_d = rows[:, None] * D + dcol[None, :]
    tile_v = rows[:, None] * SV_T + vcol[None, :]  # a whole key chunk's rows of V from its first
    tile_dv = rows[:, None] * DV + vcol[None, :]  # dV's rows in the chunk layout
    tile_s = rows[:, None] * BT + rows[None, :]
    tile_dd = dcol[:, None] * D + dcol[None, :]
    scratch = SCRATCH + pid.to(tl.int64) * max_chunks * BT * D

    full_rounds = n_items // nprog
    for item in range(pid, n_items, nprog):
        slot = item
        if SNAKE:  # (module docstring) odd rounds dealt from the end
            rnd = item // nprog
            width = tl.where(rnd < full_rounds, nprog, n_items - full_rounds * nprog)
            slot = tl.where(rnd % 2 == 1, rnd * nprog + width - 1 - pid, item)
        n = tl.load(ORDER + slot // NH).to(tl.int64)
        h = (slot % NH).to(tl.int64)
        hk = h // GROUP
        c = tl.load(CHUNK_INDEX + n)
        first = tl.load(CHUNK_FIRST + n).to(tl.int64)
        qrow = (h * NC + n) * BT
        tok, valid = _chunk_tokens(TOK, n, rows, BT, NTOK, GATHER)
        do = _load_rows(DO + h * so_h, tok, valid, so_t, vcol, GATHER)  # zero in padding rows: their dS is zero
        lse = tl.load(LSE + qrow + rows)
        if DELTA_HERE:  # δ_i = dO_i · o_i, here rather than in a pass of its own over dO and o
            o_rows = _load_rows(O + h * so_h, tok, valid, so_t, vcol, GATHER)
            delta = _row_dots(do, o_rows, rows, PREC)
        elif GATHER:
            delta = tl.load(DELTA + tok * sdl_t + h * sdl_h, mask=valid, other=0.0)
        else:
            delta = tl.load(DELTA + tok * sdl_t + h * sdl_h)
        dg_row = tl.zeros([BT], dtype=tl.float32)
        gq, go_c = 0.0, 0.0  # (without the gate: unused)
        if HAS_GATE:
            gq = tl.load(GL + qrow + rows) * 1.4426950408889634
            go_c = tl.load(GO + h * NC + n)
        lam = tl.zeros([BT, D], dtype=tl.float32)

        if FWD_STATES:  # the forward kept q⁽ᶜ⁻¹⁾ … q⁽⁰⁾
            qstates = STATES + (h * n_state_rows + _state_base(first, c, max_chunks)) * BT * D
        else:
            qstates = scratch
            # 1. replay the forward carry right to left; keep q⁽ᵐ⁾ (as used in the forward's dots) in scratch.
            # The loop carries across chunks c−1 … 1; q⁽⁰⁾ is stored after it (with c = 0 stored and never read).
            q = tl.load(QS + qrow * D + tile_d)
            for mm in range(0, c - 1):
                m = c - 1 - mm
                ql = q.to(lowp)
                tl.store(qstates + m * BT * D + tile_d, ql)
                q = q - tl.dot(ql, tl.load(M + (hk * NC + first + m) * D * D + tile_dd), input_precision=PREC)
            tl.store(qstates + tile_d, q.to(lowp))
            tl.debug_barrier()  # scratch writes visible to the whole program

        # 2. left to right: λ, and the key-side gradients. Key chunk 0 is a pair of its own, since λ⁽⁻¹⁾ = 0
        # there (no products with λ, no dM); the loop over chunks 1 … c−1 stays free of branches, so that its
        # loads can be pipelined.
        ql_next = tl.load(qstates + tile_d)
        if c > 0:
            ql = ql_next
            if PREFETCH:
                ql_next = tl.load(qstates + tl.minimum(1, c - 1) * BT * D + tile_d)
            lam, dg_row = _bwd_pair(ql, lam, dg_row, do, lse, delta, gq, go_c, KS, V, M, GL, GO, TOK, DVV, DKS, DM,
                                    DG, h, hk, NC, first, 0, rows, tile_d, tile_v, tile_dv, tile_dd, sv_h, scale,
                                    scale_log2, HAS_GATE, BT, D, DV, PREC, PREC32, LAMBDA_BF16, NO_ATOMICS, ACQ_REL,
                                    SV_T, V_ROWS, V_GATHER, False)
        for m in range(1, c):
            if PREFETCH:
                ql = ql_next
                ql_next = tl.load(qstates + tl.minimum(m + 1, c - 1) * BT * D + tile_d)
            else:
                ql = tl.load(qstates + m * BT * D + tile_d)
            lam, dg_row = _bwd_pair(ql, lam, dg_row, do, lse, delta, gq, go_c, KS, V, M, GL, GO, TOK, DVV, DKS, DM,
                                    DG, h, hk, NC, first, m, rows, tile_d, tile_v, tile_dv, tile_dd, sv_h, scale,
                                    scale_log2, HAS_GATE, BT, D, DV, PREC, PREC32, LAMBDA_BF16, NO_ATOMICS, ACQ_REL,
                                    SV_T, V_ROWS, V_GATHER, True)

        # 3. the diagonal block (intra-chunk logits S_d)
        s = tl.load(SD + qrow * BT + tile_s) * scale_log2
        if HAS_GATE:
            s += gq[:, None] - gq[None, :]
        causal = rows[:, None] >= rows[None, :]
        p = tl.math.exp2(tl.where(causal, s - lse[:, None], float("-inf")))  # masked first: no exp2 overflow
        if V_GATHER:  # the query chunk may be a sequence's last, with padding: masked rows in v's layout
            vtok, vvalid = _chunk_tokens(TOK, n, rows, BT, NTOK, True)
            vd = _load_rows(V + hk * sv_h, vtok, vvalid, SV_T, vcol, True)
        else:
            vd = tl.load(V + _v_chunk_base(TOK, hk, n, sv_h, NC, BT, DV, SV_T, V_ROWS, False) + tile_v)
        dp = tl.dot(do, tl.trans(vd), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        tl.store(DSD + qrow * BT + tile_s, ds * scale)
        dv_diag = tl.dot(tl.trans(p.to(gradp)), do, input_precision=PREC)
        _accumulate(NO_ATOMICS, ACQ_REL, DVV + _v_chunk_base(TOK, hk, n, 0, NC, BT, DV, DV, False, False) + tile_dv,
                    dv_diag)
        tl.store(DQS + qrow * D + tile_d, lam)
        if HAS_GATE:
            dg_row += tl.sum(ds, 1)
            _accumulate(NO_ATOMICS, ACQ_REL, DG + qrow + rows, dg_row - tl.sum(ds, 0))
        if not FWD_STATES:
            tl.debug_barrier()  # this item's scratch reads finish before the next item overwrites it
