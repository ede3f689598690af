"""RoPE: the static transition H = R, so s_ij = q_iᵀ R^{i−j} k_j / √D."""

from __future__ import annotations


from pathlab import reference
from pathlab._checks import expand_kv_heads
from pathlab.attention.base import PositionalAttention
from pathlab.ops.positions import rope_phases, rotate
from pathlab.ops.softmax import rope_attention


class RoPE(PositionalAttention):
    """Rotary position embedding with ω_b = base^(−2b/D) (``base`` configurable)."""

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

    def _phases(self, start: int, length: int, device):
        return rope_phases(start + length, self.head_dim, self.base, device=device)[start:][None, :, None, :]

    def prefill(self, cache, q, k, v, *, x, idx=None):
        phase = self._phases(0, k.shape[1], k.device)
        cache.append(rotate(expand_kv_heads(k, self.n_head), -phase), expand_kv_heads(v, self.n_head))
        return self.attend(q, k, v, x=x)

    def step(self, cache, q, k, v, *, x, idx=None):
        phase = self._phases(len(cache), 1, k.device)
        cache.append(rotate(expand_kv_heads(k, self.n_head), -phase), expand_kv_heads(v, self.n_head))
        return cache.attend(rotate(q, -phase), self.head_dim ** -0.5).to(q.dtype)
