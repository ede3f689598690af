"""Fast paths for the softmax-family variants, all causal, layout ``[B, T, H, D]``.

* NoPE, RoPE and accumulated rotations: fused SDPA after pre-rotation. With q̃_i = R(−Φ_i) q_i and
  k̃_j = R(−Φ_j) k_j, q̃_iᵀ k̃_j = q_iᵀ R(Φ_i − Φ_j) k_j. Value transport (Q/K/V) uses ṽ_j = R(−Φ_j) v_j and
  o_i ← R(Φ_i) o_i, so o_i = Σ_j α_ij R(Φ_i − Φ_j) v_j.
* ALiBi and FoX: FlexAttention with a ``score_mod`` for bf16 and fp16 inputs on CUDA (no T×T tensor). In fp32
  and fp64, and on the CPU (where FlexAttention has no backward), an additive-bias SDPA computed in query chunks
  (T×chunk at a time). If FlexAttention fails on a CUDA device, a one-time warning names the error and the
  chunked additive-bias path takes over.
* Accumulated rotations with a forget gate: the rotations' pre-rotation, then FoX's path on the rotated tensors.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from pathlab._checks import check_float_tensor, check_qkv, check_same_device, check_scale, expand_kv_heads
from pathlab.ops.positions import (accumulate_phases, alibi_slopes, cos_sin, rope_cos_sin, rotate_cos_sin,
                                   rotation_dtype)

CPU_QUERY_CHUNK = 1024
FLEX_BLOCK = 128  # FlexAttention's default tile
_flex_failure: str | None = None  # why FlexAttention was given up on in this process, if it was


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient.

    cuDNN's fused attention backward (torch 2.11 on an H200) returns wrong dq, dk, dv (relative error ≈ 1.4)
    when the output gradient arrives in the strided layout that the back-rotation of Q/K/V rotations produces;
    the flash, memory-efficient and math backends are right, and all four are right with a contiguous gradient.
    """

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _sdpa(q, k, v, scale):
    """Causal SDPA on ``[B, T, H, D]`` tensors (grouped kv heads expanded)."""
    H = q.shape[2]
    k, v = expand_kv_heads(k, H), expand_kv_heads(v, H)
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale
    )  # [B, H, T, Dv]
    return _ContiguousGrad.apply(o).transpose(1, 2)


def nope_attention(q, k, v, *, scale=None):
    """No positional encoding: s_ij = scale · q_iᵀ k_j."""
    check_qkv(q, k, v)
    return _sdpa(q, k, v, check_scale(scale, q.shape[-1]))


def rope_attention(q, k, v, *, base: float = 10000.0, scale=None, table=None):
    """RoPE: s_ij = scale · q_iᵀ R^{i−j} k_j, ω_b = base^(−2b/D).

    cos/sin of the phases come from :func:`~pathlab.ops.positions.rope_cos_sin`'s cached table, or from ``table``:
    a pair ``(cos, sin)`` of ``[≥T, D/2]`` tensors for positions 0, 1, … (fp32; fp64 for fp64 inputs).
    """
    _, T, _, _, D, _ = check_qkv(q, k, v)
    scale = check_scale(scale, D)
    cached = table is None
    if cached:
        cos, sin = rope_cos_sin(T, D, base, device=q.device, dtype=rotation_dtype(q.dtype))
    else:
        cos, sin = _check_rope_table(table, T, D, q)
    cos, sin = cos[None, :T, None, :], sin[None, :T, None, :]  # [1, T, 1, D/2]
    qr = rotate_cos_sin(q, cos, sin, inverse=True, cached_table=cached)
    kr = rotate_cos_sin(k, cos, sin, inverse=True, cached_table=cached)
    return _sdpa(qr, kr, v, scale)


def _check_rope_table(table, T: int, D: int, q):
    if not isinstance(table, (tuple, list)) or len(table) != 2:
        raise ValueError(f"table must be a pair (cos, sin) of [T, D/2] tensors, got {type(table).__name__}")
    for name, t in zip(("cos", "sin"), table):
        check_float_tensor(f"table {name}", t, 2)
        if t.shape[0] < T or t.shape[1] != D // 2:
            raise ValueError(f"table {name} must have shape [>= {T}, {D // 2}], got {tuple(t.shape)}")
        check_same_device(q, **{f"table {name}": t})
    return table


def _pre_rotate(q, k, v, theta, rotate_values: bool):
    """Check the rotation inputs and pre-rotate: q̃ = R(−Φ) q, k̃ = R(−Φ) k and, with ``rotate_values``,
    ṽ = R(−Φ) v (kv heads expanded to H where rotated). Returns (q̃, k̃, ṽ or v, cos Φ, sin Φ, D)."""
    B, T, H, Hkv, D, Dv = check_qkv(q, k, v)
    check_float_tensor("theta", theta, 4)
    if theta.shape != (B, T, H, D // 2):
        raise ValueError(f"theta must have shape [B, T, H, D/2] = {(B, T, H, D // 2)}, got {tuple(theta.shape)}")
    if rotate_values and Dv != D:
        raise ValueError(f"rotate_values needs v's head dim ({Dv}) equal to q's ({D})")
    check_same_device(q, theta=theta)
    phase = accumulate_phases(theta, dim=1)  # [B, T, H, D/2] fp64
    cos, sin = cos_sin(phase, rotation_dtype(q.dtype))  # taken once, shared by every rotation below
    qr = rotate_cos_sin(q, cos, sin, inverse=True)
    kr = rotate_cos_sin(expand_kv_heads(k, H), cos, sin, inverse=True)
    vr = rotate_cos_sin(expand_kv_heads(v, H), cos, sin, inverse=True) if rotate_values else v
    return qr, kr, vr, cos, sin, D


def rotation_attention(q, k, v, theta, *, rotate_values: bool = False, scale=None):
    """Accumulated SO(2) rotations: Φ_t = Σ_{s≤t} θ_s (fp64, mod 2π), s_ij = scale · q_iᵀ R(Φ_i − Φ_j) k_j.

    ``theta [B, T, H, D/2]``: per-token step angles of every query head (grouped kv heads are expanded, since
    each query head rotates its keys with its own angles). With ``rotate_values`` the output is
    o_i = Σ_j α_ij R(Φ_i − Φ_j) v_j (values transported along the path; needs Dv == D).
    """
    qr, kr, vr, cos, sin, D = _pre_rotate(q, k, v, theta, rotate_values)
    o = _sdpa(qr, kr, vr, check_scale(scale, D))
    return rotate_cos_sin(o, cos, sin) if rotate_values else o


# ----------------------------------------------------------------------------- additive-bias variants


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@functools.lru_cache(maxsize=8)
def _causal_block_mask(T: int, device: str, block: int = FLEX_BLOCK):
    """The causal FlexAttention block mask, built from its block structure: O((T/block)²) integers.

    ``create_block_mask`` would evaluate the mask on all T×T pairs (tens of GiB at 65K tokens). Query block i
    sees key blocks 0 … i−1 in full and block i through the causal ``mask_mod``.
    """
    from torch.nn.attention.flex_attention import BlockMask

    n = -(-T // block)
    rows = torch.arange(n, device=device, dtype=torch.int32)
    partial_count = torch.ones(1, 1, n, device=device, dtype=torch.int32)
    partial_index = rows.view(1, 1, n, 1).expand(1, 1, n, n).contiguous()  # column 0 holds block i itself
    full_count = rows.view(1, 1, n).clone()                                 # blocks 0 … i−1
    full_index = rows.view(1, 1, 1, n).expand(1, 1, n, n).contiguous()
    return BlockMask.from_kv_blocks(partial_count, partial_index, full_count, full_index, BLOCK_SIZE=block,
                                    mask_mod=_causal, seq_lengths=(T, T))


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    """FlexAttention compiled for the first shape it meets, and with symbolic batch and length once a second comes.

    Compiled with static shapes only, every new (B, T) recompiles, and past the compiler's recompile limit (8)
    ``flex_attention`` runs unfused, materialising the B·H·T² scores: an evaluation over eight lengths and two batch
    sizes got there, and at T = 65,536 with 12 heads that is 96 GiB.
    """
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _flex(q, k, v, scale, score_mod):
    T, H, Hkv = q.shape[1], q.shape[2], k.shape[2]
    o = _compiled_flex()(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        score_mod=score_mod, block_mask=_causal_block_mask(T, str(q.device)), scale=scale, enable_gqa=H != Hkv,
    )
    return o.transpose(1, 2)


def _chunked_bias_sdpa(q, k, v, scale, bias_fn, chunk: int = CPU_QUERY_CHUNK):
    """Causal SDPA with an additive bias, one query chunk at a time: bias_fn(i, j) -> ``[B|1, H, len(i), len(j)]``."""
    T, H = q.shape[1], q.shape[2]
    k, v = expand_kv_heads(k, H).transpose(1, 2), expand_kv_heads(v, H).transpose(1, 2)
    qh = q.transpose(1, 2)
    outputs = []
    for start in range(0, T, chunk):
        stop = min(start + chunk, T)
        i = torch.arange(start, stop, device=q.device)
        j = torch.arange(stop, device=q.device)
        bias = bias_fn(i, j).to(torch.promote_types(q.dtype, torch.float32))
        bias = bias.masked_fill(j[None, :] > i[:, None], float("-inf")).to(q.dtype)
        outputs.append(F.scaled_dot_product_attention(qh[:, :, start:stop], k[:, :, :stop], v[:, :, :stop],
                                                      attn_mask=bias, scale=scale))
    return torch.cat(outputs, dim=2).transpose(1, 2)


def _use_flex(q) -> bool:
    return _flex_route(q.device.type, q.dtype) and _flex_failure is None


def _flex_route(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ALiBi's and FoX's attention runs on FlexAttention: half-precision inputs on CUDA.

    fp32 inputs (the probes' forward) take the chunked SDPA: FlexAttention's template multiplies fp32 operands
    with IEEE fp32 products under PyTorch's default matmul precision, off the tensor cores, and is an order of
    magnitude slower than the chunked route there.
    """
    return device_type == "cuda" and dtype in (torch.float16, torch.bfloat16)


def _bias_attention(q, k, v, scale, score_mod, bias_fn):
    """FlexAttention with ``score_mod`` where :func:`_flex_route` says so, else (or if it fails) the chunked
    additive-bias SDPA."""
    global _flex_failure
    if _use_flex(q):
        try:
            return _flex(q, k, v, scale, score_mod)
        except Exception as err:  # a compiler or kernel failure: keep going, loudly, on the bias path
            _flex_failure = f"{type(err).__name__}: {err}"
            warnings.warn(f"FlexAttention failed ({_flex_failure[:300]}); ALiBi and FoX use the chunked "
                          "additive-bias SDPA from now on", RuntimeWarning, stacklevel=3)
    return _chunked_bias_sdpa(q, k, v, scale, bias_fn)


def alibi_attention(q, k, v, *, slopes=None, scale=None):
    """ALiBi: s_ij = scale · q_iᵀ k_j − m_h (i − j), slopes m_h from :func:`alibi_slopes` by default."""
    _, T, H, _, D, _ = check_qkv(q, k, v)
    scale = check_scale(scale, D)
    slopes = (alibi_slopes(H) if slopes is None else slopes).to(q.device, torch.float32)
    if slopes.shape != (H,):
        raise ValueError(f"slopes must have shape [H] = ({H},), got {tuple(slopes.shape)}")

    def score_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    def bias_fn(i, j):
        return -slopes[None, :, None, None] * (i[:, None] - j[None, :]).float()

    return _bias_attention(q, k, v, scale, score_mod, bias_fn)


def _check_gate(g, B: int, T: int, H: int, q) -> None:
    check_float_tensor("g", g, 3)
    if g.shape != (B, T, H):
        raise ValueError(f"g must have shape [B, T, H] = {(B, T, H)}, got {tuple(g.shape)}")
    check_same_device(q, g=g)


def _gated_attention(q, k, v, g, scale):
    """Causal softmax attention with FoX's bias G_i − G_j, G = cumsum(g) (fp32 at least), on ``[B, T, H, D]``."""
    G = torch.cumsum(g.to(torch.promote_types(g.dtype, torch.float32)), dim=1).transpose(1, 2).contiguous()  # [B, H, T]
    # FlexAttention differentiates a captured buffer only when the score function indexes it once: give the
    # query side and the key side each their own copy of G.
    G_query, G_key = G, G.clone()

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + G_query[b, h, q_idx] - G_key[b, h, kv_idx]

    def bias_fn(i, j):
        return G[:, :, i, None] - G[:, :, None, j]

    return _bias_attention(q, k, v, scale, score_mod, bias_fn)


def fox_attention(q, k, v, g, *, scale=None):
    """Forgetting attention: s_ij = scale · q_iᵀ k_j + (G_i − G_j), G = cumsum(g), g ``[B, T, H]`` ≤ 0."""
    B, T, H, _, D, _ = check_qkv(q, k, v)
    _check_gate(g, B, T, H, q)
    return _gated_attention(q, k, v, g, check_scale(scale, D))


def rotation_fox_attention(q, k, v, theta, g, *, rotate_values: bool = False, scale=None):
    """Accumulated SO(2) rotations with a forget gate: s_ij = scale · q_iᵀ R(Φ_i − Φ_j) k_j + (G_i − G_j).

    Φ_t = Σ_{s≤t} θ_s (fp64, mod 2π) from ``theta [B, T, H, D/2]`` as in :func:`rotation_attention`;
    G = cumsum(g) from the log forget gates ``g [B, T, H]`` ≤ 0 as in :func:`fox_attention` (the gate is not
    multiplied by ``scale``). With ``rotate_values``, o_i = Σ_j α_ij R(Φ_i − Φ_j) v_j (needs Dv == D).

    The rotation is applied before the attention (q̃ = R(−Φ) q, k̃ = R(−Φ) k, ṽ = R(−Φ) v, then o ← R(Φ) o), so
    FoX's fast path runs unchanged on the rotated tensors: FlexAttention on CUDA, the chunked bias SDPA on the CPU.
    The keys (and values) carry the query heads' own angles, so grouped kv heads are expanded.
    """
    qr, kr, vr, cos, sin, D = _pre_rotate(q, k, v, theta, rotate_values)
    B, T, H = q.shape[:3]
    _check_gate(g, B, T, H, q)
    # FlexAttention needs as many value heads as key heads, and the keys carry every query head's angles
    o = _gated_attention(qr, kr, expand_kv_heads(vr, H), g, check_scale(scale, D))
    return rotate_cos_sin(o, cos, sin) if rotate_values else o
