"""The PaTH scan as two custom ops, forward and backward, and the choices of how they launch.

``pathlab::path_scan_fwd`` / ``pathlab::path_scan_bwd`` take the UT factors in the chunk layout (q̃, S_d fp32
``[H, NC, BT, ·]``; k̃ ``[Hkv, NC, BT, D]``, M ``[Hkv, NC, D, D]``; v ``[Hkv, NC, BT, Dv]``) and the gate's chunk
offsets and local sums, and return o and the base-2 log-sum-exp (forward) or the gradients of every tensor input
(backward). As custom ops they are single extern calls for ``torch.compile`` (Dynamo does not trace into the
kernel launches, Inductor does not try to precompile them), with fake implementations that give the shapes;
everything around them stays traceable. The fused routes (``fused``) call the implementations directly, with the
rows of o, dO and v in their token layout.

The choices below depend on the shapes only; each can be pinned by a :class:`KernelConfig` (``config``) for
tests and benchmarks.
"""

from __future__ import annotations

import torch

from .config import DEFAULT, KernelConfig, config_of, launch, pick
from .layout import scatter_chunks, state_rows
from .runtime import interpreting, unwritten
from .scan_backward_by_chunk import _delta_kernel, _path_bwd_kernel
from .scan_backward_by_sequence import _path_bwd_by_sequence_kernel
from .scan_forward import _path_fwd_kernel

LOG2E = 1.4426950408889634


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


def _launch_config(kind: str, D: int, DV: int, config: KernelConfig = DEFAULT):
    """(num_warps, num_stages, programs per SM, register cap) of the forward ("fwd") or backward ("bwd") kernel
    (``config.fwd_launch``/``bwd_launch`` override a leading part). A register cap (Triton's ``maxnreg``; 0 = none)
    trades spills for more resident programs. At D = 128 one backward program of 8 warps takes every register of a
    multiprocessor, so one per SM (a second would wait, its scratch wasted)."""
    big = max(D, DV) >= 128
    if kind == "fwd":
        return launch(config.fwd_launch, (4, 2 if big else 3, 0, 0))
    return launch(config.bwd_launch, (8, 1, 1, 0) if big else (4, 1, 2, 0))


def _register_cap(maxnreg: int) -> dict:
    """Launch keyword for a register cap (none when 0)."""
    return {"maxnreg": maxnreg} if maxnreg else {}


def lambda_bf16(lowp) -> bool:
    """Whether the backward's two products with the fp32 adjoint λ (λ Mᵀ and q⁽ᵐ⁾ᵀ λ) take bf16 operands (twice the
    tensor-core rate of tf32, fp32's range, an 8-bit mantissa; the errors of 16-bit inputs against fp64 stay the
    same) rather than tf32: for fp16/bf16 inputs on a GPU. Under the interpreter, whose bf16 products are not
    exact, tf32; fp32 inputs always use exact fp32."""
    return lowp != torch.float32 and not interpreting()


def _lowp(dtype):
    """Dtype of the carried states, k̃ and the transitions M inside the scan: fp16 for half inputs (bf16's 8-bit mantissa
    is too coarse for the low-rank factors; the public kernel's NaN fixes made the same choice), fp32 else."""
    return torch.float16 if dtype in (torch.float16, torch.bfloat16) else torch.float32


_FWD_SCHEMA = (
    "(Tensor qs, Tensor ks, Tensor v, Tensor m, Tensor sd, Tensor? gl, Tensor? go, "
    "Tensor chunk_first, Tensor chunk_index, Tensor order, SymInt max_chunks, float scale, int programs, "
    "int config) -> (Tensor, Tensor)"
)
_BWD_SCHEMA = (
    "(Tensor do, Tensor qs, Tensor ks, Tensor v, Tensor m, Tensor sd, Tensor? gl, Tensor? go, "
    "Tensor o, Tensor lse, Tensor chunk_first, Tensor chunk_index, Tensor order, SymInt max_chunks, float scale, "
    "int programs, int config) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)


def _check_states(states, dtype, H, NC, max_chunks, BT, D) -> bool:
    """Whether the scan gets the carried states' buffer (``states`` not None), after checking its dtype and shape
    ``[H, layout.state_rows(NC, max_chunks), BT, D]``."""
    if states is None:
        return False
    want = (H, state_rows(NC, max_chunks), BT, D)
    if states.dtype != dtype or tuple(states.shape) != want:
        raise ValueError(f"states must be {dtype} {list(want)}, got {states.dtype} {list(states.shape)}")
    return True


def _scan_fwd_impl(qs, ks, v, m, sd, gl, go, chunk_first, chunk_index, order, max_chunks, scale, programs, config=0,
                   token_rows=None, v_rows=False, states=None):
    """Forward scan: o (v's dtype) and the base-2 log-sum-exp ``[H, NC, BT]`` (fp32), from v ``[Hkv, NC, BT, Dv]``
    in the chunk layout. o is ``[H, NC, BT, Dv]``, or with ``token_rows = (tokens, B, T)`` (``tokens`` from
    ``layout.slot_tokens``; not a schema input: the fused ops pass it) ``[B, T, H, Dv]``, written there by the
    kernel (``scan_forward``, "Rows of o and dO"). ``v_rows=True`` (with ``token_rows``): v is ``[B, T, Hkv, Dv]``,
    read where it is (``scan_forward``, "Rows of v"; :func:`v_in_token_rows`). ``states`` (not a schema input):
    a ``[H, layout.state_rows(NC, max_chunks), BT, D]`` buffer of the scan's dtype into which the kernel writes
    the carried query states for the backward (``scan_forward``, "The carried states"; :func:`forward_states`).

    ``order`` and ``programs`` are not used here; they are inputs so that the backward (set up
    from this op's inputs by ``register_autograd``) has them. ``config``: a :class:`KernelConfig` or its id.
    """
    H, NC, BT, D = qs.shape
    DV = v.shape[-1]
    lowp = _lowp(v.dtype)
    # fp32 inputs: 3-pass tf32, fp32-level products on the tensor cores; exact ("ieee") products would run on the
    # CUDA cores, far below that rate, which the probes' long fp32 forwards cannot afford
    prec = "tf32x3" if lowp == torch.float32 else "tf32"
    qs, sd = qs.contiguous(), sd.contiguous()
    v, Hkv, (sv_t, sv_h) = _v_rows(v, v_rows, NC, BT)
    ks_l, m_l = ks.to(lowp).contiguous(), m.to(lowp).contiguous()
    o_shape, tok, n_tok, (so_t, so_h) = _o_rows(token_rows, chunk_index, H, NC, BT, DV)
    o = unwritten(o_shape, dtype=v.dtype, device=v.device)
    lse = unwritten((H, NC, BT), dtype=torch.float32, device=v.device)
    has_gate = gl is not None
    cfg = config_of(config) if isinstance(config, int) else (config or DEFAULT)
    num_warps, num_stages, _, maxnreg = _launch_config("fwd", D, DV, cfg)
    gl_ = gl.contiguous() if has_gate else qs  # dummies are never read
    go_ = go.contiguous() if has_gate else qs
    gather = n_tok != NC * BT
    keep = _check_states(states, lowp, H, NC, int(max_chunks), BT, D)
    _path_fwd_kernel[(NC, H)](
        qs, ks_l, v, m_l, sd, gl_, go_, o, lse, chunk_first, chunk_index, tok, states if keep else qs,
        NC, n_tok, so_t, so_h, sv_h, scale * LOG2E, states.shape[1] if keep else 0, max_chunks,
        GROUP=H // Hkv, HAS_GATE=has_gate, BT=BT, D=D, DV=DV, PREC=prec, GATHER=gather, SV_T=sv_t, V_ROWS=v_rows,
        V_GATHER=gather and v_rows, KEEP_STATES=keep,
        num_warps=num_warps, num_stages=num_stages, **_register_cap(maxnreg),
    )
    return o, lse


# The forward keeps its carried states for the backward when no sequence spans more chunks: at 16 (1024 tokens at
# BT = 64) they take 7.5× one 16-bit q, growing as T²; up to there reading them beats replaying the carry.
FWD_STATES_UP_TO_CHUNKS = 16


def forward_states(max_chunks: int, config: KernelConfig = DEFAULT) -> bool:
    """Whether the saving route (``ut="triton_saved"``) has the forward scan keep each pair's carried query state
    for the backward, which then reads them instead of replaying the carry (``scan_forward``, "The carried
    states"): when no sequence spans more than ``FWD_STATES_UP_TO_CHUNKS`` chunks (``config.forward_states`` pins
    it; the states grow as T²)."""
    return pick(config.forward_states, max_chunks <= FWD_STATES_UP_TO_CHUNKS)


def v_in_token_rows(D: int, DV: int, max_chunks: int, config: KernelConfig = DEFAULT) -> bool:
    """Whether the fused routes' scan reads v in v's own layout ``[B, T, Hkv, Dv]`` or in a chunk copy
    ``[Hkv, NC, BT, Dv]`` made by the op, twice per forward+backward: in place at D, Dv ≤ 64 for sequences of fewer
    than 64 chunks, a copy otherwise (``config.v_rows`` pins it). In place the scan backward's V tiles have rows a
    token row apart, which costs more than the copies save at D = 128 and on long sequences."""
    return pick(config.v_rows, max(D, DV) <= 64 and max_chunks < 64)


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
    """How the scan kernels address the rows of o and dO (``scan_forward``, "Rows of o and dO"): (o's shape, the
    row index, the number of tokens, (s_t, s_h) of contiguous o). In the chunk layout o is ``[H, NC, BT, DV]`` and
    row i of chunk n is n·BT + i (the index is not read); with ``token_rows = (tokens, B, T)`` o is
    ``[B, T, H, DV]`` and the row is ``tokens[n·BT + i]``, which the kernels read only where the layout has padding
    (more slots than tokens): without it (every sequence a whole number of chunks) it is n·BT + i as well."""
    if token_rows is None:
        return (H, NC, BT, DV), chunk_index, NC * BT, (DV, NC * BT * DV)
    tokens, B, T = token_rows
    return (B, T, H, DV), tokens, B * T, (H * DV, DV)


def _scan_fwd_fake(qs, ks, v, m, sd, gl, go, chunk_first, chunk_index, order, max_chunks, scale, programs, config):
    H, NC, BT, _ = qs.shape
    return (v.new_empty((H, NC, BT, v.shape[-1])),
            torch.empty((H, NC, BT), dtype=torch.float32, device=v.device))


def delta_pass(has_gate: bool, max_chunks: int, config: KernelConfig = DEFAULT) -> bool:
    """Whether the backward's δ_i = dO_i · o_i is formed by a Triton pass over dO and o before the scan
    (``scan_backward_by_chunk._delta_kernel``) rather than by the scan itself, from o: with the gate on sequences
    of 64 chunks or more, where the scan's registers are taken (``config.delta_pass`` pins it; the backward by
    sequence always takes the pass). Both take δ from the product that forms dP (``scan_backward_by_chunk``, "δ")."""
    return pick(config.delta_pass, has_gate and max_chunks >= 64)


def _delta(do, o, tok, n_tok, o_strides, H, NC, BT, prec):
    """δ = rowsum(dO ∘ o) in fp32, o's shape without its last dim (contiguous dO and o of one dtype), by the
    Triton pass (``_delta_kernel``): per (chunk, head) as the diagonal of the scan's own ``[BT, Dv] × [Dv, BT]``
    tile at the scan's precision ``prec``, the rows addressed as the scan addresses them (``tok``, ``n_tok``,
    ``o_strides``: ``_o_rows``)."""
    DV = o.shape[-1]
    so_t, so_h = o_strides
    delta = unwritten(o.shape[:-1], dtype=torch.float32, device=o.device)
    if NC:
        _delta_kernel[(NC, H)](do, o, delta, tok, n_tok, so_t, so_h, so_t // DV, so_h // DV, BT=BT, DV=DV,
                               PREC=prec, GATHER=n_tok != NC * BT, num_warps=4)
    return delta


def _scan_bwd_impl(do, qs, ks, v, m, sd, gl, go, o, lse, chunk_first, chunk_index, order, max_chunks, scale,
                   programs, config=0, into_inputs=False, token_rows=None, v_rows=False, states=None):
    """Backward scan: (dq̃, dk̃, dV, dM, dS_d, dG_local), fp32 except dV (v's dtype, in the chunk layout or, with
    ``token_rows``, in v's). dG_local is an empty tensor when there is no gate. ``programs`` = 0 picks the
    default number of persistent programs.
    ``into_inputs=True`` writes dq̃ into q̃'s buffer and dS_d into S_d's (fp32, contiguous; each work item reads
    its rows of both before it writes them), for a caller that owns q̃ and S_d. ``token_rows``: o and dO in
    ``[B, T, H, Dv]``, as in :func:`_scan_fwd_impl`, and dV returned in v's layout ``[B, T, Hkv, Dv]``.
    ``v_rows=True`` (with ``token_rows``): v is read in v's layout, as in :func:`_scan_fwd_impl`. ``states``: the
    carried states the forward kept (:func:`_scan_fwd_impl`), read instead of replayed; with them the backward
    runs by sequence where :func:`backward_by_sequence` says so (``scan_backward_by_sequence``: dV summed in
    registers and written once, in v's dtype and layout), else by query chunk, where dV is summed in the chunk
    layout (in fp32) and copied back: summed in v's layout by atomics a token row apart, it took longer."""
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
    cfg = config_of(config) if isinstance(config, int) else (config or DEFAULT)
    keep = _check_states(states, lowp, H, NC, int(max_chunks), BT, D)
    by_sequence = keep and backward_by_sequence(NC, int(max_chunks), Hkv, qs.device, cfg)
    # the kernel by sequence reads δ of a query chunk once per key chunk: a pass forms it
    by_pass = by_sequence or delta_pass(gl is not None, int(max_chunks), cfg)
    # δ = rowsum(dO ∘ o) in o's shape without its last dim (so its strides are o's over DV), formed by a pass or
    # by the kernel (which then never reads DELTA: o stands in)
    delta = _delta(do, o, tok, n_tok, (so_t, so_h), H, NC, BT, prec) if by_pass else o
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
                                     n_tok, (so_t, so_h), (sv_t, sv_h), v_rows, token_rows, max_chunks, scale, cfg)
    dks = torch.zeros((Hkv, NC, BT, D), **f32)
    dv = torch.zeros((Hkv, NC, BT, DV), **f32)
    dm = torch.zeros((Hkv, NC, D, D), **f32)
    dg = torch.zeros((H, NC, BT), **f32) if has_gate else torch.empty((0,), **f32)
    n_items = NC * H
    gather = n_tok != NC * BT
    num_warps, num_stages, per_sm, maxnreg = _launch_config("bwd", D, DV, cfg)
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
        LAMBDA_BF16=lambda_bf16(lowp), PREFETCH=prefetch(D, DV, cfg), DELTA_HERE=not by_pass,
        num_warps=num_warps, num_stages=num_stages, **_register_cap(maxnreg),
    )
    if token_rows is not None:
        dv = scatter_chunks(dv, token_rows[0], token_rows[1], token_rows[2], v.dtype)
    return dqs, dks, dv.to(v.dtype), dm, dsd, dg


def prefetch(D: int, DV: int, config: KernelConfig = DEFAULT) -> bool:
    """Whether the backward by query chunk loads the next carried state one pair ahead, hiding its latency: at
    D, Dv ≤ 64; at 128, where every register is taken, the extra tile costs more than it hides
    (``config.prefetch`` pins it)."""
    return pick(config.prefetch, max(D, DV) <= 64)


# The backward by sequence wants at least this many programs per multiprocessor (at the model's shape, T = 512 and
# B = 64 with 12 kv heads, it has 768 programs for an H200's 132 multiprocessors).
BY_SEQUENCE_PROGRAMS_PER_SM = 1


def backward_by_sequence(n_chunks: int, max_chunks: int, n_kv_heads: int, device,
                         config: KernelConfig = DEFAULT) -> bool:
    """Whether a backward given the forward's carried states runs by sequence (``scan_backward_by_sequence``: one
    program per sequence and kv head, no replay, no atomics) rather than by query chunk
    (``scan_backward_by_chunk``): when the sequences, at least n_chunks / max_chunks of them, times the kv heads
    give every multiprocessor a program (``config.by_sequence`` pins it). With few programs the order by query
    chunk, whose work items are (query chunk, head), keeps the GPU busier."""
    enough = (n_chunks // max(1, max_chunks)) * n_kv_heads >= BY_SEQUENCE_PROGRAMS_PER_SM * _num_sms(device)
    return pick(config.by_sequence, enough)


def _by_sequence_launch(config: KernelConfig = DEFAULT) -> tuple[int, int, int]:
    """(query chunks per tile R, num_warps, num_stages) of the backward by sequence: (1, 4, 2), the fastest
    measured at the model's shape (``config.by_sequence_launch`` overrides a leading part). Two stages let the
    pipeliner load the next pair's operands while a pair computes: its pairs are independent."""
    return launch(config.by_sequence_launch, (1, 4, 2))


def _scan_bwd_by_sequence(do, ks, v, m, sd, gl, go, lse, delta, states, dqs, dsd, chunk_first, tok, n_tok,
                          o_strides, v_strides, v_rows, token_rows, max_chunks, scale, config=DEFAULT):
    """The backward by sequence (``scan_backward_by_sequence``) for :func:`_scan_bwd_impl`, which prepared its
    inputs (k̃ and M in the scan's dtype, v as the kernels read it, δ) and the buffers of dq̃ and dS_d. Returns
    what that function returns; dV is written by the kernel in v's dtype, in v's layout with ``token_rows``."""
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
    R, num_warps, num_stages = _by_sequence_launch(config)
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
        LAMBDA_BF16=lambda_bf16(lowp),
        GATHER=gather, V_GATHER=gather and v_rows, num_warps=num_warps, num_stages=num_stages,
    )
    return dqs, dks, dv, dm, dsd, dg


def _scan_bwd_fake(do, qs, ks, v, m, sd, gl, go, o, lse, chunk_first, chunk_index, order, max_chunks, scale,
                   programs, config):
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
    qs, ks, v, m, sd, gl, go, chunk_first, chunk_index, order, max_chunks, scale, programs, config = inputs
    o, lse = output
    ctx.set_materialize_grads(False)  # the log-sum-exp's gradient is ignored: no zeros filled for it
    ctx.save_for_backward(qs, ks, v, m, sd, gl, go, o, lse, chunk_first, chunk_index, order)
    ctx.max_chunks, ctx.scale, ctx.programs, ctx.config = max_chunks, scale, programs, config


def _scan_backward(ctx, do, dlse):
    """Gradients of the forward op's tensor inputs from dO (the log-sum-exp is internal: its gradient is
    ignored). G = offset[chunk] + G_local, so the offsets' gradient is the per-chunk sum of dG_local."""
    qs, ks, v, m, sd, gl, go, o, lse, chunk_first, chunk_index, order = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    dqs, dks, dv, dm, dsd, dg = _scan_bwd(do, qs, ks, v, m, sd, gl, go, o, lse, chunk_first, chunk_index,
                                              order, ctx.max_chunks, ctx.scale, ctx.programs, ctx.config)
    dgl = dgo = None
    if gl is not None:
        dgl = dg
        dgo = dg.sum(-1).to(torch.float64)
    return dqs, dks, dv, dm, dsd, dgl, dgo, None, None, None, None, None, None, None


_scan_fwd.register_autograd(_scan_backward, setup_context=_scan_setup_context)
