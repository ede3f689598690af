"""ALiBi: s_ij = q_iᵀ k_j / √D − m_h (i − j), with the ALiBi paper's head slopes."""

from __future__ import annotations

import torch

from pathlab import reference
from pathlab._checks import expand_kv_heads
from pathlab.attention.base import PositionalAttention, ScoreTerms
from pathlab.ops.positions import alibi_slopes
from pathlab.ops.softmax import alibi_attention


class ALiBi(PositionalAttention):
    def __init__(self, **common):
        super().__init__(**common)
        self.register_buffer("slopes", alibi_slopes(self.n_head), persistent=False)

    def attend(self, q, k, v, *, x, idx=None):
        return alibi_attention(q, k, v, slopes=self.slopes)

    def reference(self, q, k, v, *, x, idx=None):
        return reference.alibi_attention(q, k, v, slopes=self.slopes, return_attention=True)

    def score_terms(self, x, idx=None):
        return ScoreTerms(slopes=self.slopes)

    def _append(self, cache, k, v):
        B, T = k.shape[:2]
        positions = torch.arange(len(cache), len(cache) + T, device=k.device, dtype=torch.float32)
        cache.append(expand_kv_heads(k, self.n_head), expand_kv_heads(v, self.n_head),
                     positions[None, :, None].expand(B, T, self.n_head))

    def prefill(self, cache, q, k, v, *, x, idx=None):
        self._append(cache, k, v)
        return self.attend(q, k, v, x=x)

    def step(self, cache, q, k, v, *, x, idx=None):
        self._append(cache, k, v)
        t = float(len(cache) - 1)
        slopes = self.slopes.to(q.device)[None, :, None]
        return cache.attend(q, self.head_dim ** -0.5, lambda pos: -slopes * (t - pos)).to(q.dtype)
