"""Accumulated SO(2) rotations: s_ij = q_iᵀ R(Φ_i − Φ_j) k_j / √D with Φ_t = Σ_{s≤t} θ_s (per head and block).

Step angles θ_{t,h,b} = ω_b ξ_{t,h,b}, ω_b the RoPE frequencies (ξ ≡ 1 is exactly RoPE):

* ``mode="random", table="token"`` (option A, docs/theory.md#angles): ξ = ξ_{h,b}(token), a frozen random table per
  layer, ξ ~ 1 + τ·U[−1, 1] (τ = ``dispersion``; τ = 1 gives U[0, 2]);
* ``mode="random", table="position"`` (option B, the i.i.d. assumption): ξ = ξ_{h,b}(t), drawn per position;
* ``mode="learned"``: ξ = 2σ(W_θ x_t + c), W_θ = 0 and c = 0 at initialisation, so training starts at RoPE.

The random tables are not stored: ξ comes from a counter-based hash of (seed, layer, token or position, head,
block), so it is identical on every device, for every length, and costs no memory. The (seed, layer) salt enters
as a tensor (a buffer), not a Python number, so that every layer runs one and the same compiled graph: a number
would be baked into the graph and make ``torch.compile`` recompile per layer, and past its recompile limit run
the remaining layers eagerly.
With ``rotate_values`` the values are transported too (Q/K/V): o_i = Σ_j α_ij R(Φ_i − Φ_j) v_j.
"""

from __future__ import annotations

import torch
from torch import nn

from pathlab import reference
from pathlab._checks import expand_kv_heads
from pathlab.attention.base import PositionalAttention
from pathlab.ops.positions import (TWO_PI, accumulate_phases, cos_sin, rope_frequencies, rotate_cos_sin,
                                   rotation_dtype)
from pathlab.ops.softmax import rotation_attention

_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (xorshift-multiply) in int64 arithmetic that never overflows."""
    for _ in range(2):
        x = x ^ (x >> 16)
        x = (x * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def salt_key(salt: int, device=None) -> torch.Tensor:
    """The mixed salt that :func:`keyed_uniform` takes: a 0-d int64 tensor."""
    return _hash32(torch.tensor(salt & _MASK32, dtype=torch.int64, device=device))


def keyed_uniform(index: torch.Tensor, n_head: int, n_block: int, key: torch.Tensor) -> torch.Tensor:
    """u ~ U[0, 1) for every (index, head, block) under the mixed salt ``key`` (:func:`salt_key`):
    ``index [B, T]`` int -> ``[B, T, H, n_block]`` fp64."""
    h = torch.arange(n_head, device=index.device)[:, None]
    b = torch.arange(n_block, device=index.device)[None, :]
    counter = (index.long()[..., None, None] * n_head + h) * n_block + b
    mixed = _hash32((counter & _MASK32) ^ key.to(index.device))
    return mixed.to(torch.float64) / 2.0**32


def hashed_uniform(index: torch.Tensor, n_head: int, n_block: int, salt: int) -> torch.Tensor:
    """u ~ U[0, 1) for every (index, head, block): ``index [B, T]`` int -> ``[B, T, H, n_block]`` fp64."""
    return keyed_uniform(index, n_head, n_block, salt_key(salt, index.device))


class RotationAttention(PositionalAttention):
    def __init__(self, *, mode: str = "random", rotate_values: bool = False, table: str = "token",
                 dispersion: float = 1.0, base: float = 10000.0, seed: int = 0, **common):
        super().__init__(**common)
        if mode not in ("random", "learned"):
            raise ValueError(f"mode must be 'random' or 'learned', got {mode!r}")
        if table not in ("token", "position"):
            raise ValueError(f"table must be 'token' (option A) or 'position' (option B), got {table!r}")
        if not isinstance(dispersion, (int, float)) or not 0 <= dispersion <= 1:
            raise ValueError(f"dispersion must be a number in [0, 1], got {dispersion!r}")
        if not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.mode, self.rotate_values, self.table = mode, bool(rotate_values), table
        self.dispersion, self.seed = float(dispersion), seed
        self.register_buffer("omega", rope_frequencies(self.head_dim, base).float(), persistent=False)
        # the mixed (seed, layer) salt as a tensor: a graph input, so the layers share one compiled graph
        self.register_buffer("salt", salt_key(seed * 1_000_003 + self.layer_idx), persistent=False)
        if mode == "learned":
            self.angle_proj = nn.Linear(self.n_embd, self.n_head * self.head_dim // 2, bias=True)
            self.angle_proj.is_zero_init = True  # the model's initialiser leaves it at zero: exact RoPE at step 0
            nn.init.zeros_(self.angle_proj.weight)
            nn.init.zeros_(self.angle_proj.bias)

    def extra_repr(self) -> str:
        extra = f", table={self.table}, dispersion={self.dispersion:g}" if self.mode == "random" else ""
        return f"mode={self.mode}, rotate_values={self.rotate_values}{extra}"

    def angles(self, x, idx=None, *, start: int = 0) -> torch.Tensor:
        """Step angles θ ``[B, T, H, D/2]`` fp32 for layer input ``x [B, T, C]`` and tokens ``idx [B, T]``;
        ``start`` is the position of the first token (for the per-position table while decoding)."""
        B, T = x.shape[:2]
        n_block = self.head_dim // 2
        omega = self.omega.to(x.device)
        if self.mode == "learned":
            a = self.angle_proj(x)
            xi = 2.0 * torch.sigmoid(a.to(torch.promote_types(a.dtype, torch.float32))).view(B, T, self.n_head, n_block)
            return omega * xi
        if self.table == "token":
            if idx is None:
                raise ValueError("random token-table rotations need the token ids idx [B, T]")
            index = idx
        else:
            index = torch.arange(start, start + T, device=x.device).expand(B, T)
        u = keyed_uniform(index, self.n_head, n_block, self.salt)
        xi = 1.0 + self.dispersion * (2.0 * u - 1.0)
        return (omega * xi).float()

    def attend(self, q, k, v, *, x, idx=None):
        return rotation_attention(q, k, v, self.angles(x, idx), rotate_values=self.rotate_values)

    def reference(self, q, k, v, *, x, idx=None):
        return reference.rotation_attention(q, k, v, self.angles(x, idx), rotate_values=self.rotate_values,
                                            return_attention=True)

    def _append(self, cache, k, v, cos, sin):
        k = rotate_cos_sin(expand_kv_heads(k, self.n_head), cos, sin, inverse=True)
        v = expand_kv_heads(v, self.n_head)
        cache.append(k, rotate_cos_sin(v, cos, sin, inverse=True) if self.rotate_values else v)

    def prefill(self, cache, q, k, v, *, x, idx=None):
        theta = self.angles(x, idx)
        phase = accumulate_phases(theta, dim=1)  # [B, T, H, D/2] fp64
        cache.state["phase"] = phase[:, -1:]
        self._append(cache, k, v, *cos_sin(phase, rotation_dtype(k.dtype)))
        return rotation_attention(q, k, v, theta, rotate_values=self.rotate_values)

    def step(self, cache, q, k, v, *, x, idx=None):
        theta = self.angles(x, idx, start=len(cache))
        phase = torch.remainder(cache.state["phase"] + theta.double(), TWO_PI)
        cache.state["phase"] = phase
        cos, sin = cos_sin(phase, rotation_dtype(q.dtype))
        self._append(cache, k, v, cos, sin)
        o = cache.attend(rotate_cos_sin(q, cos, sin, inverse=True), self.head_dim ** -0.5)
        return (rotate_cos_sin(o, cos, sin) if self.rotate_values else o).to(q.dtype)
