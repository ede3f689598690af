"""PaTH and PaTH-FoX: data-dependent Householder-like transitions H_t = I − β_t w_t w_tᵀ.

Parameterisation (PaTH §3, as in the public layer):
* w_t: a rank-``w_rank`` projection (a plain projection with grouped kv heads), a causal depthwise convolution
  of width ``conv_size`` with SiLU, then an L2 norm per head (inside :func:`pathlab.path_attention`, in fp32);
* β_t = 2σ(b_proj(x_t)) ∈ (0, 2), optionally clipped at ``beta_max`` < 2 (advisable in bf16 training);
* PaTH-FoX adds a forget gate g_t = log σ(g_proj(x_t)) per query head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pathlab import reference
from pathlab._checks import normalize_w
from pathlab.attention.base import PositionalAttention, ScoreTerms
from pathlab.attention.fox import ForgetGate
from pathlab.ops.path import BACKENDS, path_attention, resolve_backend
from pathlab.ops.short_conv import causal_conv_silu


@dataclass
class PathGenerationCache:
    """What PaTH keeps while generating: the key cache and the last inputs of the short convolution."""

    keys: object  # pathlab.decoding.PathDecodeCache
    conv_tail: torch.Tensor | None = None  # [B, conv_size − 1, Hkv·D] pre-convolution projections

    def __len__(self) -> int:
        return len(self.keys)


class PaTH(PositionalAttention):
    fallback_options = {"backend": "torch"}  # the blockwise PyTorch path, when a Triton kernel fails

    @classmethod
    def mixes(cls, **options) -> bool:
        """Always: every H_t = I − β_t w_t w_tᵀ depends on its token."""
        return True

    def __init__(self, *, use_gate: bool = False, w_rank: int = 32, conv_size: int = 3, beta_max: float | None = None,
                 backend: str = "auto", chunk_size: int = 64, **common):
        super().__init__(**common)
        if beta_max is not None and not (isinstance(beta_max, (int, float)) and 0 < beta_max <= 2):
            raise ValueError(f"beta_max must be a number in (0, 2] or None, got {beta_max!r}")
        if not isinstance(conv_size, int) or conv_size < 1:
            raise ValueError(f"conv_size must be a positive integer, got {conv_size!r}")
        if not isinstance(w_rank, int) or w_rank < 0:
            raise ValueError(f"w_rank must be a non-negative integer (0 = full rank), got {w_rank!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.beta_max, self.backend, self.chunk_size, self.conv_size = beta_max, backend, chunk_size, conv_size
        kv_dim = self.n_kv_head * self.head_dim
        if w_rank and self.n_kv_head == self.n_head:
            self.w_proj = nn.Sequential(nn.Linear(self.n_embd, w_rank, bias=False), nn.Linear(w_rank, kv_dim, bias=False))
        else:
            self.w_proj = nn.Linear(self.n_embd, kv_dim, bias=False)
        self.w_conv = nn.Parameter(torch.empty(kv_dim, conv_size))  # depthwise causal filter per channel
        nn.init.uniform_(self.w_conv, -conv_size**-0.5, conv_size**-0.5)
        self.beta_proj = nn.Linear(self.n_embd, self.n_kv_head, bias=True)
        self.gate = ForgetGate(self.n_embd, self.n_head) if use_gate else None

    def extra_repr(self) -> str:
        return f"gate={self.gate is not None}, beta_max={self.beta_max}, backend={self.backend}"

    def _conv(self, w_pre: torch.Tensor, tail: torch.Tensor | None = None) -> torch.Tensor:
        """Causal depthwise convolution + SiLU over time: ``[B, T, kv_dim]`` -> same; ``tail`` holds the
        preceding ``conv_size − 1`` inputs (zeros at the start of a sequence).

        out_t = silu(Σ_k x_{t−K+1+k} ⊙ f_k), f = ``w_conv [C, K]``, summed in fp32 at least
        (:func:`pathlab.ops.short_conv.causal_conv_silu`: on CUDA the op ``pathlab::short_conv_silu``)."""
        return causal_conv_silu(w_pre, self.w_conv, tail)

    def path_inputs(self, x, *, conv_tail=None):
        """(w ``[B, T, Hkv, D]`` unnormalised, β ``[B, T, Hkv]`` fp32, g ``[B, T, H]`` fp32 or None)."""
        B, T = x.shape[:2]
        w = self._conv(self.w_proj(x), conv_tail).view(B, T, self.n_kv_head, self.head_dim)
        b = self.beta_proj(x)
        beta = 2.0 * torch.sigmoid(b.to(torch.promote_types(b.dtype, torch.float32)))
        if self.beta_max is not None:
            beta = beta.clamp(max=self.beta_max)
        g = self.gate(x) if self.gate is not None else None
        return w, beta, g

    def attend(self, q, k, v, *, x, idx=None):
        w, beta, g = self.path_inputs(x)
        return path_attention(q, k, v, w, beta, g, backend=self.backend, chunk_size=self.chunk_size)

    def reference(self, q, k, v, *, x, idx=None):
        w, beta, g = self.path_inputs(x)
        return reference.path_attention(q, k, v, w, beta, g, return_attention=True)

    def score_terms(self, x, idx=None):
        w, beta, g = self.path_inputs(x)
        return ScoreTerms(householder=(normalize_w(w), beta), log_gate=g)

    def kernel_backend(self, device):
        return resolve_backend(self.backend, device)

    # ----------------------------------------------------------------- generation
    def new_cache(self, batch: int, max_len: int, *, device, dtype):
        from pathlab.decoding import PathDecodeCache

        keys = PathDecodeCache(batch, self.n_kv_head, max_len, self.head_dim, self.head_dim,
                               n_heads=self.n_head, device=device)
        return PathGenerationCache(keys)

    def _tail(self, x, cache):
        w_pre = self.w_proj(x)
        previous = cache.conv_tail if cache.conv_tail is not None else w_pre.new_zeros(x.shape[0], 0, w_pre.shape[-1])
        cache.conv_tail = torch.cat((previous, w_pre), dim=1)[:, -(self.conv_size - 1):] if self.conv_size > 1 else None

    def prefill(self, cache, q, k, v, *, x, idx=None):
        w, beta, g = self.path_inputs(x)
        self._tail(x, cache)
        return cache.keys.prefill(q, k, v, w, beta, g)

    def step(self, cache, q, k, v, *, x, idx=None):
        tail = cache.conv_tail
        if tail is not None and tail.shape[1] < self.conv_size - 1:  # prompt shorter than the filter
            tail = torch.cat((tail.new_zeros(tail.shape[0], self.conv_size - 1 - tail.shape[1], tail.shape[2]), tail), 1)
        w, beta, g = self.path_inputs(x, conv_tail=tail)
        self._tail(x, cache)
        return cache.keys.step(q, k, v, w, beta, g)
