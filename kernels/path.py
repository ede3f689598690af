"""``path_attention_triton``: PaTH / PaTH-FoX attention with the Triton kernels, forward and backward.

s_ij = scale · q_iᵀ H_i H_{i−1} ⋯ H_{j+1} k_j + (G_i − G_j),  H_t = I − β_t w_t w_tᵀ,  G = cumsum(g)

(the gate is not multiplied by ``scale``: FoX's convention, the same as :func:`pathlab.reference.path_attention`).

Pipeline (all differentiable): chunk layout (``layout``) → per-chunk UT transform in fp32 (``ut_torch`` in
PyTorch, or the fused kernels ``ut_forward``/``ut_backward``) → the scan (``scan``: ``scan_forward``,
``scan_backward_by_chunk``, ``scan_backward_by_sequence``) → back to ``[B, T, H, Dv]``. The scan and the fused
routes are custom ops joined by ``register_autograd``, so ``torch.compile`` treats them as opaque calls and
traces and fuses the rest. Extra memory of the backward is O(T·D) per head for the chunk factors and gradients,
plus the scan's scratch (O(T·D) in all).
"""

from __future__ import annotations

import math

import torch

from .config import KernelConfig, config_id
from .fused import path_fwd, path_saved_fwd
from .layout import build_layout, chunk_gate, from_chunks, slot_tokens, to_chunks
from .runtime import interpreting
from .scan import _scan_fwd
from .ut_torch import ut_factors

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)


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
    """``"torch"``, ``"triton"`` or ``"triton_saved"`` for input q; ``None`` or ``"auto"``: for CUDA tensors

    * D ≤ 64: the fused kernels keeping their factors for the backward (``"triton_saved"``: one UT forward fewer,
      for more memory kept per layer; ``"triton"`` is the low-memory choice);
    * D = 128: the fused kernels recomputing their factors (``"triton"``): there the saved factors cost more
      memory than the second UT forward costs time;

    the PyTorch transform on the CPU, where every route is tested explicitly."""
    name = "auto" if name is None else name
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
                          programs=None, ut=None, config: KernelConfig | None = None):
    """PaTH (PaTH-FoX with ``g``) attention by the Triton kernel, differentiable in every input.

    Args:
        q: ``[B, T, H, D]`` fp16, bf16 or fp32; D in {16, 32, 64, 128}.
        k, w: ``[B, T, Hkv, D]`` (H a multiple of Hkv; query head h uses kv head h // (H/Hkv)). w is
            passed raw (the dispatcher does too) and normalised here in fp32.
        v: ``[B, T, Hkv, Dv]``, Dv in {16, 32, 64, 128}.
        beta: ``[B, T, Hkv]`` in (0, 2) (upcast to fp32).
        g: ``[B, T, H]`` log forget gates (≤ 0) or None (upcast to fp32; G summed in fp64 across chunks).
        scale: logit scale, default 1/√D; the gate is not scaled.
        cu_seqlens: int32 ``[N + 1]`` boundaries of packed sequences (FlashAttention's convention; B == 1).
        block_size: chunk length BT (default 64; small values such as 16 exercise the chunking in tests).
        programs: persistent programs of the backward by query chunk (default: a few per SM); the scratch is
            programs × (longest sequence) × D. The backward by sequence (``backward_by_sequence``) has one program
            per sequence and kv head instead.
        ut: how the per-chunk UT transform runs: ``"torch"`` (PyTorch ops, their intermediates saved),
            ``"triton"`` (fused kernels reading the inputs in place, in one op with the scan that recomputes
            the UT factors in its backward, ``fused``; same results within fp32 rounding),
            ``"triton_saved"`` (the same kernels keeping the factors, and for short sequences the scan's carried
            states, for the backward: one UT forward fewer; without gradients, as in evaluation, ``"triton"``
            runs instead) or ``"auto"``/None (on CUDA ``"triton_saved"`` at D ≤ 64 and ``"triton"`` at D = 128,
            else ``"torch"``).
        config: a :class:`kernels.config.KernelConfig` of launch tunables and pinned routes (benchmarks, tests);
            None: every choice by the code.

    Returns:
        o ``[B, T, H, Dv]`` in q's dtype.

    Non-finite inputs (``pathlab.ops.path``, "Non-finite inputs"): sequences of the batch and ``cu_seqlens``
    segments never reach one another (the gate's chunk offsets are summed per sequence, ``layout.chunk_gate``);
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
    BT = int(block_size or 64)
    if BT not in (16, 32, 64, 128):
        raise ValueError(f"block_size must be one of 16, 32, 64, 128, got {BT}")
    if T == 0:
        return q.new_zeros(B, 0, H, v.shape[3])
    layout = build_layout(B, T, BT, q.device, cu_seqlens)
    if programs is not None and (not isinstance(programs, int) or programs < 1):
        raise ValueError(f"programs must be a positive int or None, got {programs!r}")
    gl = go = None
    if g is not None:
        gl, go = chunk_gate(to_chunks(g.to(torch.float32), layout), layout)
    meta = (layout.chunk_first, layout.chunk_index, layout.order, layout.max_chunks)
    cid = config_id(config)
    if ut == "triton":  # fused UT kernels + scan in one op that recomputes the UT factors in its backward
        o, _ = path_fwd(q, k, w, beta, v, gl, go, slot_tokens(layout, B, T), *meta, BT, scale, programs or 0, cid)
        return o  # [B, T, H, Dv] in v's dtype (q's)
    if ut == "triton_saved":  # the same, keeping the factors for the backward instead of recomputing them
        return path_saved_fwd(q, k, w, beta, v, gl, go, slot_tokens(layout, B, T), *meta, BT, scale,
                              programs or 0, cid)[0]
    qs, ks, m, sd = _ut_factors_torch(q, k, w, beta, layout)
    o, _ = _scan_fwd(qs, ks, to_chunks(v, layout), m, sd, gl, go, *meta, scale, programs or 0, cid)
    return from_chunks(o, layout).to(q.dtype)
