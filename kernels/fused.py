"""PaTH with the fused UT transform and the scan in one differentiable op that recomputes instead of saving.

    forward:   (q̃, k̃, M, S_d) = UT(q, k, w, β)        ``ut_forward`` kernels, reading the inputs in place
               (o, lse)        = scan(q̃, k̃, v, M, S_d, gate)
    backward:  (q̃, k̃, M, S_d) = UT(q, k, w, β)        again, from the saved inputs (A kept for the last step)
               (dq̃, dk̃, dv, dM, dS_d, dG) = scan backward;   (dq, dk, dw, dβ) = UT backward with that A

o and dO stay in the token layout ``[B, T, H, Dv]``: the scan kernels write and read their rows in place
(``scan_forward``, "Rows of o and dO"); v is read in its own layout or copied into chunks (``scan.v_in_token_rows``; again in
the backward), and dV goes back to v's layout. Autograd keeps only the inputs, o and the log-sum-exp, as
FlashAttention does: q̃ and S_d (fp32), k̃ and M (written by the UT kernel in the scan's dtype) and v's chunk copy live only inside the forward and inside the backward, at the price of one
more UT forward.
For long sequences the backward runs over groups of kv heads (with their query heads) one after the other, so
that the recomputed factors and their gradients exist for one group at a time (``head_groups``).
Used by :func:`kernels.path.path_attention_triton` with ``ut="triton"``; the two steps are the same
implementations as the separate ops (``pathlab::path_ut_*`` and ``pathlab::path_scan_*``), so their tests
cover the pieces and ``tests/test_kernels.py`` the whole.

The same op keeping the UT factors for the backward instead of recomputing them (``ut="triton_saved"``,
``path_saved_fwd``): one UT forward and one inversion per forward+backward instead of two each, for the memory of
q̃ and S_d (fp32), k̃ and M (in the scan's dtype) and A (fp32) per layer, and for short sequences the scan's carried
query states (``scan.forward_states``).
"""

from __future__ import annotations

import math

import torch

from .config import DEFAULT, KernelConfig, config_of
from .layout import gather_chunks, state_rows
from .runtime import unwritten
from .scan import _lowp, _scan_bwd_impl, _scan_fwd_impl, forward_states, v_in_token_rows
from .ut_backward import ut_backward
from .ut_forward import ut_forward

_FWD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor w, Tensor beta, Tensor v, Tensor? gl, Tensor? go, Tensor tokens, "
    "Tensor chunk_first, Tensor chunk_index, Tensor order, SymInt max_chunks, int block, float scale, "
    "int programs, int config) -> (Tensor, Tensor)"
)
_BWD_SCHEMA = (
    "(Tensor do, Tensor q, Tensor k, Tensor w, Tensor beta, Tensor v, Tensor? gl, Tensor? go, Tensor o, "
    "Tensor lse, Tensor tokens, Tensor chunk_first, Tensor chunk_index, Tensor order, SymInt max_chunks, "
    "int block, float scale, int programs, int config) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)


def _fwd_impl(q, k, w, beta, v, gl, go, tokens, chunk_first, chunk_index, order, max_chunks, block, scale,
              programs, config):
    """(o, lse): the UT forward and the scan (the factors are dropped; the backward recomputes them)."""
    return _fused_forward(q, k, w, beta, v, gl, go, tokens, chunk_first, chunk_index, order, max_chunks, block,
                          scale, programs, config_of(config))[:2]


def _fwd_fake(q, k, w, beta, v, gl, go, tokens, chunk_first, chunk_index, order, max_chunks, block, scale,
              programs, config):
    H, NC = q.shape[2], tokens.numel() // block
    return (v.new_empty((*q.shape[:3], v.shape[-1])),
            torch.empty((H, NC, block), dtype=torch.float32, device=v.device))


# The backward splits the heads only when some sequence spans this many chunks (4096 tokens at BT = 64): there the
# quadratic scan dwarfs the extra launches of a split (at the 512 tokens of model training it would not).
GROUPS_FROM_CHUNKS = 64
GROUP_MIB_DEFAULT = 256


def group_budget_bytes(config: KernelConfig = DEFAULT) -> int:
    """The backward's budget for one head group's factors and gradients: ``config.group_mib`` MiB (0 = never
    split), default 256: enough that the launches of a split stay few, small beside a long sequence's peak."""
    mib = GROUP_MIB_DEFAULT if config.group_mib is None else config.group_mib
    return mib * 2**20


def backward_bytes_per_kv_head(n_chunks, block, group, D, DV, scan_bytes, v_bytes) -> int:
    """What the recomputing backward allocates per kv head (with its ``group`` query heads), per chunk of BT rows:
    q̃ and S_d (fp32, then dq̃ and dS_d in their place), k̃ and M (scan dtype) with dk̃ and dM (fp32), A (fp32),
    v's chunk copy with dV (fp32, then v's dtype)."""
    BT = block
    per_chunk = (group * BT * (D + BT) * 4 + BT * D * (scan_bytes + 4) + D * D * (scan_bytes + 4) + BT * BT * 4
                 + BT * DV * (2 * v_bytes + 4))
    return n_chunks * per_chunk


def head_groups(n_kv_heads, per_kv_head_bytes, max_chunks, budget_bytes) -> list[slice]:
    """Slices of kv heads that the backward handles one after the other: all at once, unless some sequence spans
    at least ``GROUPS_FROM_CHUNKS`` chunks and all heads' buffers exceed ``budget_bytes``; then groups of as many
    heads as fit in the budget (one at the least), as few groups as that allows, of near-equal size.

    The peak of one forward+backward then holds o, dO, the input gradients, one group's buffers and the scan's
    scratch, instead of every head's buffers."""
    if budget_bytes <= 0 or max_chunks < GROUPS_FROM_CHUNKS or per_kv_head_bytes * n_kv_heads <= budget_bytes:
        return [slice(0, n_kv_heads)]
    n = math.ceil(n_kv_heads / max(1, budget_bytes // max(1, per_kv_head_bytes)))
    bounds = [round(i * n_kv_heads / n) for i in range(n + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def _bwd_impl(do, q, k, w, beta, v, gl, go, o, lse, tokens, chunk_first, chunk_index, order, max_chunks, block,
              scale, programs, config):
    """(dq, dk, dw, dβ, dv) in the inputs' shapes and dtypes, dG_local (empty without a gate), head group by head
    group (``head_groups``)."""
    cfg = config_of(config)
    Hkv = k.shape[2]
    G = q.shape[2] // Hkv
    per_head = backward_bytes_per_kv_head(tokens.numel() // block, block, G, q.shape[3], v.shape[3],
                                          _lowp(v.dtype).itemsize, v.element_size())
    budget = group_budget_bytes() if cfg == DEFAULT else group_budget_bytes(cfg)  # (tests patch the default's)
    groups = head_groups(Hkv, per_head, int(max_chunks), budget)
    args = (tokens, chunk_first, chunk_index, order, max_chunks, block, scale, programs, cfg)
    if len(groups) == 1:
        return _bwd_heads(do, q, k, w, beta, v, gl, go, o, lse, *args)
    # every head is some group's (NaN under the interpreter shows one that was not)
    outs = [unwritten(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, w, beta, v)]
    dg = unwritten(gl.shape if gl is not None else (0,), dtype=torch.float32, device=q.device)
    for kv in groups:
        hq = slice(kv.start * G, kv.stop * G)  # the query heads of these kv heads
        *grads, dg_part = _bwd_heads(do[:, :, hq], q[:, :, hq], k[:, :, kv], w[:, :, kv], beta[:, :, kv],
                                     v[:, :, kv], None if gl is None else gl[hq], None if go is None else go[hq],
                                     o[:, :, hq], lse[hq], *args)
        for out, heads in zip(outs, (hq, kv, kv, kv, kv)):
            out[:, :, heads] = grads.pop(0)  # each of the group's gradients freed once copied
        if gl is not None:
            dg[hq] = dg_part
        del dg_part
    return (*outs, dg)


def _bwd_heads(do, q, k, w, beta, v, gl, go, o, lse, tokens, chunk_first, chunk_index, order, max_chunks, block,
               scale, programs, config):
    """The backward for the heads given (all, or one group of kv heads with their query heads)."""
    # k̃ and M straight in the scan's dtype; A is kept for the UT backward below
    qs, ks, m, sd, a = ut_forward(q, k, w, beta, tokens, block, _lowp(v.dtype), config, scale)
    v_rows = v_in_token_rows(q.shape[3], v.shape[3], int(max_chunks), config)
    vc = v if v_rows else gather_chunks(v, tokens, block)
    # the factors are this function's own: dq̃ and dS_d overwrite q̃ and S_d, and the UT backward consumes the
    # gradients (their memory is reused as soon as each is read)
    grads = list(_scan_bwd_impl(do, qs, ks, vc, m, sd, gl, go, o, lse, chunk_first, chunk_index, order, max_chunks,
                                scale, programs, config, into_inputs=True, token_rows=(tokens, *v.shape[:2]),
                                v_rows=v_rows))
    del qs, ks, m, sd, vc
    return _ut_backward_after_scan(grads, q, k, w, beta, tokens, block, a, config)


def _ut_backward_after_scan(grads, q, k, w, beta, tokens, block, a, config):
    """(dq, dk, dw, dβ, dv, dG_local) from the scan backward's outputs ``grads`` (a list the UT backward
    consumes: the caller keeps no other reference to them; dV is already in v's layout)."""
    dg, dv = grads.pop(), grads.pop(2)
    dq, dk, dw, dbeta = ut_backward(grads, q, k, w, beta, tokens, block, a, consume=True, config=config)
    return dq, dk, dw, dbeta, dv, dg


def _bwd_fake(do, q, k, w, beta, v, gl, go, o, lse, tokens, chunk_first, chunk_index, order, max_chunks, block,
              scale, programs, config):
    dg = (torch.empty(gl.shape, dtype=torch.float32, device=q.device) if gl is not None
          else torch.empty((0,), dtype=torch.float32, device=q.device))
    return (*(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, w, beta, v)), dg)


path_fwd = torch.library.custom_op("pathlab::path_recompute_fwd", _fwd_impl, mutates_args=(), schema=_FWD_SCHEMA)
path_fwd.register_fake(_fwd_fake)
path_bwd = torch.library.custom_op("pathlab::path_recompute_bwd", _bwd_impl, mutates_args=(), schema=_BWD_SCHEMA)
path_bwd.register_fake(_bwd_fake)


def _setup_context(ctx, inputs, output):
    q, k, w, beta, v, gl, go, tokens, chunk_first, chunk_index, order, max_chunks, block, scale, programs, config = \
        inputs
    o, lse = output
    ctx.set_materialize_grads(False)  # the log-sum-exp's gradient is ignored: no zeros filled for it
    ctx.save_for_backward(q, k, w, beta, v, gl, go, o, lse, tokens, chunk_first, chunk_index, order)
    ctx.max_chunks, ctx.block, ctx.scale, ctx.programs, ctx.config = max_chunks, block, scale, programs, config


def _backward(ctx, do, dlse):
    """As the scan's backward: the log-sum-exp's gradient is ignored (it is internal), and the per-chunk gate
    offsets get the chunk sums of dG_local."""
    q, k, w, beta, v, gl, go, o, lse, tokens, chunk_first, chunk_index, order = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dw, dbeta, dv, dg = path_bwd(do, q, k, w, beta, v, gl, go, o, lse, tokens, chunk_first, chunk_index,
                                         order, ctx.max_chunks, ctx.block, ctx.scale, ctx.programs, ctx.config)
    dgl = dgo = None
    if gl is not None:
        dgl, dgo = dg, dg.sum(-1).to(torch.float64)
    return dq, dk, dw, dbeta, dv, dgl, dgo, None, None, None, None, None, None, None, None, None


path_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------------------
# The same op keeping the UT factors for the backward instead of recomputing them (``ut="triton_saved"``).

_SAVED_FWD_SCHEMA = _FWD_SCHEMA.replace(
    "-> (Tensor, Tensor)", "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
_SAVED_BWD_SCHEMA = (
    "(Tensor do, Tensor q, Tensor k, Tensor w, Tensor beta, Tensor v, Tensor? gl, Tensor? go, Tensor o, "
    "Tensor lse, Tensor qs, Tensor ks, Tensor m, Tensor sd, Tensor a, Tensor states, Tensor tokens, Tensor chunk_first, "
    "Tensor chunk_index, Tensor order, SymInt max_chunks, int block, float scale, int programs, int config) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)


def _states_shape(q, tokens, max_chunks, block, config):
    """Shape of the carried states the forward keeps (``scan.forward_states``), with no rows when it keeps none."""
    H, D, NC = q.shape[2], q.shape[3], tokens.numel() // block
    rows = state_rows(NC, int(max_chunks)) if forward_states(int(max_chunks), config) else 0
    return (H, rows, block, D)


def _states_buffer(shape, tokens, batch, max_chunks, block, dtype, device):
    """The buffer the forward scan writes the carried states into (``shape`` from :func:`_states_shape`)."""
    if shape[0] * shape[1] and tokens.numel() == batch * max_chunks * block:
        # every sequence spans max_chunks chunks (a padded batch, or one sequence): the kernel writes every row
        # but the spare last one (``layout.state_rows``), zeroed so that no element of the output is undefined
        states = unwritten(shape, dtype=dtype, device=device)
        states[:, -1].zero_()
        return states
    return torch.zeros(shape, dtype=dtype, device=device)  # packed sequences of different lengths leave gaps


def _fused_forward(q, k, w, beta, v, gl, go, tokens, chunk_first, chunk_index, order, max_chunks, block, scale,
                   programs, config, states_shape=None):
    """(o, lse, q̃, k̃, M, S_d, A, states): the UT forward and the scan; the scan keeps its carried query states
    when ``states_shape`` has rows, else states is None."""
    lowp = _lowp(v.dtype)
    qs, ks, m, sd, a = ut_forward(q, k, w, beta, tokens, block, lowp, config, scale)
    v_rows = v_in_token_rows(q.shape[3], v.shape[3], int(max_chunks), config)
    vc = v if v_rows else gather_chunks(v, tokens, block)
    states = None
    if states_shape is not None and states_shape[1]:
        states = _states_buffer(states_shape, tokens, v.shape[0], int(max_chunks), block, lowp, q.device)
    o, lse = _scan_fwd_impl(qs, ks, vc, m, sd, gl, go, chunk_first, chunk_index, order, max_chunks, scale, programs,
                            config, token_rows=(tokens, *v.shape[:2]), v_rows=v_rows, states=states)
    return o, lse, qs, ks, m, sd, a, states


def _saved_fwd_impl(q, k, w, beta, v, gl, go, tokens, chunk_first, chunk_index, order, max_chunks, block, scale,
                    programs, config):
    """(o, lse) and what the backward needs: q̃, k̃ and M in the scan's dtype, S_d, A, and the carried query states
    (in the scan's dtype; no rows unless ``scan.forward_states``)."""
    cfg = config_of(config)
    shape = _states_shape(q, tokens, max_chunks, block, cfg)
    *out, states = _fused_forward(q, k, w, beta, v, gl, go, tokens, chunk_first, chunk_index, order, max_chunks,
                                  block, scale, programs, cfg, shape)
    if states is None:
        states = torch.empty(shape, dtype=_lowp(v.dtype), device=q.device)
    return (*out, states)


def _saved_fwd_fake(q, k, w, beta, v, gl, go, tokens, chunk_first, chunk_index, order, max_chunks, block, scale,
                    programs, config):
    H, D, Hkv, NC = q.shape[2], q.shape[3], k.shape[2], tokens.numel() // block
    f32, low = dict(dtype=torch.float32, device=q.device), dict(dtype=_lowp(v.dtype), device=q.device)
    return (*_fwd_fake(q, k, w, beta, v, gl, go, tokens, chunk_first, chunk_index, order, max_chunks, block, scale,
                       programs, config),
            torch.empty((H, NC, block, D), **f32), torch.empty((Hkv, NC, block, D), **low),
            torch.empty((Hkv, NC, D, D), **low), torch.empty((H, NC, block, block), **f32),
            torch.empty((Hkv, NC, block, block), **f32),
            torch.empty(_states_shape(q, tokens, max_chunks, block, config_of(config)), **low))


def _saved_bwd_impl(do, q, k, w, beta, v, gl, go, o, lse, qs, ks, m, sd, a, states, tokens, chunk_first, chunk_index,
                    order, max_chunks, block, scale, programs, config):
    cfg = config_of(config)
    v_rows = v_in_token_rows(q.shape[3], v.shape[3], int(max_chunks), cfg)
    vc = v if v_rows else gather_chunks(v, tokens, block)
    grads = list(_scan_bwd_impl(do, qs, ks, vc, m, sd, gl, go, o, lse, chunk_first, chunk_index, order, max_chunks,
                                scale, programs, cfg, token_rows=(tokens, *v.shape[:2]), v_rows=v_rows,
                                states=states if states.shape[1] else None))
    del vc
    return _ut_backward_after_scan(grads, q, k, w, beta, tokens, block, a, cfg)


def _saved_bwd_fake(do, q, k, w, beta, v, gl, go, o, lse, qs, ks, m, sd, a, states, tokens, chunk_first, chunk_index,
                    order, max_chunks, block, scale, programs, config):
    return _bwd_fake(do, q, k, w, beta, v, gl, go, o, lse, tokens, chunk_first, chunk_index, order, max_chunks, block,
                     scale, programs, config)


path_saved_fwd = torch.library.custom_op("pathlab::path_saved_fwd", _saved_fwd_impl, mutates_args=(),
                                         schema=_SAVED_FWD_SCHEMA)
path_saved_fwd.register_fake(_saved_fwd_fake)
path_saved_bwd = torch.library.custom_op("pathlab::path_saved_bwd", _saved_bwd_impl, mutates_args=(),
                                         schema=_SAVED_BWD_SCHEMA)
path_saved_bwd.register_fake(_saved_bwd_fake)


def _saved_setup_context(ctx, inputs, output):
    q, k, w, beta, v, gl, go, tokens, chunk_first, chunk_index, order, max_chunks, block, scale, programs, config = \
        inputs
    # the factors' and the log-sum-exp's gradients are ignored: autograd would otherwise fill a zero tensor for
    # each of them in every backward
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, w, beta, v, gl, go, *output, tokens, chunk_first, chunk_index, order)
    ctx.max_chunks, ctx.block, ctx.scale, ctx.programs, ctx.config = max_chunks, block, scale, programs, config


def _saved_backward(ctx, do, dlse, *factor_grads):
    """As ``_backward``; the factors are internal outputs, so their gradients are ignored."""
    q, k, w, beta, v, gl, go, o, lse, qs, ks, m, sd, a, states, tokens, chunk_first, chunk_index, order = \
        ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dw, dbeta, dv, dg = path_saved_bwd(do, q, k, w, beta, v, gl, go, o, lse, qs, ks, m, sd, a, states, tokens,
                                               chunk_first, chunk_index, order, ctx.max_chunks, ctx.block, ctx.scale,
                                               ctx.programs, ctx.config)
    dgl = dgo = None
    if gl is not None:
        dgl, dgo = dg, dg.sum(-1).to(torch.float64)
    return dq, dk, dw, dbeta, dv, dgl, dgo, None, None, None, None, None, None, None, None, None


path_saved_fwd.register_autograd(_saved_backward, setup_context=_saved_setup_context)
