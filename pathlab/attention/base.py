"""The positional part of an attention layer, and the cache it keeps for generation.

The attention block owns the q/k/v/o projections; a :class:`PositionalAttention` owns only what is positional
(angles, gates, Householder directions) and turns projected ``q, k, v [B, T, H, D]`` into the output
``o [B, T, H, Dv]``. Each variant has a fast path (:meth:`attend`) and a reference path (:meth:`reference`)
that also returns the ``[B, H, T, T]`` logits and probabilities for the probes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn



@dataclass
class AttentionRecord:
    """Pre- and post-softmax scores of one layer, ``[B, H, T, T]`` fp64 (−inf and 0 above the diagonal)."""

    logits: torch.Tensor
    probs: torch.Tensor


class PositionalAttention(nn.Module):
    """Base class. Subclasses implement :meth:`attend`, :meth:`reference`, :meth:`prefill` and :meth:`step`."""

    def __init__(self, *, n_embd: int, n_head: int, n_kv_head: int, head_dim: int, vocab_size: int, layer_idx: int):
        super().__init__()
        self.n_embd, self.n_head, self.n_kv_head, self.head_dim = n_embd, n_head, n_kv_head, head_dim
        self.vocab_size, self.layer_idx = vocab_size, layer_idx

    def forward(self, q, k, v, *, x, idx=None, return_attention: bool = False):
        """o ``[B, T, H, Dv]``, or ``(o, AttentionRecord)`` through the fp64 reference path."""
        if return_attention:
            o, logits, probs = self.reference(q, k, v, x=x, idx=idx)
            return o, AttentionRecord(logits, probs)
        return self.attend(q, k, v, x=x, idx=idx)

    def attend(self, q, k, v, *, x, idx=None):
        raise NotImplementedError

    def reference(self, q, k, v, *, x, idx=None):
        """Returns ``(o, logits, probs)`` from :mod:`pathlab.reference`."""
        raise NotImplementedError

    # ----------------------------------------------------------------- generation
    def new_cache(self, batch: int, max_len: int, *, device, dtype) -> "SoftmaxCache":
        return SoftmaxCache(batch, self.n_head, max_len, self.head_dim, device=device, dtype=dtype)

    def prefill(self, cache, q, k, v, *, x, idx=None):
        """Process a prompt: fill ``cache`` and return the prompt's output (the parallel form)."""
        raise NotImplementedError

    def step(self, cache, q, k, v, *, x, idx=None):
        """One new token (``q, k, v [B, 1, ...]``): update ``cache`` and return o ``[B, 1, H, Dv]``."""
        raise NotImplementedError


class SoftmaxCache:
    """KV cache for softmax-family variants, preallocated, in fp32 (fp64 for an fp64 model).

    Holds per position j the transformed key k̃_j, value ṽ_j and one scalar per head (ALiBi's position j, FoX's
    G_j), plus whatever running state a variant needs (``self.state``: accumulated phases, gate sums, t).
    """

    def __init__(self, batch: int, n_head: int, max_len: int, head_dim: int, *, device, dtype=torch.float32):
        shape = (batch, n_head, max_len)
        work = torch.promote_types(dtype, torch.float32)
        self.keys = torch.zeros(*shape, head_dim, device=device, dtype=work)
        self.values = torch.zeros(*shape, head_dim, device=device, dtype=work)
        self.key_scalar = torch.zeros(*shape, device=device, dtype=work)
        self.length = 0
        self.max_len = max_len
        self.state: dict = {}

    def __len__(self) -> int:
        return self.length

    def append(self, keys, values, key_scalar=None):
        """keys/values ``[B, T, H, D]`` (kv heads already expanded to H), key_scalar ``[B, T, H]`` or None."""
        T = keys.shape[1]
        if self.length + T > self.max_len:
            raise ValueError(f"cache holds {self.max_len} tokens; cannot add {T} to {self.length}")
        span = slice(self.length, self.length + T)
        self.keys[:, :, span] = keys.transpose(1, 2)
        self.values[:, :, span] = values.transpose(1, 2)
        if key_scalar is not None:
            self.key_scalar[:, :, span] = key_scalar.transpose(1, 2)
        self.length += T

    def attend(self, q, scale: float, query_bias=None):
        """o = softmax(scale · q̃ K̃ᵀ + bias) Ṽ for one query ``q [B, 1, H, D]``; ``query_bias(key_scalar)`` gives
        the additive term ``[B, H, L]`` from the cached scalars. Returns ``[B, 1, H, Dv]`` in the cache's dtype."""
        L = self.length
        scores = torch.einsum("bhd,bhld->bhl", q[:, 0].to(self.keys.dtype), self.keys[:, :, :L]) * scale
        if query_bias is not None:
            scores = scores + query_bias(self.key_scalar[:, :, :L]).to(scores.dtype)
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("bhl,bhld->bhd", probs, self.values[:, :, :L])[:, None]

