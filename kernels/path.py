"""``path_attention_triton``: PaTH / PaTH-FoX attention with the Triton scan, forward and backward.

s_ij = scale · q_iᵀ H_i H_{i−1} ⋯ H_{j+1} k_j + (G_i − G_j),  H_t = I − β_t w_t w_tᵀ,  G = cumsum(g)

(the gate is not multiplied by ``scale``: FoX's convention, the same as :func:`pathlab.reference.path_attention`).

Pipeline (all differentiable): chunk layout (``_layout``) → per-chunk UT transform in fp32 PyTorch (``_ut``) →
Triton scan (``_triton_path``, a custom autograd Function) → back to ``[B, T, H, Dv]``. Extra memory of the
backward is O(T·D) per head for the chunk factors and gradients, plus the persistent programs' scratch
(O(T·D) in all; see ``_triton_path``).
"""

from __future__ import annotations

import math
import os

import torch

from ._layout import build_layout, chunk_gate, from_chunks, to_chunks
from ._ut import ut_factors

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
LOG2E = 1.4426950408889634


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


def _launch_config(kind: str, D: int, DV: int):
    """(num_warps, num_stages, programs per SM) of the forward ("fwd") or backward ("bwd") kernel.

    Defaults were picked on an H200; ``PATHLAB_PATH_FWD="warps,stages"`` and
    ``PATHLAB_PATH_BWD="warps,stages,programs_per_sm"`` override them (used by the benchmark's ``--tune``).
    """
    import os

    big = max(D, DV) >= 128
    if kind == "fwd":
        default = (8 if big else 4, 2 if big else 3, 0)
    else:
        default = (8 if big else 4, 1, 2)
    env = os.environ.get("PATHLAB_PATH_FWD" if kind == "fwd" else "PATHLAB_PATH_BWD")
    if not env:
        return default
    parts = [int(x) for x in env.split(",")]
    return tuple(parts + list(default[len(parts):]))


def _lowp(dtype):
    """Dtype of the carried states, k̃, W and U inside the scan: fp16 for half inputs (bf16's 8-bit mantissa
    is too coarse for the low-rank factors; the public kernel's NaN fixes made the same choice), fp32 else."""
    return torch.float16 if dtype in (torch.float16, torch.bfloat16) else torch.float32


class _PathScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qs, ks, v, w, u, sd, gl, go, layout, scale, programs):
        from ._triton_path import _path_bwd_kernel, _path_fwd_kernel  # noqa: F401  (import checks triton)

        H, NC, BT, D = qs.shape
        Hkv, DV = v.shape[0], v.shape[-1]
        lowp = _lowp(v.dtype)
        prec = "ieee" if lowp == torch.float32 else "tf32"
        ks_l, w_l, u_l = ks.to(lowp).contiguous(), w.to(lowp).contiguous(), u.to(lowp).contiguous()
        o = torch.full((H, NC, BT, DV), float("nan"), dtype=v.dtype, device=v.device)
        lse = torch.full((H, NC, BT), float("nan"), dtype=torch.float32, device=v.device)
        has_gate = gl is not None
        num_warps, num_stages, _ = _launch_config("fwd", D, DV)
        gl_ = gl.contiguous() if has_gate else qs  # dummies are never read
        go_ = go.contiguous() if has_gate else qs
        _path_fwd_kernel[(NC, H)](
            qs, ks_l, v, w_l, u_l, sd, gl_, go_, o, lse, layout.chunk_first, layout.chunk_index,
            NC, scale * LOG2E,
            GROUP=H // Hkv, HAS_GATE=has_gate, BT=BT, D=D, DV=DV, PREC=prec,
            num_warps=num_warps, num_stages=num_stages,
        )
        ctx.save_for_backward(qs, ks_l, v, w_l, u_l, sd, gl, go, o, lse)
        ctx.layout, ctx.scale, ctx.programs = layout, scale, programs
        return o

    @staticmethod
    def backward(ctx, do):
        from ._triton_path import _path_bwd_kernel

        qs, ks_l, v, w_l, u_l, sd, gl, go, o, lse = ctx.saved_tensors
        layout, scale = ctx.layout, ctx.scale
        H, NC, BT, D = qs.shape
        Hkv, DV = v.shape[0], v.shape[-1]
        lowp = ks_l.dtype
        prec = "ieee" if lowp == torch.float32 else "tf32"
        do = do.to(v.dtype).contiguous()
        delta = (do.float() * o.float()).sum(-1).contiguous()  # δ_i = dO_i · o_i          [H, NC, BT]
        dev = qs.device
        f32 = dict(dtype=torch.float32, device=dev)
        dqs = torch.full((H, NC, BT, D), float("nan"), **f32)
        dsd = torch.full((H, NC, BT, BT), float("nan"), **f32)
        dks = torch.zeros((Hkv, NC, BT, D), **f32)
        dv = torch.zeros((Hkv, NC, BT, DV), **f32)
        dw = torch.zeros((Hkv, NC, BT, D), **f32)
        du = torch.zeros((Hkv, NC, BT, D), **f32)
        has_gate = gl is not None
        dg = torch.zeros((H, NC, BT), **f32) if has_gate else dqs
        n_items = NC * H
        num_warps, num_stages, per_sm = _launch_config("bwd", D, DV)
        programs = ctx.programs if ctx.programs is not None else per_sm * _num_sms(dev)
        programs = max(1, min(n_items, programs))
        scratch = torch.empty((programs, layout.max_chunks, BT, D), dtype=lowp, device=dev)
        _path_bwd_kernel[(programs,)](
            qs, ks_l, v, w_l, u_l, sd, gl if has_gate else qs, go if has_gate else qs, do, lse, delta,
            dqs, dks, dv, dw, du, dsd, dg, scratch,
            layout.chunk_first, layout.chunk_index, layout.order,
            NC, H, n_items, layout.max_chunks, scale, scale * LOG2E,
            GROUP=H // Hkv, HAS_GATE=has_gate, BT=BT, D=D, DV=DV, PREC=prec,
            PREC32="ieee" if lowp == torch.float32 else "tf32", num_warps=num_warps, num_stages=num_stages,
            NO_ATOMICS=os.environ.get("PATHLAB_PATH_BWD_PROFILE") == "no_atomics",
        )
        dgl = dgo = None
        if has_gate:
            dgl = dg
            dgo = dg.sum(-1).to(torch.float64)  # G_i = offset[chunk] + G_local[i]
        return dqs, dks, dv.to(v.dtype), dw, du, dsd, dgl, dgo, None, None, None


def _check(q, k, v, w, beta, g, cu_seqlens):
    for name, t in (("q", q), ("k", k), ("v", v), ("w", w), ("beta", beta)) + ((("g", g),) if g is not None else ()):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cuda" and not _interpreting():
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


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def path_attention_triton(q, k, v, w, beta, g=None, *, scale=None, cu_seqlens=None, block_size=None,
                          programs=None):
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
        block_size: chunk length BT (default 64; small values such as 16 exercise the chunking in tests).
        programs: persistent programs of the backward (default: a few per SM); the scratch is
            programs × (longest sequence) × D.

    Returns:
        o ``[B, T, H, Dv]`` in q's dtype.
    """
    _check(q, k, v, w, beta, g, cu_seqlens)
    B, T, H, D = q.shape
    scale = D ** -0.5 if scale is None else float(scale)
    if not scale > 0 or not math.isfinite(scale):
        raise ValueError(f"scale must be a positive number, got {scale!r}")
    BT = int(block_size or 64)
    if BT not in (16, 32, 64, 128):
        raise ValueError(f"block_size must be one of 16, 32, 64, 128, got {block_size!r}")
    if T == 0:
        return q.new_zeros(B, 0, H, v.shape[3])
    layout = build_layout(B, T, BT, q.device, cu_seqlens)
    if programs is not None and (not isinstance(programs, int) or programs < 1):
        raise ValueError(f"programs must be a positive int or None, got {programs!r}")
    f32 = torch.float32
    wn = torch.nn.functional.normalize(w.to(f32), dim=-1)
    qc = to_chunks(q.to(f32), layout)
    kc, wc, vc = to_chunks(k.to(f32), layout), to_chunks(wn, layout), to_chunks(v, layout)
    bc = to_chunks(beta.to(f32), layout)
    qs, ks, u, sd = ut_factors(qc, kc, wc, bc)
    gl = go = None
    if g is not None:
        gl, go = chunk_gate(to_chunks(g.to(f32), layout), layout)
    o = _PathScan.apply(qs, ks, vc, wc, u, sd, gl, go, layout, scale, programs)
    return from_chunks(o, layout).to(q.dtype)
