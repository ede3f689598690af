"""Input validation shared by the ops: every failure is a ``ValueError`` that names the argument.

Checks here only read shapes, dtypes and devices, never values, so they cost no device synchronisation.
Value checks (β in [0, 2], g ≤ 0) live in :func:`check_path_values`, called by the reference path, by model
construction and when ``PATHLAB_DEBUG=1``.
"""

from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def debug_enabled() -> bool:
    """``PATHLAB_DEBUG=1`` turns on value checks that synchronise with the device."""
    return os.environ.get("PATHLAB_DEBUG", "0") not in ("", "0", "false", "False")


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_float_tensor(name: str, t, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be a floating-point tensor (fp16, bf16, fp32 or fp64), got {t.dtype}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got {_describe(t)}")


def check_qkv(q, k, v) -> tuple[int, int, int, int, int, int]:
    """Check q ``[B, T, H, D]``, k ``[B, T, Hkv, D]``, v ``[B, T, Hkv, Dv]`` and return (B, T, H, Hkv, D, Dv)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float_tensor(name, t, 4)
    B, T, H, D = q.shape
    if k.shape[:2] != (B, T) or v.shape[:2] != (B, T):
        raise ValueError(
            f"q, k and v must share batch and length [B, T, ...]: q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    if k.shape[3] != D:
        raise ValueError(f"k must have the head dim of q ({D}), got k {tuple(k.shape)}")
    Hkv = k.shape[2]
    if v.shape[2] != Hkv:
        raise ValueError(f"v must have as many heads as k ({Hkv}), got v {tuple(v.shape)}")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"the query heads ({H}) must be a multiple of the key/value heads ({Hkv})")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    return B, T, H, Hkv, D, v.shape[3]


def check_same_device(ref: torch.Tensor, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but q is on {ref.device}: put every input on one device")


def check_path_inputs(q, k, v, w, beta, g=None):
    """Shapes for PaTH: w like k ``[B, T, Hkv, D]``, beta ``[B, T, Hkv]``, g ``[B, T, H]`` or None."""
    B, T, H, Hkv, D, Dv = check_qkv(q, k, v)
    check_float_tensor("w", w, 4)
    if w.shape != k.shape:
        raise ValueError(f"w must have the shape of k {tuple(k.shape)}, got {tuple(w.shape)}")
    check_float_tensor("beta", beta, 3)
    if beta.shape != (B, T, Hkv):
        raise ValueError(f"beta must have shape [B, T, Hkv] = {(B, T, Hkv)}, got {tuple(beta.shape)}")
    if g is not None:
        check_float_tensor("g", g, 3)
        if g.shape != (B, T, H):
            raise ValueError(f"g must have shape [B, T, H] = {(B, T, H)}, got {tuple(g.shape)}")
    check_same_device(q, w=w, beta=beta, g=g)
    return B, T, H, Hkv, D, Dv


def check_path_values(beta: torch.Tensor, g: torch.Tensor | None = None) -> None:
    """Value checks (these synchronise with the device): beta in [0, 2], g <= 0 and finite."""
    with torch.no_grad():
        if not bool(torch.isfinite(beta).all()) or bool((beta < 0).any()) or bool((beta > 2).any()):
            lo, hi = beta.min().item(), beta.max().item()
            raise ValueError(f"beta must lie in [0, 2] (finite), got values in [{lo:.4g}, {hi:.4g}]")
        if g is not None and (not bool(torch.isfinite(g).all()) or bool((g > 0).any())):
            raise ValueError(f"g must be finite log forget gates <= 0, got max {g.max().item():.4g}")


def check_scale(scale, D: int) -> float:
    if scale is None:
        return D ** -0.5
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        raise ValueError(f"scale must be a positive number, got {scale!r}")
    return float(scale)


def expand_kv_heads(t: torch.Tensor, n_heads: int, dim: int = 2) -> torch.Tensor:
    """Repeat key/value heads so that head h uses kv head h // (H / Hkv) (grouped-query attention)."""
    groups = n_heads // t.shape[dim]
    return t if groups == 1 else t.repeat_interleave(groups, dim=dim)


def normalize_w(w: torch.Tensor) -> torch.Tensor:
    """w / ‖w‖ per head, in fp32 (fp64 for fp64 inputs): PaTH needs unit w whatever the input dtype."""
    work = torch.promote_types(w.dtype, torch.float32)
    return torch.nn.functional.normalize(w.to(work), dim=-1)
