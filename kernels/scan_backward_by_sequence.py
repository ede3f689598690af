"""The PaTH scan's backward by sequence: one program per (sequence, kv head), key chunks left to right.

When the forward kept its carried query states (``scan_forward``, "The carried states"), the backward needs no
replay, and its pairs can be visited by key chunk instead of by query chunk. One program takes a whole sequence
of one kv head, with the GROUP query heads that read it, and visits its key chunks m = 0, 1, …, n − 1. At key
chunk m it handles the diagonal block of chunk m (from S_d) and every pair of a later query chunk c > m with m,
R query chunks to a tile of R·BT rows:

    S = scale · q⁽ᵐ⁾_c k̃_mᵀ (+ G_i − G_j),   P = exp(S − lse),   dP = dO_c V_mᵀ,   dS = P ∘ (dP − δ)
    dV_m += Pᵀ dO_c,   dk̃_m += scale · dSᵀ q⁽ᵐ⁾_c
    dM_m −= q⁽ᵐ⁾_cᵀ λ_c,   λ_c ← λ_c − λ_c M_mᵀ + scale · dS k̃_m          (λ_c = 0 before m = 0)

λ_c (the λ⁽ᵐ⁾ of ``scan_backward_by_chunk``) lives in the rows of dq̃ between key chunks; once key chunk c − 1
has passed it is dq̃_c. Against the order by query chunk:

* the pairs of one key chunk do not depend on each other, so the chain of dependent products runs across key
  chunks, and Triton's pipeliner can load the next pair's state, dO and λ while the current pair computes;
* the key side's sums (dk̃, dV, dM) stay in registers across the key chunk's pairs: no atomics, no zero-filled
  buffers, and dV is written once, in v's dtype, where v's rows are;
* k̃_m, V_m and M_m are loaded once per key chunk, not once per pair.

Each program owns its sequence's rows of dq̃ and dS_d for its query heads and reads λ back one key chunk after it
wrote it (a barrier between key chunks). dG gets its sums by relaxed atomics (zero on entry); a pair's sums of dS
over its keys and over its queries are products of dS's 16-bit operand with a block of ones, on the tensor cores,
and the query rows' gate moves into the log-sum-exp. There are only (sequences × kv heads) programs, so this order
suits many short sequences (model training); ``scan.backward_by_sequence`` decides. δ comes from a pass before.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .scan_forward import _chunk_tokens, _load_rows, _state_base, _store_rows

# Columns of the block of ones that the gate's sums over dS take as a product operand: the narrowest tile the
# tensor cores take.
GATE_COLS: tl.constexpr = tl.constexpr(16)


@triton.jit
def _lambda_products(ql, lam, mt, PREC32: tl.constexpr, LAMBDA_BF16: tl.constexpr):
    """(−q⁽ᵐ⁾ᵀ λ, λ − λ Mᵀ): the pair's share of dM and λ carried across chunk m (``scan.lambda_bf16``:
    bf16 operands with ``LAMBDA_BF16``, else fp32 ones at ``PREC32``)."""
    if LAMBDA_BF16:
        lam_l = lam.to(tl.bfloat16)
        dm = -tl.dot(tl.trans(ql.to(tl.bfloat16)), lam_l)
        return dm, lam - tl.dot(lam_l, tl.trans(mt.to(tl.bfloat16)))
    else:
        dm = -tl.dot(tl.trans(ql.to(tl.float32)), lam, input_precision=PREC32)
        return dm, lam - tl.dot(lam, tl.trans(mt.to(tl.float32)), input_precision=PREC32)


@triton.jit
def _key_chunk(KS, V, M, SD, GL, GO, DO, LSE, DELTA, STATES, DQS, DKS, DVO, DM, DSD, DG, TOK,
               first, count, m, hk, NC, NTOK, so_t, so_h, sdl_t, sdl_h, sv_t, sv_h, sdv_t, sdv_h, scale,
               scale_log2, n_state_rows, max_chunks,
               GROUP: tl.constexpr, HAS_GATE: tl.constexpr, BT: tl.constexpr, D: tl.constexpr,
               DV: tl.constexpr, R: tl.constexpr, PREC: tl.constexpr, PREC32: tl.constexpr,
               LAMBDA_BF16: tl.constexpr, GATHER: tl.constexpr, V_GATHER: tl.constexpr, CARRIED: tl.constexpr):
    """Key chunk m of the sequence (module docstring): its diagonal blocks and its pairs with query chunks
    m + 1 … count − 1 for every query head of kv head hk; writes dk̃_m, dV_m, dM_m and updates the query
    chunks' λ (in dq̃) and dG. ``CARRIED`` is False at m = 0, where λ is still zero: no λ products, no dM."""
    rows = tl.arange(0, BT)
    dcol = tl.arange(0, D)
    vcol = tl.arange(0, DV)
    qr = tl.arange(0, R * BT)  # a query tile's rows: query chunk c0 + qr // BT, row qr % BT of it
    qi = qr % BT
    tile_d = rows[:, None] * D + dcol[None, :]
    tile_s = rows[:, None] * BT + rows[None, :]
    tile_dd = dcol[:, None] * D + dcol[None, :]
    causal = rows[:, None] >= rows[None, :]
    gradp = DO.dtype.element_ty  # dS, dO, P in the gradient products (the input dtype: keeps bf16's range)

    kn = first + m
    krow = (hk * NC + kn) * BT
    ktok, kvalid = _chunk_tokens(TOK, kn, rows, BT, NTOK, GATHER)  # key chunk m's rows of dO, o, δ and dV
    if V_GATHER:  # v in v's layout: the chunk's token rows (padding only in a sequence's last chunk)
        vt = _load_rows(V + hk * sv_h, ktok, kvalid, sv_t, vcol, True)
    else:
        vt = _load_rows(V + hk * sv_h, kn * BT + rows, kvalid, sv_t, vcol, False)
    kt = tl.load(KS + krow * D + tile_d)
    mt = tl.load(M + (hk * NC + kn) * D * D + tile_dd)
    dk = tl.zeros([BT, D], dtype=tl.float32)
    dv = tl.zeros([BT, DV], dtype=tl.float32)
    dm = tl.zeros([D, D], dtype=tl.float32)
    if HAS_GATE:  # the gate's sums over a pair's dS, as products with a block of ones (every column the same sums)
        ones_q = tl.full([R * BT, GATE_COLS], 1.0, gradp)
        ones_k = tl.full([BT, GATE_COLS], 1.0, gradp)
        first_col = tl.arange(0, GATE_COLS)[None, :] == 0
    for g in range(GROUP):
        h = hk * GROUP + g
        qrow = (h * NC + kn) * BT
        # the diagonal block: intra-chunk logits S_d
        do = _load_rows(DO + h * so_h, ktok, kvalid, so_t, vcol, GATHER)  # zero in padding rows: their dS is zero
        lse = tl.load(LSE + qrow + rows)
        delta = tl.load(DELTA + ktok * sdl_t + h * sdl_h, mask=kvalid, other=0.0)
        s = tl.load(SD + qrow * BT + tile_s) * scale_log2
        gk = 0.0
        go_k = 0.0
        if HAS_GATE:  # the query rows' G_local is inside LSE (the kernel's docstring)
            gk = tl.load(GL + qrow + rows) * 1.4426950408889634
            go_k = tl.load(GO + h * NC + kn)  # fp64
            s -= gk[None, :]
        p = tl.math.exp2(tl.where(causal, s - lse[:, None], float("-inf")))  # masked first: no exp2 overflow
        ds = p * (tl.dot(do, tl.trans(vt), input_precision=PREC) - delta[:, None])
        tl.store(DSD + qrow * BT + tile_s, ds * scale)
        dv += tl.dot(tl.trans(p.to(gradp)), do, input_precision=PREC)
        dg_key = 0.0
        if HAS_GATE:
            dg_key = tl.sum(ds, 1) - tl.sum(ds, 0)  # chunk m's own rows: as queries of the block and as its keys
            dg_cols = tl.zeros([BT, GATE_COLS], dtype=tl.float32)  # Σ over the later query rows of dS, by key
        # the later query chunks, R to a tile
        for c0 in range(m + 1, count, R):
            c = c0 + qr // BT
            inside = c < count
            qn = first + c
            qrows = (h * NC + qn) * BT + qi
            if GATHER:
                qtok = tl.load(TOK + qn * BT + qi, mask=inside, other=NTOK)
                qvalid = qtok < NTOK
            else:
                qtok, qvalid = qn * BT + qi, inside
            srow = (h * n_state_rows + _state_base(first, c, max_chunks) + m) * BT + qi
            ql = tl.load(STATES + srow[:, None] * D + dcol[None, :], mask=inside[:, None], other=0.0)
            do_q = tl.load(DO + h * so_h + qtok[:, None] * so_t + vcol[None, :], mask=qvalid[:, None], other=0.0)
            lse_q = tl.load(LSE + qrows, mask=inside, other=float("inf"))  # P = 0 in rows past the sequence
            delta_q = tl.load(DELTA + qtok * sdl_t + h * sdl_h, mask=qvalid, other=0.0)
            s_q = tl.dot(ql, tl.trans(kt), input_precision=PREC) * scale_log2
            if HAS_GATE:  # G_i − G_j = (G_local_i + offset_c − offset_m) − G_local_j, the offsets' difference in fp64
                # (G_local_i is in LSE)
                if R == 1:  # one offset for the tile: added to the key side's terms, a row of BT
                    shift = (tl.load(GO + h * NC + first + c0) - go_k).to(tl.float32)
                    s_q += (shift * 1.4426950408889634 - gk)[None, :]
                else:
                    shift = (tl.load(GO + h * NC + qn, mask=inside, other=0.0) - go_k).to(tl.float32)
                    s_q += (shift * 1.4426950408889634)[:, None] - gk[None, :]
            p_q = tl.math.exp2(s_q - lse_q[:, None])
            ds_q = p_q * (tl.dot(do_q, tl.trans(vt), input_precision=PREC) - delta_q[:, None])
            dv += tl.dot(tl.trans(p_q.to(gradp)), do_q, input_precision=PREC)
            dsg = ds_q.to(gradp)
            dk += tl.dot(tl.trans(dsg), ql.to(gradp), input_precision=PREC)
            step = tl.dot(dsg, kt.to(gradp), input_precision=PREC) * scale
            lam_ptr = DQS + qrows[:, None] * D + dcol[None, :]
            if CARRIED:  # P_m = I − M_m sits between q⁽ᵐ⁾ and q⁽ᵐ⁻¹⁾
                lam = tl.load(lam_ptr, mask=inside[:, None], other=0.0)
                dm_pair, lam = _lambda_products(ql, lam, mt, PREC32, LAMBDA_BF16)
                dm += dm_pair
                step += lam
            tl.store(lam_ptr, step, mask=inside[:, None])
            if HAS_GATE:  # dS's sums over its keys and over its queries on the tensor cores, from dS's operand
                row_sums = tl.dot(dsg, ones_k, input_precision=PREC)  # [R·BT, GATE_COLS]
                row_sums = tl.sum(tl.where(first_col, row_sums, 0.0), 1)  # column 0, within each thread's rows
                # relaxed atomics: no load on the pair's path (the sums are read after the kernel)
                tl.atomic_add(DG + qrows, row_sums, mask=inside, sem="relaxed")
                dg_cols += tl.dot(tl.trans(dsg), ones_q, input_precision=PREC)
        if HAS_GATE:
            dg_key -= tl.sum(tl.where(first_col, dg_cols, 0.0), 1)  # column 0 (a sum over zeros elsewhere: exact)
            tl.atomic_add(DG + qrow + rows, dg_key, sem="relaxed")
    tl.store(DKS + krow * D + tile_d, dk * scale)
    _store_rows(DVO + hk * sdv_h, ktok, kvalid, sdv_t, vcol, dv.to(DVO.dtype.element_ty), GATHER)
    tl.store(DM + (hk * NC + kn) * D * D + tile_dd, dm)
    tl.debug_barrier()  # this key chunk's writes of λ are visible to the whole program before the next reads them


@triton.jit
def _path_bwd_by_sequence_kernel(
    KS, V, M, SD, GL, GO, DO, LSE, DELTA, STATES, DQS, DKS, DVO, DM, DSD, DG, SEQ_ORDER, SEQ_CHUNKS, TOK,
    NC, NTOK, so_t, so_h, sdl_t, sdl_h, sv_t, sv_h, sdv_t, sdv_h, scale, scale_log2, n_state_rows, max_chunks,
    GROUP: tl.constexpr, HAS_GATE: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    R: tl.constexpr, PREC: tl.constexpr, PREC32: tl.constexpr, LAMBDA_BF16: tl.constexpr = False,
    GATHER: tl.constexpr = False, V_GATHER: tl.constexpr = False,
):
    """Program (p, hk): the sequence whose chunk 0 is chunk ``SEQ_ORDER[p]``, if ``SEQ_CHUNKS`` gives it a length
    (0 for chunks that start no sequence: such programs do nothing; the longest sequences come first), for kv
    head hk (module docstring). Rows of dO, o, δ (DELTA, strides (sdl_t, sdl_h)) and dV (DVO, strides
    (sdv_t, sdv_h)) are addressed as in ``_path_bwd_kernel``: (token r, head h) at r·s_t + h·s_h, r through
    ``TOK`` if ``GATHER``; V's rows likewise (strides (sv_t, sv_h), through ``TOK`` if ``V_GATHER``, else n·BT + i
    for chunk n: v's chunk copy). dk̃, dM, dq̃, dS_d and dG in the chunk layout; dG zero on entry. With the gate,
    LSE holds the log-sum-exp (log₂) minus the row's G_local·log₂e, so that a pair adds only the key side's terms
    to S (no load of the query rows' gate per pair)."""
    first = tl.load(SEQ_ORDER + tl.program_id(0)).to(tl.int64)
    count = tl.load(SEQ_CHUNKS + first)
    hk = tl.program_id(1).to(tl.int64)
    if count > 0:
        rows = tl.arange(0, BT)
        dcol = tl.arange(0, D)
        for g in range(GROUP):  # query chunk 0 is carried by no transition: dq̃ = 0
            tl.store(DQS + ((hk * GROUP + g) * NC + first) * BT * D + rows[:, None] * D + dcol[None, :],
                     tl.zeros([BT, D], dtype=tl.float32))
        _key_chunk(KS, V, M, SD, GL, GO, DO, LSE, DELTA, STATES, DQS, DKS, DVO, DM, DSD, DG, TOK,
                   first, count, 0, hk, NC, NTOK, so_t, so_h, sdl_t, sdl_h, sv_t, sv_h, sdv_t, sdv_h, scale,
                   scale_log2, n_state_rows, max_chunks, GROUP, HAS_GATE, BT, D, DV, R, PREC, PREC32, LAMBDA_BF16,
                   GATHER, V_GATHER, False)
    for m in range(1, count):
        _key_chunk(KS, V, M, SD, GL, GO, DO, LSE, DELTA, STATES, DQS, DKS, DVO, DM, DSD, DG, TOK,
                   first, count, m, hk, NC, NTOK, so_t, so_h, sdl_t, sdl_h, sv_t, sv_h, sdv_t, sdv_h, scale,
                   scale_log2, n_state_rows, max_chunks, GROUP, HAS_GATE, BT, D, DV, R, PREC, PREC32, LAMBDA_BF16,
                   GATHER, V_GATHER, True)
