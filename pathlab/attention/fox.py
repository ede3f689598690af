"""FoX (forgetting attention): s_ij = q_iᵀ k_j / √D + Σ_{l=j+1}^{i} log f_l, f_l = σ(u_fᵀ x_l + b_f) per head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pathlab import reference
from pathlab._checks import expand_kv_heads
from pathlab.attention.base import PositionalAttention, ScoreTerms
from pathlab.ops.softmax import fox_attention


class ForgetGate(nn.Module):
    """g_t = log σ(W x_t + b): one log forget gate ≤ 0 per head, ``[B, T, H]``."""

    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.proj = nn.Linear(n_embd, n_head, bias=True)

    def forward(self, x):
        logits = self.proj(x)
        return F.logsigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32)))


class FoX(PositionalAttention):
    def __init__(self, **common):
        super().__init__(**common)
        self.gate = ForgetGate(self.n_embd, self.n_head)

    def attend(self, q, k, v, *, x, idx=None):
        return fox_attention(q, k, v, self.gate(x))

    def reference(self, q, k, v, *, x, idx=None):
        return reference.fox_attention(q, k, v, self.gate(x), return_attention=True)

    def score_terms(self, x, idx=None):
        return ScoreTerms(log_gate=self.gate(x))

    def _append(self, cache, k, v, g):
        running = cache.state.get("G", torch.zeros_like(g[:, 0]))
        G = running[:, None] + torch.cumsum(g, dim=1)  # [B, T, H] gate sums G_t
        cache.state["G"] = G[:, -1]
        cache.append(expand_kv_heads(k, self.n_head), expand_kv_heads(v, self.n_head), G)
        return G

    def prefill(self, cache, q, k, v, *, x, idx=None):
        g = self.gate(x)
        self._append(cache, k, v, g)
        return fox_attention(q, k, v, g)

    def step(self, cache, q, k, v, *, x, idx=None):
        G_t = self._append(cache, k, v, self.gate(x))[:, 0, :, None]  # [B, H, 1]
        return cache.attend(q, self.head_dim ** -0.5, lambda G_j: G_t - G_j).to(q.dtype)
