"""The PaTH scan's backward by query chunk: persistent programs, one work item per (query chunk c, query head).

Let q⁽ᵐ⁾ be the carried query state while visiting key chunk m, q⁽ᵐ⁻¹⁾ = q⁽ᵐ⁾ P_m with P_m = I − M_m, and
λ⁽ᵐ⁾ = ∂L/∂q⁽ᵐ⁾ restricted to the keys of chunks ≤ m. With dS = P ∘ (dP − δ):

    λ⁽ᵐ⁾ = λ⁽ᵐ⁻¹⁾ − λ⁽ᵐ⁻¹⁾ M_mᵀ + scale · dS_m k̃_m        (ascending m, λ⁽⁻¹⁾ = 0; dq̃ = λ⁽ᶜ⁻¹⁾)
    dM_m −= q⁽ᵐ⁾ᵀ λ⁽ᵐ⁻¹⁾,   dk̃_m += scale · dS_mᵀ q⁽ᵐ⁾,   dV_m += P_mᵀ dO

Eight matrix products per (query chunk, key chunk) pair. The states q⁽ᵐ⁾ are produced right to left but λ runs
left to right, and P_m is singular when some β = 1, so they cannot be recovered by inverting P_m: each item first
replays the forward carry into a scratch row owned by its program (``programs × max_chunks × BT × D``, O(T·D)
whatever B and H), or reads the states the forward kept (``FWD_STATES``), then runs the λ scan left to right.
Key-side sums from different query chunks and grouped query heads meet in relaxed fp32 atomics (dk̃, dV, dM, dG):
they are read only after the kernel ends, so they need no ordering.

δ_i = dO_i · o_i is the diagonal of dO oᵀ taken by the product that forms dP = dO Vᵀ (same operand dtypes, tile
shape and precision; ``_row_dots``), in the scan (``DELTA_HERE``) or in a pass before it (``_delta_kernel``).
Where a row's softmax saturates (o_i = v_j* bit for bit), dP_ij* − δ_i is a difference of two sums of the same
products; summed in an order of its own, δ would leave ε·|dP| in dS, which dw and dβ multiply by |q|·|k|.

The gate's ∂L/∂G_i = Σ_j dS_ij − Σ_k dS_ki sums dS by row and by column; the row sums are zero in exact arithmetic
but cancel the rounding of o to the input dtype in δ, so they stay.

The items come longest first (``ORDER``), dealt round by round in a snake (program p takes the p-th item of even
rounds and the p-th from the end of odd ones), so that the rounds' imbalances cancel in pairs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .scan_forward import _chunk_tokens, _key_gate, _load_rows, _state_base, _v_chunk_base

@triton.jit
def _row_dots(do, o, rows, PREC: tl.constexpr):
    """δ_i = dO_i · o_i (fp32, ``[len(rows)]``) as the diagonal of the product dO oᵀ, the product that forms
    dP = dO Vᵀ (same operands' dtype, shape and precision), not as a sum of its own (module docstring, "δ")."""
    prod = tl.dot(do, tl.trans(o), input_precision=PREC)
    return tl.sum(tl.where(rows[:, None] == rows[None, :], prod, 0.0), 1)  # one term per row: exact


@triton.jit
def _delta_kernel(DO, O, DELTA, TOK, NTOK, so_t, so_h, sdl_t, sdl_h, BT: tl.constexpr, DV: tl.constexpr,
                  PREC: tl.constexpr, GATHER: tl.constexpr):
    """δ_i = dO_i · o_i (fp32) of one (chunk n, head h): the backward's row term, in one pass over dO and o before
    the scan (when the scan does not form it itself; ``scan.delta_pass``). The tile is the scan's own (its rows
    addressed as the scan addresses them, ``_chunk_tokens``, each at its position in the chunk) and ``PREC`` the
    scan's precision, so that δ comes from the product that forms dP (:func:`_row_dots`): a product's sum for a row
    may depend on the row's position in the tile (BLAS under the interpreter blocks rows by position), so a tile
    of other rows would not give dP's sums bit for bit."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, BT)
    vcol = tl.arange(0, DV)
    tok, valid = _chunk_tokens(TOK, n, rows, BT, NTOK, GATHER)
    do = _load_rows(DO + h * so_h, tok, valid, so_t, vcol, GATHER)
    o = _load_rows(O + h * so_h, tok, valid, so_t, vcol, GATHER)
    delta = _row_dots(do, o, rows, PREC)
    if GATHER:
        tl.store(DELTA + tok * sdl_t + h * sdl_h, delta, mask=valid)
    else:
        tl.store(DELTA + tok * sdl_t + h * sdl_h, delta)


@triton.jit
def _accumulate(ptr, val):
    """ptr += val from many programs at once; "relaxed": the sums are read only after the kernel ends."""
    tl.atomic_add(ptr, val, sem="relaxed")


@triton.jit
def _bwd_pair(ql, lam, dg_row, do, lse, delta, gq, go_c, KS, V, M, GL, GO, TOK, DVV, DKS, DM, DG, h, hk, NC, first,
              m, rows, tile_d, tile_v, tile_dv, tile_dd, sv_h, scale, scale_log2, HAS_GATE: tl.constexpr,
              BT: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, PREC: tl.constexpr, PREC32: tl.constexpr,
              LAMBDA_BF16: tl.constexpr, SV_T: tl.constexpr,
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
    if HAS_GATE:  # loaded here, not a pair ahead as in the forward: here every register is taken
        s += gq[:, None] - _key_gate(GL, GO, h, NC, kn, go_c, rows, BT)[None, :]
    p = tl.math.exp2(s - lse[:, None])
    vt = tl.load(V + _v_chunk_base(TOK, hk, kn, sv_h, NC, BT, DV, SV_T, V_ROWS, V_GATHER) + tile_v)
    dp = tl.dot(do, tl.trans(vt), input_precision=PREC)
    ds = p * (dp - delta[:, None])  # ∂L/∂logit
    _accumulate(DVV + _v_chunk_base(TOK, hk, kn, 0, NC, BT, DV, DV, False, False) + tile_dv,
                tl.dot(tl.trans(p.to(gradp)), do, input_precision=PREC))
    dsg = ds.to(gradp)
    _accumulate(DKS + krow * D + tile_d,
                tl.dot(tl.trans(dsg), ql.to(gradp), input_precision=PREC) * scale)
    if HAS_GATE:
        dg_row += tl.sum(ds, 1)
        _accumulate(DG + (h * NC + kn) * BT + rows, -tl.sum(ds, 0))
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
        _accumulate(DM + mrow * D + tile_dd, dm)
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
    DELTA_HERE: tl.constexpr = True, GATHER: tl.constexpr = False, SV_T: tl.constexpr = 0,
    V_ROWS: tl.constexpr = False, V_GATHER: tl.constexpr = False, FWD_STATES: tl.constexpr = False,
):
    """LAMBDA_BF16: λ's two products on bf16 operands instead of tf32 (``scan.lambda_bf16``). PREFETCH: the λ scan
    loads the next carried state one pair ahead, hiding its latency (``scan.prefetch``). DELTA_HERE: δ_i from
    ``O``, else read from ``DELTA`` (``scan.delta_pass``). Rows of O, dO and δ as in the forward, (token r, query
    head h) at r·s_t + h·s_h; rows of V as in the forward (``V_ROWS``, ``V_GATHER``, strides (SV_T, sv_h)); its
    gradient DVV is summed in the chunk layout. FWD_STATES: the carried states are read from the forward's
    ``STATES`` instead of replayed into ``SCRATCH``."""
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
        rnd = item // nprog  # dealt in a snake (module docstring): odd rounds from the end
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
                                    scale_log2, HAS_GATE, BT, D, DV, PREC, PREC32, LAMBDA_BF16,
                                    SV_T, V_ROWS, V_GATHER, False)
        for m in range(1, c):
            if PREFETCH:
                ql = ql_next
                ql_next = tl.load(qstates + tl.minimum(m + 1, c - 1) * BT * D + tile_d)
            else:
                ql = tl.load(qstates + m * BT * D + tile_d)
            lam, dg_row = _bwd_pair(ql, lam, dg_row, do, lse, delta, gq, go_c, KS, V, M, GL, GO, TOK, DVV, DKS, DM,
                                    DG, h, hk, NC, first, m, rows, tile_d, tile_v, tile_dv, tile_dd, sv_h, scale,
                                    scale_log2, HAS_GATE, BT, D, DV, PREC, PREC32, LAMBDA_BF16,
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
        _accumulate(DVV + _v_chunk_base(TOK, hk, n, 0, NC, BT, DV, DV, False, False) + tile_dv,
                    dv_diag)
        tl.store(DQS + qrow * D + tile_d, lam)
        if HAS_GATE:
            dg_row += tl.sum(ds, 1)
            _accumulate(DG + qrow + rows, dg_row - tl.sum(ds, 0))
        if not FWD_STATES:
            tl.debug_barrier()  # this item's scratch reads finish before the next item overwrites it
