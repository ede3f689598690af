"""NoPE: no positional information at all; causality alone orders the tokens."""

from __future__ import annotations

from pathlab import reference
from pathlab._checks import expand_kv_heads
from pathlab.attention.base import PositionalAttention, ScoreTerms
from pathlab.ops.softmax import nope_attention


class NoPE(PositionalAttention):
    """s_ij = q_iᵀ k_j / √D."""

    def attend(self, q, k, v, *, x, idx=None):
        return nope_attention(q, k, v)

    def reference(self, q, k, v, *, x, idx=None):
        return reference.nope_attention(q, k, v, return_attention=True)

    def score_terms(self, x, idx=None):
        return ScoreTerms()

    def prefill(self, cache, q, k, v, *, x, idx=None):
        cache.append(expand_kv_heads(k, self.n_head), expand_kv_heads(v, self.n_head))
        return self.attend(q, k, v, x=x)

    def step(self, cache, q, k, v, *, x, idx=None):
        cache.append(expand_kv_heads(k, self.n_head), expand_kv_heads(v, self.n_head))
        return cache.attend(q, self.head_dim ** -0.5).to(q.dtype)
