"""The PaTH scan's forward: one program per (query chunk c, query head), key chunks right to left.

Inputs are the UT factors in the chunk layout (``layout``; ``[heads, NC, BT, ·]``, contiguous): per chunk n the
carried queries q̃ (fp32), the carried keys k̃, the transition P_n = I − M_n as M_n = Wᵀ U (``[heads, NC, D, D]``)
and the intra-chunk logits S_d. For query chunk c of a sequence:

    o, l, m from the diagonal block (S_d, causal), then for key chunks m = c−1 … 0:
        S = q k̃_mᵀ · scale + (G_i − G_j);  online softmax;  o += P V_m
        q ← q − q M_m                        (carry the queries across chunk m; q stays fp32)

and the base-2 log-sum-exp is stored for the backward.

Rows of o and dO (and δ) are addressed where they are, so no chunk copy of them is made: row i of chunk n holds
token r = ``TOK[n·BT + i]`` (``GATHER``; padding holds r = NTOK and is masked) or r = n·BT + i (no padding), and
(token r, head h) sits at r·s_t + h·s_h. The same kernels thus serve ``[B, T, heads, ·]`` tensors with evenly
spaced (b, t) rows (r = b·T + t, ``layout.slot_tokens``) and contiguous chunk-layout tensors.

Rows of v: v is read once per chunk pair, in v's layout ``[B, T, Hkv, Dv]`` (``V_ROWS``; through ``TOK`` where
the layout has padding, ``V_GATHER``) or in a chunk copy (``scan.v_in_token_rows`` chooses). Key chunks m < c are
whole chunks (only a sequence's last chunk has padding), so their rows are consecutive tokens found from the first.

The gate (PaTH-FoX): G_i = offset_c + G_local_i (``layout.chunk_gate``: offsets in fp64, local sums in fp32), so
a pair's term is G_local_i − (G_local_j − (offset_c − offset_m)); the key side is formed once per key column
(``_key_gate``) and loaded one pair ahead of its use, so that the loads' latency hides behind the pair's dots.
The query's own G_local_i stays in the logits: left out, large local sums would cost the logits their low bits.

The carried states (``KEEP_STATES``): for short sequences the forward stores each pair's q⁽ᵐ⁾ as its dots used it,
c of them for query chunk c, in ``[H, rows, BT, D]``; chunk c of a sequence whose chunk 0 is ``first`` keeps them
at rows base(first) + c(c−1)/2 + m (``layout.state_base``). The backward then reads them instead of replaying the
carry; the buffer grows as T², so ``scan.forward_states`` decides.
"""

from __future__ import annotations

import triton
import triton.language as tl

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
    """First row of chunk c's carried states in its head's ``[rows, BT, D]`` (``layout.state_base``: a sequence
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
    V_GATHER: tl.constexpr = False, KEEP_STATES: tl.constexpr = False,
):
    """O is written by row (module docstring, "Rows of o and dO"): (token r, query head h) at r·so_t + h·so_h;
    V is read in v's layout if ``V_ROWS``, (token r, kv head) at r·SV_T + hk·sv_h, its rows through ``TOK`` if
    ``V_GATHER``, else in the chunk layout (module docstring, "Rows of v"). KEEP_STATES: each carried state q⁽ᵐ⁾ as the pair's dots use
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
            s += gq[:, None] - key_gate[None, :]
            # the next pair's (the loads' latency hides behind this pair's dots)
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

