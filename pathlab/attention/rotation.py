"""Accumulated SO(2) rotations: s_ij = q_iᵀ R(Φ_i − Φ_j) k_j / √D with Φ_t = Σ_{s≤t} θ_s (per head and block).

Step angles θ_{t,h,b} = ω_b ξ_{t,h,b}, ω_b the RoPE frequencies (ξ ≡ 1 is exactly RoPE):

* ``mode="random", table="token"`` (option A, docs/theory.md#angles): ξ = ξ_{h,b}(token), a frozen random table per
  layer, ξ ~ 1 + τ·U[−1, 1] (τ = ``dispersion``; τ = 1 gives U[0, 2]);
* ``mode="random", table="position"`` (option B, the i.i.d. assumption): ξ = ξ_{h,b}(t), drawn per position;
* ``mode="learned"``: ξ = 2σ(W_θ x_t + c), W_θ = 0 and c = 0 at initialisation, so training starts at RoPE.

Window-controlled angles (``mode="random", window=W``): the multiplicative ξ gives block b a window
W_b ∝ 1/(ω_b² Var ξ), far beyond any training length for the slow blocks, so those act like RoPE at long range.
With a window the angles are instead

    θ_{t,h,b} = ω_b + σ ε_{t,h,b},   ε ~ N(0, 1) i.i.d.,   σ² = 2 ln(1/ε₀) / W,   ε₀ = 0.05,

so every block has γ = |E e^{iθ}| = e^{−σ²/2} and mixing window W(ε₀) = ln ε₀ / ln γ = W, while the mean phase
stays RoPE's (E θ = ω_b). ε is keyed per position (``table="position"``: exactly the i.i.d. assumption) or per
token (``table="token"``: a frozen random table, where γ_b = |Σ_v p(v) e^{iθ_b(v)}| depends on the text).

The random tables are not stored: ξ (or ε) comes from a counter-based hash of (seed, layer, token or position,
head, block), so it is identical on every device, for every length, and costs no memory. The (seed, layer) salt
enters as a tensor (a buffer), not a Python number, so that every layer runs one and the same compiled graph: a
number would be baked into the graph and make ``torch.compile`` recompile per layer, and past its recompile limit
run the remaining layers eagerly.
With ``rotate_values`` the values are transported too (Q/K/V): o_i = Σ_j α_ij R(Φ_i − Φ_j) v_j.

``forget_gate=True`` adds FoX's gate (far-mass control, SPEC M8 (b)): s_ij = q_iᵀ R(Φ_i − Φ_j) k_j / √D +
Σ_{l=j+1}^{i} log f_l, f_l = σ(u_fᵀ x_l + b_f), one scalar per head, with FoX's own parameterisation
(:class:`~pathlab.attention.fox.ForgetGate`); the gate is not multiplied by 1/√D. Rotations are orthogonal, so
without a gate every logit is bounded by ‖q‖‖k‖/√D and the far mass tends to 1 as the context grows
(docs/theory.md#lower-bound); the gate's sum is unbounded below and breaks that premise.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from pathlab import reference
from pathlab._checks import expand_kv_heads
from pathlab.attention.base import PositionalAttention, ScoreTerms
from pathlab.attention.fox import ForgetGate
from pathlab.ops.positions import (TWO_PI, accumulate_phases, cos_sin, rope_frequencies, rotate_cos_sin,
                                   rotation_dtype)
from pathlab.ops.softmax import rotation_attention, rotation_fox_attention
from pathlab.reference.softmax import rotation_fox_attention as reference_rotation_fox_attention

_MASK32 = 0xFFFFFFFF
WINDOW_TOLERANCE = 0.05  # ε₀: the coherence at which a block counts as mixed, as in every probe


def window_sigma(window: float, eps: float = WINDOW_TOLERANCE) -> float:
    """σ with e^{−σ² W / 2} = ε₀, i.e. σ² = 2 ln(1/ε₀) / W: the angle noise whose blocks mix within W steps."""
    return math.sqrt(2.0 * math.log(1.0 / eps) / window)


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


def keyed_normal(index: torch.Tensor, n_head: int, n_block: int, key: torch.Tensor) -> torch.Tensor:
    """ε ~ N(0, 1) for every (index, head, block) under the mixed salt ``key``: ``index [B, T]`` int ->
    ``[B, T, H, n_block]`` fp64.

    Box–Muller on two uniforms of the same hash: block b takes the counters of blocks 2b and 2b + 1 of a
    2·n_block-block stream, so no counter is shared between (index, head, block) triples and the pair is
    independent. ε = √(−2 ln(1 − u₁)) cos(2π u₂); u₁ ∈ [0, 1) on a 2⁻³² grid, so 1 − u₁ ≥ 2⁻³² and |ε| ≤ 6.7
    (never log 0). Only the cosine branch is used, so neighbouring blocks stay independent. The counters wrap
    at 2³² (after 2³¹/(H·n_block) indices: 5.6M positions at 12 heads of dimension 64).
    """
    u = keyed_uniform(index, n_head, 2 * n_block, key).unflatten(-1, (n_block, 2))
    radius = torch.sqrt(-2.0 * torch.log1p(-u[..., 0]))
    return radius * torch.cos(TWO_PI * u[..., 1])


def _check_window(window):
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, numbers.Real) or not math.isfinite(window) or window <= 0:
        raise ValueError(f"window must be a finite number > 0 (tokens) or None, got {window!r}")
    return float(window)


class RotationAttention(PositionalAttention):
    """Accumulated SO(2) rotations of q and k (and v with ``rotate_values``); see the module docstring.

    Options: ``mode`` ("random" or "learned"), ``table`` ("token" = option A, "position" = option B),
    ``dispersion`` τ (ξ ~ 1 + τ·U[−1, 1]) or ``window`` W (θ = ω_b + σ ε, σ² = 2 ln(1/ε₀)/W; random mode only,
    not with a non-default τ), ``forget_gate`` (FoX's gate), ``base`` (of ω_b) and ``seed`` (of the random tables).
    """

    even_head_dim = True
    has_step_angles = True

    @classmethod
    def mixes(cls, *, mode="random", dispersion=1.0, window=None, **options) -> bool:
        """Learned angles (token-dependent), a window, or random angles of dispersion τ > 0; τ = 0 is RoPE."""
        return mode == "learned" or window is not None or dispersion > 0

    def __init__(self, *, mode: str = "random", rotate_values: bool = False, forget_gate: bool = False,
                 table: str = "token", dispersion: float = 1.0, window: float | None = None, base: float = 10000.0,
                 seed: int = 0, **common):
        super().__init__(**common)
        if mode not in ("random", "learned"):
            raise ValueError(f"mode must be 'random' or 'learned', got {mode!r}")
        if table not in ("token", "position"):
            raise ValueError(f"table must be 'token' (option A) or 'position' (option B), got {table!r}")
        if not isinstance(dispersion, (int, float)) or not 0 <= dispersion <= 1:
            raise ValueError(f"dispersion must be a number in [0, 1], got {dispersion!r}")
        window = _check_window(window)
        if window is not None and dispersion != 1.0:
            raise ValueError(f"window={window:g} and dispersion={dispersion!r} cannot be combined: the window sets "
                             "the angles' spread (θ = ω_b + σ ε); leave dispersion at its default")
        if window is not None and mode != "random":
            raise ValueError(f"window applies to mode='random' only, got mode={mode!r}")
        if not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        if not isinstance(forget_gate, bool):
            raise ValueError(f"forget_gate must be True or False, got {forget_gate!r}")
        self.mode, self.rotate_values, self.table = mode, bool(rotate_values), table
        self.dispersion, self.seed = float(dispersion), seed
        self.window = window
        self.sigma = None if window is None else window_sigma(window)
        self.register_buffer("omega", rope_frequencies(self.head_dim, base).float(), persistent=False)
        # the mixed (seed, layer) salt as a tensor: a graph input, so the layers share one compiled graph
        self.register_buffer("salt", salt_key(seed * 1_000_003 + self.layer_idx), persistent=False)
        if mode == "learned":
            self.angle_proj = nn.Linear(self.n_embd, self.n_head * self.head_dim // 2, bias=True)
            self.angle_proj.is_zero_init = True  # the model's initialiser leaves it at zero: exact RoPE at step 0
            nn.init.zeros_(self.angle_proj.weight)
            nn.init.zeros_(self.angle_proj.bias)
        # FoX's gate, parameterised and initialised as FoX's (the model's initialiser: weight ~ N(0, init_std), b = 0)
        self.gate = ForgetGate(self.n_embd, self.n_head) if forget_gate else None

    def extra_repr(self) -> str:
        extra = ""
        if self.mode == "random":
            spread = f"window={self.window:g}" if self.window is not None else f"dispersion={self.dispersion:g}"
            extra = f", table={self.table}, {spread}"
        return f"mode={self.mode}, rotate_values={self.rotate_values}, forget_gate={self.gate is not None}{extra}"

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
        if self.window is not None:  # θ = ω_b + σ ε: mean phase RoPE's, window W in every block
            return (omega + self.sigma * keyed_normal(index, self.n_head, n_block, self.salt)).float()
        u = keyed_uniform(index, self.n_head, n_block, self.salt)
        xi = 1.0 + self.dispersion * (2.0 * u - 1.0)
        return (omega * xi).float()

    def attend(self, q, k, v, *, x, idx=None):
        theta = self.angles(x, idx)
        if self.gate is None:
            return rotation_attention(q, k, v, theta, rotate_values=self.rotate_values)
        return rotation_fox_attention(q, k, v, theta, self.gate(x), rotate_values=self.rotate_values)

    def reference(self, q, k, v, *, x, idx=None):
        theta = self.angles(x, idx)
        if self.gate is None:
            return reference.rotation_attention(q, k, v, theta, rotate_values=self.rotate_values,
                                                return_attention=True)
        return reference_rotation_fox_attention(q, k, v, theta, self.gate(x), rotate_values=self.rotate_values,
                                                return_attention=True)

    def step_angles(self, x, idx=None):
        return self.angles(x, idx)

    def score_terms(self, x, idx=None):
        """Φ_t = Σ_{s≤t} θ_s, in fp64 (:func:`~pathlab.ops.positions.accumulate_phases`)."""
        return ScoreTerms(phase=accumulate_phases(self.angles(x, idx), dim=1), rotate_values=self.rotate_values,
                          log_gate=self.gate(x) if self.gate is not None else None)

    # ----------------------------------------------------------------- generation
    # The cache holds k̃_j = R(−Φ_j) k_j (and ṽ_j = R(−Φ_j) v_j), the running phase Φ_t and, with the gate, the gate
    # sums G_j = Σ_{l≤j} log f_l per key and the running G_t: a step then adds G_t − G_j to the logits, as FoX does.

    def _append(self, cache, k, v, cos, sin, g=None):
        """Append the rotated keys/values (and the gate sums G, returned ``[B, T, H]``, when ``g`` is given)."""
        k = rotate_cos_sin(expand_kv_heads(k, self.n_head), cos, sin, inverse=True)
        v = expand_kv_heads(v, self.n_head)
        G = None
        if g is not None:
            running = cache.state.get("G", torch.zeros_like(g[:, 0]))
            G = running[:, None] + torch.cumsum(g, dim=1)  # [B, T, H]
            cache.state["G"] = G[:, -1]
        cache.append(k, rotate_cos_sin(v, cos, sin, inverse=True) if self.rotate_values else v, G)
        return G

    def prefill(self, cache, q, k, v, *, x, idx=None):
        theta = self.angles(x, idx)
        g = self.gate(x) if self.gate is not None else None
        phase = accumulate_phases(theta, dim=1)  # [B, T, H, D/2] fp64
        cache.state["phase"] = phase[:, -1:]
        self._append(cache, k, v, *cos_sin(phase, rotation_dtype(k.dtype)), g)
        if g is None:
            return rotation_attention(q, k, v, theta, rotate_values=self.rotate_values)
        return rotation_fox_attention(q, k, v, theta, g, rotate_values=self.rotate_values)

    def step(self, cache, q, k, v, *, x, idx=None):
        theta = self.angles(x, idx, start=len(cache))
        phase = torch.remainder(cache.state["phase"] + theta.double(), TWO_PI)
        cache.state["phase"] = phase
        cos, sin = cos_sin(phase, rotation_dtype(q.dtype))
        G = self._append(cache, k, v, cos, sin, self.gate(x) if self.gate is not None else None)
        bias = None if G is None else (lambda G_j, G_t=G[:, 0, :, None]: G_t - G_j)  # [B, H, 1] − [B, H, L]
        o = cache.attend(rotate_cos_sin(q, cos, sin, inverse=True), self.head_dim ** -0.5, bias)
        return (rotate_cos_sin(o, cos, sin) if self.rotate_values else o).to(q.dtype)
