"""Explicit fp64 references for the softmax-family variants: every logit is written as its definition.

They materialise ``[B, H, T, T]`` and are meant for tests and small probes (T up to a few thousand).
"""

from __future__ import annotations

import torch

from pathlab._checks import check_float_tensor, check_qkv, check_same_device, check_scale, expand_kv_heads
from pathlab.ops.positions import alibi_slopes, rope_frequencies


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).to(torch.float64)  # [B, T, H, D] -> [B, H, T, D]


def causal_softmax_output(logits: torch.Tensor, v: torch.Tensor, out_dtype, return_attention: bool):
    """α = softmax over j ≤ i of ``logits [B, H, T, T]``; o_i = Σ_j α_ij v_j with ``v [B, H, T, Dv]``
    (or ``v [B, H, T, T, Dv]`` holding a per-pair transported value ṽ_ij). Returns o ``[B, T, H, Dv]``."""
    T = logits.shape[-1]
    future = torch.ones(T, T, dtype=torch.bool, device=logits.device).triu(1)
    logits = logits.masked_fill(future, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if v.ndim == 5:
        o = torch.einsum("bhij,bhijd->bhid", probs, v)
    else:
        o = probs @ v
    o = o.transpose(1, 2).to(out_dtype)
    return (o, logits, probs) if return_attention else o


def _prepare(q, k, v, scale):
    B, T, H, Hkv, D, Dv = check_qkv(q, k, v)
    scale = check_scale(scale, D)
    k, v = expand_kv_heads(k, H), expand_kv_heads(v, H)
    return _heads_first(q), _heads_first(k), _heads_first(v), scale


def nope_attention(q, k, v, *, scale=None, return_attention=False):
    """s_ij = scale · q_iᵀ k_j."""
    out_dtype = q.dtype
    q, k, v, scale = _prepare(q, k, v, scale)
    return causal_softmax_output(scale * q @ k.transpose(-1, -2), v, out_dtype, return_attention)


def _rotated_logits(q, k, delta):
    """s_ij = q_iᵀ R(Δ_ij) k_j with R acting on half-split pairs; ``delta [B|1, H|1, T, T, D/2]``."""
    half = q.shape[-1] // 2
    q1, q2 = q[..., :half], q[..., half:]
    k1, k2 = k[..., :half], k[..., half:]
    cos, sin = torch.cos(delta), torch.sin(delta)
    # (R k)_1 = k1 cos − k2 sin,  (R k)_2 = k1 sin + k2 cos
    rk1 = k1[:, :, None] * cos - k2[:, :, None] * sin  # [B, H, T(i), T(j), D/2]
    rk2 = k1[:, :, None] * sin + k2[:, :, None] * cos
    return (q1[:, :, :, None] * rk1 + q2[:, :, :, None] * rk2).sum(-1)


def _rotated_values(v, delta):
    """ṽ_ij = R(Δ_ij) v_j: ``[B, H, T, T, Dv]``."""
    half = v.shape[-1] // 2
    v1, v2 = v[..., :half][:, :, None], v[..., half:][:, :, None]
    cos, sin = torch.cos(delta), torch.sin(delta)
    return torch.cat((v1 * cos - v2 * sin, v1 * sin + v2 * cos), dim=-1)


def rope_attention(q, k, v, *, base=10000.0, scale=None, return_attention=False):
    """s_ij = scale · q_iᵀ R^{i−j} k_j, R = blockdiag(R(ω_b)), ω_b = base^(−2b/D)."""
    out_dtype, T, D = q.dtype, q.shape[1], q.shape[-1]
    q, k, v, scale = _prepare(q, k, v, scale)
    pos = torch.arange(T, dtype=torch.float64, device=q.device)
    delta = (pos[:, None] - pos[None, :])[..., None] * rope_frequencies(D, base, device=q.device)
    return causal_softmax_output(scale * _rotated_logits(q, k, delta[None, None]), v, out_dtype, return_attention)


def _check_theta(theta, q) -> None:
    B, T, H = q.shape[:3]
    check_float_tensor("theta", theta, 4)
    if theta.shape != (B, T, H, q.shape[-1] // 2):
        raise ValueError(f"theta must have shape [B, T, H, D/2] = {(B, T, H, q.shape[-1] // 2)}, got {tuple(theta.shape)}")
    check_same_device(q, theta=theta)


def _check_gate(g, q) -> None:
    B, T, H = q.shape[:3]
    check_float_tensor("g", g, 3)
    if g.shape != (B, T, H):
        raise ValueError(f"g must have shape [B, T, H] = {(B, T, H)}, got {tuple(g.shape)}")
    check_same_device(q, g=g)


def _rotation_terms(q, k, v, theta, rotate_values):
    """Unscaled logits q_iᵀ R(Φ_i − Φ_j) k_j ``[B, H, T, T]`` and the values (ṽ_ij = R(Φ_i − Φ_j) v_j
    ``[B, H, T, T, Dv]`` with ``rotate_values``, else v) for heads-first fp64 q, k, v; Φ = cumsum θ in fp64."""
    phi = torch.cumsum(theta.to(torch.float64), dim=1).transpose(1, 2)  # [B, H, T, D/2]
    delta = phi[:, :, :, None] - phi[:, :, None, :]  # [B, H, T(i), T(j), D/2]
    return _rotated_logits(q, k, delta), (_rotated_values(v, delta) if rotate_values else v)


def _gate_bias(g):
    """Σ_{l=j+1}^{i} g_l = G_i − G_j, G = cumsum g in fp64: ``g [B, T, H]`` -> ``[B, H, T, T]``."""
    G = torch.cumsum(g.to(torch.float64), dim=1).transpose(1, 2)  # [B, H, T]
    return G[:, :, :, None] - G[:, :, None, :]


def rotation_attention(q, k, v, theta, *, rotate_values=False, scale=None, return_attention=False):
    """Accumulated SO(2) rotations: Φ_t = Σ_{s≤t} θ_s, s_ij = scale · q_iᵀ R(Φ_i − Φ_j) k_j.

    With ``rotate_values`` the value is transported too: o_i = Σ_j α_ij R(Φ_i − Φ_j) v_j.
    ``theta [B, T, H, D/2]`` are the per-token step angles.
    """
    _check_theta(theta, q)
    out_dtype = q.dtype
    q, k, v, scale = _prepare(q, k, v, scale)
    logits, values = _rotation_terms(q, k, v, theta, rotate_values)
    return causal_softmax_output(scale * logits, values, out_dtype, return_attention)


def rotation_fox_attention(q, k, v, theta, g, *, rotate_values=False, scale=None, return_attention=False):
    """Accumulated SO(2) rotations with a forget gate: the rotation logit plus FoX's gate sum,
    s_ij = scale · q_iᵀ R(Φ_i − Φ_j) k_j + Σ_{l=j+1}^{i} g_l, g = log f ≤ 0 ``[B, T, H]`` (not scaled).

    ``theta [B, T, H, D/2]``; with ``rotate_values`` o_i = Σ_j α_ij R(Φ_i − Φ_j) v_j. With g = 0 this is
    :func:`rotation_attention`, with θ = 0 it is :func:`fox_attention`.
    """
    _check_theta(theta, q)
    _check_gate(g, q)
    out_dtype = q.dtype
    q, k, v, scale = _prepare(q, k, v, scale)
    logits, values = _rotation_terms(q, k, v, theta, rotate_values)
    return causal_softmax_output(scale * logits + _gate_bias(g), values, out_dtype, return_attention)


def alibi_attention(q, k, v, *, slopes=None, scale=None, return_attention=False):
    """s_ij = scale · q_iᵀ k_j − m_h (i − j)."""
    out_dtype, T, H = q.dtype, q.shape[1], q.shape[2]
    slopes = alibi_slopes(H) if slopes is None else slopes
    q, k, v, scale = _prepare(q, k, v, scale)
    pos = torch.arange(T, dtype=torch.float64, device=q.device)
    distance = pos[:, None] - pos[None, :]
    bias = -slopes.to(q.device, torch.float64)[:, None, None] * distance
    return causal_softmax_output(scale * q @ k.transpose(-1, -2) + bias, v, out_dtype, return_attention)


def fox_attention(q, k, v, g, *, scale=None, return_attention=False):
    """Forgetting attention: s_ij = scale · q_iᵀ k_j + Σ_{l=j+1}^{i} g_l, with g = log f ≤ 0 ``[B, T, H]``."""
    _check_gate(g, q)
    out_dtype = q.dtype
    q, k, v, scale = _prepare(q, k, v, scale)
    return causal_softmax_output(scale * q @ k.transpose(-1, -2) + _gate_bias(g), v, out_dtype, return_attention)
