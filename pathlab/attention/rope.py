"""RoPE: the static transition H = R, so s_ij = q_iᵀ R^{i−j} k_j / √D."""

from __future__ import annotations


from pathlab import reference
from pathlab._checks import expand_kv_heads
from pathlab.attention.base import PositionalAttention, ScoreTerms
from pathlab.ops.positions import rope_cos_sin, rope_phases, rotate_cos_sin, rotation_dtype
from pathlab.ops.softmax import rope_attention


class RoPE(PositionalAttention):
    """Rotary position embedding with ω_b = base^(−2b/D) (``base`` configurable).

    cos/sin of the phases come from one table per (head dim, base, device, dtype), shared by every layer and
    call (:func:`~pathlab.ops.positions.rope_cos_sin`).
    """

    even_head_dim = True

    def __init__(self, *, base: float = 10000.0, **common):
        super().__init__(**common)
        if not isinstance(base, (int, float)) or not base > 1:
            raise ValueError(f"rope base must be a number > 1, got {base!r}")
        self.base = float(base)

    def extra_repr(self) -> str:
        return f"base={self.base:g}"

    def attend(self, q, k, v, *, x, idx=None):
        return rope_attention(q, k, v, base=self.base)

    def reference(self, q, k, v, *, x, idx=None):
        return reference.rope_attention(q, k, v, base=self.base, return_attention=True)

    def score_terms(self, x, idx=None):
        """Φ_t = t ω_b, the same for every window and head."""
        B, T = x.shape[:2]
        phase = rope_phases(T, self.head_dim, self.base, device=x.device)  # [T, D/2] fp64
        return ScoreTerms(phase=phase[None, :, None, :].expand(B, T, self.n_head, self.head_dim // 2))

    def _cos_sin(self, start: int, length: int, like):
        """cos/sin of positions start … start + length − 1, ``[1, length, 1, D/2]``, for tensors like ``like``."""
        cos, sin = rope_cos_sin(length, self.head_dim, self.base, start=start, device=like.device,
                                dtype=rotation_dtype(like.dtype))
        return cos[None, :, None, :], sin[None, :, None, :]

    def _append(self, cache, k, v, cos, sin):
        k = rotate_cos_sin(expand_kv_heads(k, self.n_head), cos, sin, inverse=True)
        cache.append(k, expand_kv_heads(v, self.n_head))

    def prefill(self, cache, q, k, v, *, x, idx=None):
        self._append(cache, k, v, *self._cos_sin(0, k.shape[1], k))
        return self.attend(q, k, v, x=x)

    def step(self, cache, q, k, v, *, x, idx=None):
        cos, sin = self._cos_sin(len(cache), 1, k)
        self._append(cache, k, v, cos, sin)
        return cache.attend(rotate_cos_sin(q, cos, sin, inverse=True), self.head_dim ** -0.5).to(q.dtype)
