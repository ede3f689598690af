"""``path_attention_triton``: PaTH / PaTH-FoX attention with the Triton scan, forward and backward.

s_ij = scale · q_iᵀ H_i H_{i−1} ⋯ H_{j+1} k_j + (G_i − G_j),  H_t = I − β_t w_t w_tᵀ,  G = cumsum(g)

(the gate is not multiplied by ``scale``: FoX's convention, the same as :func:`pathlab.reference.path_attention`).

Pipeline (all differentiable): chunk layout (``_layout``) → per-chunk UT transform in fp32, PyTorch (``_ut``)
or fused Triton kernels (``_triton_ut``, ``ut="triton"``) →
Triton scan (``_triton_path``) → back to ``[B, T, H, Dv]``. The scan's forward and backward are the custom ops
``pathlab::path_scan_fwd`` / ``pathlab::path_scan_bwd`` joined by ``register_autograd``, so ``torch.compile``
treats them as opaque calls (no graph break, no tracing into the kernels) and traces and fuses the rest. Extra
memory of the backward is O(T·D) per head for the chunk factors and gradients, plus the persistent programs'
scratch (O(T·D) in all; see ``_triton_path``).
"""

from __future__ import annotations

import math
import os

import torch

from ._layout import build_layout, chunk_gate, from_chunks, scatter_chunks, slot_tokens, state_rows, to_chunks
from ._mode import interpreting, switch as _switch, unwritten
from ._ut import ut_factors

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
LOG2E = 1.4426950408889634


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


def _launch_config(kind: str, D: int, DV: int):
    """(num_warps, num_stages, programs per SM, register cap) of the forward ("fwd") or backward ("bwd") kernel.

    Defaults were picked on an H200; ``PATHLAB_PATH_FWD="warps,stages"`` and
    ``PATHLAB_PATH_BWD="warps,stages,programs_per_sm[,maxnreg]"`` override them (used by the benchmark's
    ``--tune``). A register cap (Triton's ``maxnreg``; 0 = none) trades spills for more resident programs.
    At D = 128 one backward program of 8 warps takes every register of a multiprocessor, so one per SM
    (a second waited; its scratch was wasted).
    """
    big = max(D, DV) >= 128
    if kind == "fwd":
        default = (4, 2 if big else 3, 0, 0)
    else:
        default = (8, 1, 1, 0) if big else (4, 1, 2, 0)
    env = os.environ.get("PATHLAB_PATH_FWD" if kind == "fwd" else "PATHLAB_PATH_BWD")
    if not env:
        return default
    parts = [int(x) for x in env.split(",")]
    return tuple(parts + list(default[len(parts):]))


def _register_cap(maxnreg: int) -> dict:
    """Launch keyword for a register cap (none when 0)."""
    return {"maxnreg": maxnreg} if maxnreg else {}


LAMBDA_PRECISIONS = ("auto", "tf32", "bf16")


def _lambda_precision() -> str:
    """Operand precision of the backward's two products with the fp32 adjoint λ (λ Mᵀ and q⁽ᵐ⁾ᵀ λ) for fp16/bf16
    inputs (``PATHLAB_PATH_BWD_LAMBDA``): ``"tf32"`` (fp32 operands, 10-bit mantissa) or ``"bf16"`` (λ, M and
    q⁽ᵐ⁾ rounded to bf16: twice the tensor-core rate, 8-bit mantissa, fp32's range). ``"auto"`` (default) is
    bf16 on a GPU (on an H200 PaTH-FoX's fwd+bwd took 9–12% less time, PaTH's the same; the bf16 errors
    against fp64 did not change) and tf32 under the interpreter, whose bf16 products are not exact. fp32 inputs
    always use exact fp32."""
    name = os.environ.get("PATHLAB_PATH_BWD_LAMBDA") or "auto"
    if name not in LAMBDA_PRECISIONS:
        raise ValueError(f"PATHLAB_PATH_BWD_LAMBDA must be one of {LAMBDA_PRECISIONS}, got {name!r}")
    if name == "auto":
        return "tf32" if interpreting() else "bf16"
    return name


def _lowp(dtype):
    """Dtype of the carried states, k̃ and the transitions M inside the scan: fp16 for half inputs (bf16's 8-bit mantissa
    is too coarse for the low-rank factors; the public kernel's NaN fixes made the same choice), fp32 else."""
    return torch.float16 if dtype in (torch.float16, torch.bfloat16) else torch.float32


# ---------------------------------------------------------------------------------------------------------
# The Triton scan as two opaque custom ops (forward and backward), wired together by ``register_autograd``.
#
# torch.compile must not trace into the kernel launches: Dynamo would capture the user Triton kernels and
# Inductor would try to precompile them (on torch 2.11 / triton 3.6 that fails for ``_path_fwd_kernel``; under
# the CPU interpreter it cannot even read their source). As custom ops they are single extern calls in the graph,
# with fake implementations that give the output shapes; everything around them (layout, UT transform, casts)
# stays traceable, so Inductor can fuse it. The schemas are spelled out so that no annotation parsing is needed.

_FWD_SCHEMA = (
    "(Tensor qs, Tensor ks, Tensor v, Tensor m, Tensor sd, Tensor? gl, Tensor? go, "
    "Tensor chunk_first, Tensor chunk_index, Tensor order, SymInt max_chunks, float scale, int programs) "
    "-> (Tensor, Tensor)"
)
_BWD_SCHEMA = (
    "(Tensor do, Tensor qs, Tensor ks, Tensor v, Tensor m, Tensor sd, Tensor? gl, Tensor? go, "
    "Tensor o, Tensor lse, Tensor chunk_first, Tensor chunk_index, Tensor order, SymInt max_chunks, float scale, "
    "int programs) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)


def _check_states(states, dtype, H, NC, max_chunks, BT, D) -> bool:
    """Whether the scan gets the carried states' buffer (``states`` not None), after checking its dtype and shape
    ``[H, _layout.state_rows(NC, max_chunks), BT, D]``."""
    if states is None:
        return False
    want = (H, state_rows(NC, max_chunks), BT, D)
    if states.dtype != dtype or tuple(states.shape) != want:
        raise ValueError(f"states must be {dtype} {list(want)}, got {states.dtype} {list(states.shape)}")
    return True


def _scan_fwd_impl(qs, ks, v, m, sd, gl, go, chunk_first, chunk_index, order, max_chunks, scale, programs,
                   token_rows=None, v_rows=False, states=None):
    """Forward scan: o (v's dtype) and the base-2 log-sum-exp ``[H, NC, BT]`` (fp32), from v ``[Hkv, NC, BT, Dv]``
    in the chunk layout. o is ``[H, NC, BT, Dv]``, or with ``token_rows = (tokens, B, T)`` (``tokens`` from
    ``_layout.slot_tokens``; not a schema input: the fused ops pass it) ``[B, T, H, Dv]``, written there by the
    kernel (``_triton_path``, "Rows of o and dO"). ``v_rows=True`` (with ``token_rows``): v is ``[B, T, Hkv, Dv]``,
    read where it is (``_triton_path``, "Rows of v"; :func:`v_in_token_rows`). ``states`` (not a schema input):
    a ``[H, _layout.state_rows(NC, max_chunks), BT, D]`` buffer of the scan's dtype into which the kernel writes
    the carried query states for the backward (``_triton_path``, "The carried states"; :func:`forward_states`).

    ``order`` and ``programs`` are not used here; they are inputs so that the backward (set up
    from this op's inputs by ``register_autograd``) has them.
    """
    from ._triton_path import _path_fwd_kernel

    H, NC, BT, D = qs.shape
    DV = v.shape[-1]
    lowp = _lowp(v.dtype)
    prec = "ieee" if lowp == torch.float32 else "tf32"
    qs, sd = qs.contiguous(), sd.contiguous()
    v, Hkv, (sv_t, sv_h) = _v_rows(v, v_rows, NC, BT)
    ks_l, m_l = ks.to(lowp).contiguous(), m.to(lowp).contiguous()
    o_shape, tok, n_tok, (so_t, so_h) = _o_rows(token_rows, chunk_index, H, NC, BT, DV)
    o = unwritten(o_shape, dtype=v.dtype, device=v.device)
    lse = unwritten((H, NC, BT), dtype=torch.float32, device=v.device)
    has_gate = gl is not None
    num_warps, num_stages, _, maxnreg = _launch_config("fwd", D, DV)
    gl_ = gl.contiguous() if has_gate else qs  # dummies are never read
    go_ = go.contiguous() if has_gate else qs
    gather = n_tok != NC * BT
    keep = _check_states(states, lowp, H, NC, int(max_chunks), BT, D)
    _path_fwd_kernel[(NC, H)](
        qs, ks_l, v, m_l, sd, gl_, go_, o, lse, chunk_first, chunk_index, tok, states if keep else qs,
        NC, n_tok, so_t, so_h, sv_h, scale * LOG2E, states.shape[1] if keep else 0, max_chunks,
        GROUP=H // Hkv, HAS_GATE=has_gate, BT=BT, D=D, DV=DV, PREC=prec, GATHER=gather, SV_T=sv_t, V_ROWS=v_rows,
        V_GATHER=gather and v_rows,
        # each pair's gate loaded a pair ahead (PATHLAB_PATH_FWD_GATE_AHEAD): on an H200 the gated forward took 1-4%
        # less time at 12×64, 9% less at 16×128 (benchmarks/results/kernels-h200-gate-ahead.json)
        GATE_AHEAD=_switch("PATHLAB_PATH_FWD_GATE_AHEAD", True), KEEP_STATES=keep,
        num_warps=num_warps, num_stages=num_stages, **_register_cap(maxnreg),
    )
    return o, lse


# The forward keeps its carried states for the backward (``forward_states``) when no sequence spans more chunks:
# at 16 (1024 tokens at BT = 64) they take 7.5× one 16-bit q, growing as T². On an H200, 12×64, the op's
# forward+backward took 1.7% less device time at T = 512 (PaTH-FoX 2.7%) and 3.5% less at T = 1024; at 4096,
# where they took 31.5× one q, 8% less (``benchmarks/results/kernels-h200-fwd-states-0bde922.json``).
FWD_STATES_UP_TO_CHUNKS = 16


def forward_states(max_chunks: int) -> bool:
    """Whether the saving route (``ut="triton_saved"``) has the forward scan keep each pair's carried query state
    for the backward, which then reads them instead of replaying the carry (``_triton_path``, "The carried
    states"): ``PATHLAB_PATH_FWD_STATES`` = ``auto`` (default: when no sequence spans more than
    ``FWD_STATES_UP_TO_CHUNKS`` chunks), ``1`` (always; the states grow as T²) or ``0`` (never)."""
    return _switch("PATHLAB_PATH_FWD_STATES", max_chunks <= FWD_STATES_UP_TO_CHUNKS)


V_ROWS_VALUES = ("auto", "1", "0")


def v_in_token_rows(D: int, DV: int, max_chunks: int) -> bool:
    """Whether the fused routes' scan reads v in v's own layout ``[B, T, Hkv, Dv]`` (``PATHLAB_PATH_V_ROWS=1``)
    or in a chunk copy ``[Hkv, NC, BT, Dv]`` made by the op, twice per forward+backward (``0``). ``auto``
    (default): in place at D, Dv <= 64 for sequences of fewer than 64 chunks, a copy otherwise. In place the scan
    backward takes a little longer (its V tiles' rows are a token row apart) and the copies go. On an H200, 12×64,
    in one call: fwd+bwd 3.41 and 3.41 ms at T = 512 against 3.53 and 3.51 with the copy, the same at T = 4096
    (8.92–8.96; ``benchmarks/results/kernels-h200-dv-rows-*.json``, where dV summed in v's layout as well was the
    slower third variant); at T = 16384, 16×128, v and dV in place took 13% longer
    (``kernels-h200-rows-in-place*.json``)."""
    value = os.environ.get("PATHLAB_PATH_V_ROWS") or "auto"
    if value not in V_ROWS_VALUES:
        raise ValueError(f"PATHLAB_PATH_V_ROWS must be one of {V_ROWS_VALUES}, got {value!r}")
    if value == "auto":
        return max(D, DV) <= 64 and max_chunks < 64
    return value == "1"


def _token_rows(x):
    """x ``[B, T, heads, ·]`` with evenly spaced (b, t) rows (s_b = T·s_t) and unit last stride (copied if not;
    a slice of a fused projection already is), with its (s_t, s_h) for the scan kernels' row addressing."""
    B, T = x.shape[:2]
    if x.stride(-1) != 1 or (B > 1 and T > 1 and x.stride(0) != T * x.stride(1)):
        x = x.contiguous()
    return x, (x.stride(1) if T > 1 else x.stride(0), x.stride(2))


def _v_rows(v, v_rows, NC, BT):
    """(v as the kernels read it, the number of kv heads, (s_t, s_h) of its rows): ``[B, T, Hkv, Dv]`` in place
    when ``v_rows``, else the contiguous chunk layout ``[Hkv, NC, BT, Dv]``, whose row n·BT + i is chunk n's."""
    if v_rows:
        v, strides = _token_rows(v)
        return v, v.shape[2], strides
    v = v.contiguous()
    return v, v.shape[0], (v.shape[-1], NC * BT * v.shape[-1])


def _o_rows(token_rows, chunk_index, H, NC, BT, DV):
    """How the scan kernels address the rows of o and dO (``_triton_path``, "Rows of o and dO"): (o's shape, the
    row index, the number of tokens, (s_t, s_h) of contiguous o). In the chunk layout o is ``[H, NC, BT, DV]`` and
    row i of chunk n is n·BT + i (the index is not read); with ``token_rows = (tokens, B, T)`` o is
    ``[B, T, H, DV]`` and the row is ``tokens[n·BT + i]``, which the kernels read only where the layout has padding
    (more slots than tokens): without it (every sequence a whole number of chunks) it is n·BT + i as well."""
    if token_rows is None:
        return (H, NC, BT, DV), chunk_index, NC * BT, (DV, NC * BT * DV)
    tokens, B, T = token_rows
    return (B, T, H, DV), tokens, B * T, (H * DV, DV)


def _scan_fwd_fake(qs, ks, v, m, sd, gl, go, chunk_first, chunk_index, order, max_chunks, scale, programs):
    H, NC, BT, _ = qs.shape
    return (v.new_empty((H, NC, BT, v.shape[-1])),
            torch.empty((H, NC, BT), dtype=torch.float32, device=v.device))


DELTA_VALUES = ("auto", "kernel", "pass", "torch")


def _delta_mode(has_gate: bool, max_chunks: int) -> str:
    """Where the backward's δ_i = dO_i · o_i is formed (``PATHLAB_PATH_BWD_DELTA``): ``"kernel"`` by the scan
    itself, from o; ``"pass"`` by a Triton pass over dO and o before it (``_triton_path._delta_kernel``); both
    take δ from the product that forms dP (``_triton_path``, "δ"), so that the saturated rows of large |q|·|k|
    get dS = 0. ``"torch"`` by PyTorch ops before it (fp32 copies of both: slower; for measurements only: its sums
    round apart from dP's, which leaves ε·|dP| in dS of a saturated row, grown by |q|·|k| in dw and dβ).
    ``"auto"`` = in the kernel, except with
    the gate on sequences of 64 chunks or more, where it is a pass. On an H200, 12×64, in the kernel against
    PyTorch before it: PaTH fwd+bwd −6.4% at T = 512, −2.8% at 4096, −1.3% at 16384; PaTH-FoX −5.0% at 512,
    but +3.1% at 4096 and +5.1% at 16384 (``benchmarks/results/kernels-h200-delta-in-kernel.json``). The pass
    against PyTorch, PaTH-FoX: −3.0% at T = 4096, −1.2% at 16384, −0.8% at 16384 with 16×128; against the
    kernel, PaTH: within ±0.5% (``kernels-h200-delta-pass.json``)."""
    value = os.environ.get("PATHLAB_PATH_BWD_DELTA") or "auto"
    if value not in DELTA_VALUES:
        raise ValueError(f"PATHLAB_PATH_BWD_DELTA must be one of {DELTA_VALUES}, got {value!r}")
    if value == "auto":
        return "kernel" if not has_gate or max_chunks < 64 else "pass"
    return value


def _delta(do, o, rows=64, prec=None):
    """δ = rowsum(dO ∘ o) in fp32, o's shape without its last dim (contiguous dO and o of one dtype), by the
    Triton pass: ``rows`` at a time as the diagonal of a ``[rows, Dv] × [Dv, rows]`` product at precision
    ``prec`` (default: exact fp32 for fp32 inputs, else "tf32", as the scan's dP). The scan passes its BT."""
    from ._triton_path import _delta_kernel

    DV = o.shape[-1]
    prec = prec or ("ieee" if o.dtype == torch.float32 else "tf32")
    delta = unwritten(o.shape[:-1], dtype=torch.float32, device=o.device)
    n_rows = delta.numel()
    _delta_kernel[(-(-n_rows // rows),)](do, o, delta, n_rows, DV=DV, ROWS=rows, PREC=prec, num_warps=4)
    return delta


def _scan_bwd_impl(do, qs, ks, v, m, sd, gl, go, o, lse, chunk_first, chunk_index, order, max_chunks, scale,
                   programs, into_inputs=False, token_rows=None, v_rows=False, states=None):
    """Backward scan: (dq̃, dk̃, dV, dM, dS_d, dG_local), fp32 except dV (v's dtype, in the chunk layout or, with
    ``token_rows``, in v's). dG_local is an empty tensor when there is no gate. ``programs`` = 0 picks the
    default number of persistent programs.
    ``into_inputs=True`` writes dq̃ into q̃'s buffer and dS_d into S_d's (fp32, contiguous; each work item reads
    its rows of both before it writes them), for a caller that owns q̃ and S_d. ``token_rows``: o and dO in
    ``[B, T, H, Dv]``, as in :func:`_scan_fwd_impl`, and dV returned in v's layout ``[B, T, Hkv, Dv]``.
    ``v_rows=True`` (with ``token_rows``): v is read in v's layout, as in :func:`_scan_fwd_impl`. ``states``: the
    carried states the forward kept (:func:`_scan_fwd_impl`), read instead of replayed; with them the backward
    runs by sequence where :func:`backward_by_sequence` says so (``_triton_bwd_by_sequence``: dV summed in
    registers and written once, in v's dtype and layout), else by query chunk. By query chunk dV is summed in the
    chunk layout (in fp32) and copied back: summed in v's layout, fwd+bwd took 1.7% longer at T = 512, 12×64, on an
    H200 (3.47 against 3.41 ms; 2.3% for PaTH-FoX; the same at T = 4096;
    ``benchmarks/results/kernels-h200-dv-rows-*.json``)."""
    from ._triton_path import _path_bwd_kernel

    if into_inputs and (qs.dtype != torch.float32 or sd.dtype != torch.float32):
        raise ValueError(f"into_inputs needs fp32 q̃ and S_d, got {qs.dtype} and {sd.dtype}")
    H, NC, BT, D = qs.shape
    DV = v.shape[-1]
    lowp = _lowp(v.dtype)
    prec = "ieee" if lowp == torch.float32 else "tf32"
    qs, sd, o, lse = qs.contiguous(), sd.contiguous(), o.contiguous(), lse.contiguous()
    v, Hkv, (sv_t, sv_h) = _v_rows(v, v_rows, NC, BT)
    ks_l, m_l = ks.to(lowp).contiguous(), m.to(lowp).contiguous()
    do = do.to(v.dtype).contiguous()  # o's strides
    _, tok, n_tok, (so_t, so_h) = _o_rows(token_rows, chunk_index, H, NC, BT, DV)
    delta_mode = _delta_mode(gl is not None, int(max_chunks))
    keep = _check_states(states, lowp, H, NC, int(max_chunks), BT, D)
    by_sequence = keep and backward_by_sequence(NC, int(max_chunks), Hkv, qs.device)
    if by_sequence and delta_mode == "kernel":
        delta_mode = "pass"  # the kernel by sequence reads δ of a query chunk once per key chunk: a pass forms it
    # δ = rowsum(dO ∘ o) in o's shape without its last dim (so its strides are o's over DV), formed here or by the
    # kernel (which then never reads DELTA: o stands in)
    if delta_mode == "kernel":
        delta = o
    elif delta_mode == "pass":
        delta = _delta(do, o, BT, prec)
    else:
        delta = (do.float() * o.float()).sum(-1).contiguous()
    dev = qs.device
    f32 = dict(dtype=torch.float32, device=dev)
    if into_inputs:
        dqs, dsd = qs, sd
    else:
        dqs = unwritten((H, NC, BT, D), **f32)
        dsd = unwritten((H, NC, BT, BT), **f32)
    has_gate = gl is not None
    if by_sequence:
        return _scan_bwd_by_sequence(do, ks_l, v, m_l, sd, gl, go, lse, delta, states, dqs, dsd, chunk_first, tok,
                                     n_tok, (so_t, so_h), (sv_t, sv_h), v_rows, token_rows, max_chunks, scale)
    dks = torch.zeros((Hkv, NC, BT, D), **f32)
    dv = torch.zeros((Hkv, NC, BT, DV), **f32)
    dm = torch.zeros((Hkv, NC, D, D), **f32)
    dg = torch.zeros((H, NC, BT), **f32) if has_gate else torch.empty((0,), **f32)
    n_items = NC * H
    gather = n_tok != NC * BT
    num_warps, num_stages, per_sm, maxnreg = _launch_config("bwd", D, DV)
    programs = programs if programs > 0 else per_sm * _num_sms(dev)
    programs = max(1, min(n_items, programs))
    # the replay's scratch, one row per program (none when the forward's states are read: they stand in, unread)
    scratch = states if keep else torch.empty((programs, max_chunks, BT, D), dtype=lowp, device=dev)
    _path_bwd_kernel[(programs,)](
        qs, ks_l, v, m_l, sd, gl.contiguous() if has_gate else qs, go.contiguous() if has_gate else qs,
        do, o, lse, delta,
        dqs, dks, dv, dm, dsd, dg if has_gate else dqs, scratch, scratch,
        chunk_first, chunk_index, order, tok,
        NC, H, n_items, max_chunks, n_tok, so_t, so_h, so_t // DV, so_h // DV, sv_h, scale, scale * LOG2E,
        states.shape[1] if keep else 0,
        GROUP=H // Hkv, HAS_GATE=has_gate, BT=BT, D=D, DV=DV, PREC=prec, GATHER=gather, SV_T=sv_t,
        V_ROWS=v_rows, V_GATHER=gather and v_rows, FWD_STATES=keep,
        PREC32="ieee" if lowp == torch.float32 else "tf32",
        LAMBDA_BF16=lowp != torch.float32 and _lambda_precision() == "bf16",
        # the next carried state loaded one pair ahead (PATHLAB_PATH_BWD_PREFETCH): on an H200 fwd+bwd took 3-6%
        # less time at D = 64 and 2% more at D = 128 (benchmarks/results/kernels-h200-prefetch.json)
        PREFETCH=_switch("PATHLAB_PATH_BWD_PREFETCH", max(D, DV) <= 64),
        # the work items dealt in a snake (PATHLAB_PATH_BWD_SNAKE), for balance: on an H200 fwd+bwd took 16%
        # less time at 16×128, 1-2% less at 12×64 (benchmarks/results/kernels-h200-head-groups-snake.json)
        SNAKE=_switch("PATHLAB_PATH_BWD_SNAKE", True), DELTA_HERE=delta_mode == "kernel",
        num_warps=num_warps, num_stages=num_stages, **_register_cap(maxnreg),
        NO_ATOMICS=os.environ.get("PATHLAB_PATH_BWD_PROFILE") == "no_atomics",
        ACQ_REL=os.environ.get("PATHLAB_PATH_BWD_PROFILE") == "acq_rel_atomics",
    )
    if token_rows is not None:
        dv = scatter_chunks(dv, token_rows[0], token_rows[1], token_rows[2], v.dtype)
    return dqs, dks, dv.to(v.dtype), dm, dsd, dg


# The backward by sequence wants at least this many programs per multiprocessor (not tuned: at the model's shape,
# T = 512 and B = 64 with 12 kv heads, it has 768 programs for an H200's 132 multiprocessors).
BY_SEQUENCE_PROGRAMS_PER_SM = 1


def backward_by_sequence(n_chunks: int, max_chunks: int, n_kv_heads: int, device) -> bool:
    """Whether a backward given the forward's carried states runs by sequence (``_triton_bwd_by_sequence``: one
    program per sequence and kv head, no replay, no atomics) rather than by query chunk (``_path_bwd_kernel``):
    ``PATHLAB_PATH_BWD_BY_SEQUENCE`` = ``1``, ``0`` or ``auto`` (default: when the sequences, at least
    n_chunks / max_chunks of them, times the kv heads give every multiprocessor a program). On an H200 at one
    ``owt16`` layer (T = 512, B = 64, 12×64, device time) the backward kernel took 0.73 ms by sequence against
    1.06–1.08 by query chunk, and PaTH's op 2.67–2.69 against 3.07–3.11
    (``benchmarks/results/kernels-h200-by-sequence-*.json``). With the gate it took 1.52–1.89 ms against 1.14–1.16,
    until its sums over dS moved to the tensor cores and the query rows' gate into the log-sum-exp: since then
    1.19–1.22 against 1.14–1.15, and PaTH-FoX's op 3.07–3.11 against 3.09–3.12 ms, 0.4–0.9% less in each of three
    calls (the kernel saves no work, the op the zero fills and dV's copy;
    ``kernels-h200-gate-dots-2-a4310ac.json``, ``kernels-h200-gate-products-53e360a.json``,
    ``kernels-h200-keys-as-rows-ee8d08e.json``), so the gate no longer decides."""
    enough = (n_chunks // max(1, max_chunks)) * n_kv_heads >= BY_SEQUENCE_PROGRAMS_PER_SM * _num_sms(device)
    return _switch("PATHLAB_PATH_BWD_BY_SEQUENCE", enough)


def _by_sequence_launch() -> tuple[int, int, int]:
    """(query chunks per tile R, num_warps, num_stages) of the backward by sequence, default (1, 4, 2), the fastest
    of ten on an H200 at T = 512, 12×64 (``benchmarks/results/kernels-h200-by-sequence-*.json``);
    ``PATHLAB_PATH_BWD_SEQ="R,warps,stages"`` overrides them."""
    default = (1, 4, 2)
    env = os.environ.get("PATHLAB_PATH_BWD_SEQ")
    if not env:
        return default
    parts = env.split(",")
    if not all(x.isdigit() for x in parts) or len(parts) > 3 or parts[0] not in ("1", "2", "4"):
        raise ValueError(f"PATHLAB_PATH_BWD_SEQ must be 'R[,warps[,stages]]' with R in 1, 2, 4, got {env!r}")
    return tuple([int(x) for x in parts] + list(default[len(parts):]))


def _scan_bwd_by_sequence(do, ks, v, m, sd, gl, go, lse, delta, states, dqs, dsd, chunk_first, tok, n_tok,
                          o_strides, v_strides, v_rows, token_rows, max_chunks, scale):
    """The backward by sequence (``_triton_bwd_by_sequence``) for :func:`_scan_bwd_impl`, which prepared its
    inputs (k̃ and M in the scan's dtype, v as the kernels read it, δ) and the buffers of dq̃ and dS_d. Returns
    what that function returns; dV is written by the kernel in v's dtype, in v's layout with ``token_rows``."""
    from ._triton_bwd_by_sequence import _path_bwd_by_sequence_kernel

    H, NC, BT, D = dqs.shape
    Hkv, DV = ks.shape[0], do.shape[-1]
    dev, f32 = dqs.device, dict(dtype=torch.float32, device=dqs.device)
    # per chunk: its sequence's length in chunks if it is the sequence's chunk 0, else 0; longest sequences first
    seq_chunks = torch.zeros(NC, dtype=torch.int32, device=dev).scatter_add_(
        0, chunk_first.long(), torch.ones(NC, dtype=torch.int32, device=dev))
    seq_order = torch.argsort(seq_chunks, descending=True, stable=True).to(torch.int32)
    dks = unwritten((Hkv, NC, BT, D), **f32)
    dm = unwritten((Hkv, NC, D, D), **f32)
    if token_rows is None:  # chunk layout: row n·BT + i of chunk n
        dv = unwritten((Hkv, NC, BT, DV), dtype=v.dtype, device=dev)
        dv_strides = (DV, NC * BT * DV)
    else:
        dv = unwritten((*token_rows[1:], Hkv, DV), dtype=v.dtype, device=dev)
        dv_strides = (Hkv * DV, DV)
    has_gate = gl is not None
    dg = torch.zeros((H, NC, BT), **f32) if has_gate else torch.empty((0,), **f32)
    lowp = ks.dtype
    gather = n_tok != NC * BT
    R, num_warps, num_stages = _by_sequence_launch()
    so_t, so_h = o_strides
    if has_gate:  # the query rows' G_local moves into the log-sum-exp (the kernel's docstring)
        lse = (lse - gl * LOG2E).contiguous()
    _path_bwd_by_sequence_kernel[(NC, Hkv)](
        ks, v, m, sd, gl.contiguous() if has_gate else dqs, go.contiguous() if has_gate else dqs, do, lse, delta,
        states, dqs, dks, dv, dm, dsd, dg if has_gate else dqs, seq_order, seq_chunks, tok,
        NC, n_tok, so_t, so_h, so_t // DV, so_h // DV, *v_strides, *dv_strides, scale, scale * LOG2E,
        states.shape[1], max_chunks,
        GROUP=H // Hkv, HAS_GATE=has_gate, BT=BT, D=D, DV=DV, R=R,
        PREC="ieee" if lowp == torch.float32 else "tf32", PREC32="ieee" if lowp == torch.float32 else "tf32",
        LAMBDA_BF16=lowp != torch.float32 and _lambda_precision() == "bf16",
        GATHER=gather, V_GATHER=gather and v_rows, num_warps=num_warps, num_stages=num_stages,
    )
    return dqs, dks, dv, dm, dsd, dg


def _scan_bwd_fake(do, qs, ks, v, m, sd, gl, go, o, lse, chunk_first, chunk_index, order, max_chunks, scale,
                   programs):
    H, NC, BT, D = qs.shape
    Hkv, DV = v.shape[0], v.shape[-1]
    f32 = dict(dtype=torch.float32, device=qs.device)
    dg = torch.empty((H, NC, BT), **f32) if gl is not None else torch.empty((0,), **f32)
    return (torch.empty((H, NC, BT, D), **f32), torch.empty((Hkv, NC, BT, D), **f32),
            v.new_empty((Hkv, NC, BT, DV)), torch.empty((Hkv, NC, D, D), **f32),
            torch.empty((H, NC, BT, BT), **f32), dg)


_scan_fwd = torch.library.custom_op("pathlab::path_scan_fwd", _scan_fwd_impl, mutates_args=(), schema=_FWD_SCHEMA)
_scan_fwd.register_fake(_scan_fwd_fake)
_scan_bwd = torch.library.custom_op("pathlab::path_scan_bwd", _scan_bwd_impl, mutates_args=(), schema=_BWD_SCHEMA)
_scan_bwd.register_fake(_scan_bwd_fake)


def _scan_setup_context(ctx, inputs, output):
    qs, ks, v, m, sd, gl, go, chunk_first, chunk_index, order, max_chunks, scale, programs = inputs
    o, lse = output
    ctx.set_materialize_grads(False)  # the log-sum-exp's gradient is ignored: no zeros filled for it
    ctx.save_for_backward(qs, ks, v, m, sd, gl, go, o, lse, chunk_first, chunk_index, order)
    ctx.max_chunks, ctx.scale, ctx.programs = max_chunks, scale, programs


def _scan_backward(ctx, do, dlse):
    """Gradients of the forward op's tensor inputs from dO (the log-sum-exp is internal: its gradient is
    ignored). G = offset[chunk] + G_local, so the offsets' gradient is the per-chunk sum of dG_local."""
    qs, ks, v, m, sd, gl, go, o, lse, chunk_first, chunk_index, order = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    dqs, dks, dv, dm, dsd, dg = _scan_bwd(do, qs, ks, v, m, sd, gl, go, o, lse, chunk_first, chunk_index,
                                              order, ctx.max_chunks, ctx.scale, ctx.programs)
    dgl = dgo = None
    if gl is not None:
        dgl = dg
        dgo = dg.sum(-1).to(torch.float64)
    return dqs, dks, dv, dm, dsd, dgl, dgo, None, None, None, None, None, None


_scan_fwd.register_autograd(_scan_backward, setup_context=_scan_setup_context)


def _check(q, k, v, w, beta, g, cu_seqlens):
    for name, t in (("q", q), ("k", k), ("v", v), ("w", w), ("beta", beta)) + ((("g", g),) if g is not None else ()):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cuda" and not interpreting():
            raise ValueError(
                f"path_attention_triton needs CUDA tensors, got {name} on {t.device} "
                "(on a CPU, set TRITON_INTERPRET=1 before importing pathlab.kernels, or use backend='torch')"
            )
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}: put every input on one device")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or w.ndim != 4:
        raise ValueError(f"q, k, v, w must be [B, T, heads, dim], got {q.shape}, {k.shape}, {v.shape}, {w.shape}")
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    if k.shape != (B, T, Hkv, D) or w.shape != k.shape:
        raise ValueError(f"k and w must be [B, T, Hkv, D] = [{B}, {T}, Hkv, {D}], got k {tuple(k.shape)}, w {tuple(w.shape)}")
    if v.shape[:3] != (B, T, Hkv):
        raise ValueError(f"v must be [B, T, Hkv, Dv] with Hkv = {Hkv}, got {tuple(v.shape)}")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"the query heads ({H}) must be a multiple of the key/value heads ({Hkv})")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim D must be one of {SUPPORTED_HEAD_DIMS}, got {D}")
    if v.shape[3] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"value head dim Dv must be one of {SUPPORTED_HEAD_DIMS}, got {v.shape[3]}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype among fp16, bf16, fp32; got {q.dtype}, {k.dtype}, {v.dtype}")
    if beta.shape != (B, T, Hkv):
        raise ValueError(f"beta must be [B, T, Hkv] = {(B, T, Hkv)}, got {tuple(beta.shape)}")
    if g is not None and g.shape != (B, T, H):
        raise ValueError(f"g must be [B, T, H] = {(B, T, H)}, got {tuple(g.shape)}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens needs packed inputs with B == 1, got B = {B}")
        if cu_seqlens.ndim != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must be a 1-D int32 tensor [N + 1] of sequence boundaries")
        if cu_seqlens.device != q.device:
            raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {q.device}")


def _static_dim(D) -> int:
    """The head dim as a Python int. Under ``torch.compile(dynamic=True)`` a size is a SymInt; comparing it with
    the supported sizes specialises it, so the default scale stays a plain float (a schema ``float``)."""
    for d in SUPPORTED_HEAD_DIMS:
        if D == d:
            return d
    raise ValueError(f"head dim D must be one of {SUPPORTED_HEAD_DIMS}, got {D}")


UT_BACKENDS = ("auto", "torch", "triton", "triton_saved")


def _ut_name(name, q):
    """``"torch"``, ``"triton"`` or ``"triton_saved"`` for input q. ``None`` reads ``PATHLAB_PATH_UT`` (so that
    benchmarks of whole models can switch it), default ``"auto"``: for CUDA tensors

    * D ≤ 64: the fused kernels keeping their factors for the backward (on an H200, fwd+bwd at T = 4096, 12×64
      took 11.9 ms against 12.7 when recomputing them and 18.9 with the PyTorch transform; the ``owt16`` model
      trained 10% faster than when recomputing, with 6 GB more memory: ``"triton"`` is the low-memory choice);
    * D = 128: the fused kernels recomputing their factors (their backward split in five kernels to fit; at
      T = 16384, 16×128 in one call: 156.5 ms against 164.0 with the PyTorch transform and 159.1 keeping the
      factors, ``benchmarks/results/kernels-h200-d128-fused-default.json``; peak 2966 MiB against 5916 and 4486,
      ``kernels-h200-d128-fused-ut-final.json`` and ``memory-phases-h200-16384x16x128.json``);

    the PyTorch transform on the CPU, where every route is tested explicitly."""
    if name is None:
        name = os.environ.get("PATHLAB_PATH_UT") or "auto"
    if name not in UT_BACKENDS:
        raise ValueError(f"ut must be one of {UT_BACKENDS}, got {name!r}")
    if name == "auto":
        if q.device.type != "cuda":
            return "torch"
        return "triton_saved" if q.shape[-1] <= 64 else "triton"
    return name


def _ut_factors_torch(q, k, w, beta, layout):
    """q̃, k̃, M, S_d of every chunk (fp32) by PyTorch ops on fp32 chunk-layout copies of the inputs."""
    f32 = torch.float32
    wn = torch.nn.functional.normalize(w.to(f32), dim=-1)
    return ut_factors(*(to_chunks(x, layout) for x in (q.to(f32), k.to(f32), wn, beta.to(f32))))


def path_attention_triton(q, k, v, w, beta, g=None, *, scale=None, cu_seqlens=None, block_size=None,
                          programs=None, ut=None):
    """PaTH (PaTH-FoX with ``g``) attention by the Triton kernel, differentiable in every input.

    Args:
        q: ``[B, T, H, D]`` fp16, bf16 or fp32; D in {16, 32, 64, 128}.
        k, w: ``[B, T, Hkv, D]`` (H a multiple of Hkv; query head h uses kv head h // (H/Hkv)). w is
            normalised here again in fp32 (a no-op on the dispatcher's unit w, but it keeps raw w correct).
        v: ``[B, T, Hkv, Dv]``, Dv in {16, 32, 64, 128}.
        beta: ``[B, T, Hkv]`` in (0, 2) (upcast to fp32).
        g: ``[B, T, H]`` log forget gates (≤ 0) or None (upcast to fp32; G summed in fp64 across chunks).
        scale: logit scale, default 1/√D; the gate is not scaled.
        cu_seqlens: int32 ``[N + 1]`` boundaries of packed sequences (FlashAttention's convention; B == 1).
        block_size: chunk length BT (default: ``PATHLAB_PATH_BLOCK``, else 64; small values such as 16
            exercise the chunking in tests).
        programs: persistent programs of the backward by query chunk (default: a few per SM); the scratch is
            programs × (longest sequence) × D. The backward by sequence (``backward_by_sequence``) has one program
            per sequence and kv head instead.
        ut: how the per-chunk UT transform runs: ``"torch"`` (PyTorch ops, their intermediates saved),
            ``"triton"`` (fused kernels reading the inputs in place, in one op with the scan that recomputes
            the UT factors in its backward, ``_recompute``; same results within fp32 rounding),
            ``"triton_saved"`` (the same kernels keeping the factors for the backward: one UT forward fewer,
            12.7× one 16-bit q kept for the backward instead of 1.04× at 12×64, T = 512, with the scan's
            carried states, ``forward_states``; without gradients, as in evaluation, ``"triton"`` runs
            instead) or ``"auto"``
            (on CUDA ``"triton_saved"`` at D ≤ 64 and ``"triton"`` at D = 128, else ``"torch"``); default: the
            environment variable ``PATHLAB_PATH_UT``, else ``"auto"``.

    Returns:
        o ``[B, T, H, Dv]`` in q's dtype.

    Non-finite inputs (``pathlab.ops.path``, "Non-finite inputs"): sequences of the batch and ``cu_seqlens``
    segments never reach one another (the gate's chunk offsets are summed per sequence, ``_layout.chunk_gate``);
    within a sequence a NaN at t reaches no output before t's chunk of BT tokens, but in v_t, w_t or β_t every
    row of that chunk (the chunk's products with masked triangles).
    """
    _check(q, k, v, w, beta, g, cu_seqlens)
    ut = _ut_name(ut, q)
    if ut == "triton_saved" and not (torch.is_grad_enabled()
                                     and any(t is not None and t.requires_grad for t in (q, k, v, w, beta, g))):
        ut = "triton"  # no backward, nothing to keep: the same forward kernels without the factors and states
    B, T, H, D = q.shape
    scale = _static_dim(D) ** -0.5 if scale is None else float(scale)
    if not scale > 0 or not math.isfinite(scale):
        raise ValueError(f"scale must be a positive number, got {scale!r}")
    BT = int(block_size or os.environ.get("PATHLAB_PATH_BLOCK") or 64)
    if BT not in (16, 32, 64, 128):
        raise ValueError(f"block_size (or PATHLAB_PATH_BLOCK) must be one of 16, 32, 64, 128, got {BT}")
    if T == 0:
        return q.new_zeros(B, 0, H, v.shape[3])
    layout = build_layout(B, T, BT, q.device, cu_seqlens)
    if programs is not None and (not isinstance(programs, int) or programs < 1):
        raise ValueError(f"programs must be a positive int or None, got {programs!r}")
    gl = go = None
    if g is not None:
        gl, go = chunk_gate(to_chunks(g.to(torch.float32), layout), layout)
    meta = (layout.chunk_first, layout.chunk_index, layout.order, layout.max_chunks)
    if ut == "triton":  # fused UT kernels + scan in one op that recomputes the UT factors in its backward
        from ._recompute import path_fwd

        o, _ = path_fwd(q, k, w, beta, v, gl, go, slot_tokens(layout, B, T), *meta, BT, scale, programs or 0)
        return o  # [B, T, H, Dv] in v's dtype (q's)
    if ut == "triton_saved":  # the same, keeping the factors for the backward instead of recomputing them
        from ._recompute import path_saved_fwd

        return path_saved_fwd(q, k, w, beta, v, gl, go, slot_tokens(layout, B, T), *meta, BT, scale,
                              programs or 0)[0]
    qs, ks, m, sd = _ut_factors_torch(q, k, w, beta, layout)
    o, _ = _scan_fwd(qs, ks, to_chunks(v, layout), m, sd, gl, go, *meta, scale, programs or 0)
    return from_chunks(o, layout).to(q.dtype)
