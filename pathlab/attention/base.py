"""The positional part of an attention layer, and the cache it keeps for generation.

The attention block owns the q/k/v/o projections; a :class:`PositionalAttention` owns only what is positional
(angles, gates, Householder directions) and turns projected ``q, k, v [B, T, H, D]`` into the output
``o [B, T, H, Dv]``. Each variant has a fast path (:meth:`attend`) and a reference path (:meth:`reference`)
that also returns the ``[B, H, T, T]`` logits and probabilities for the probes, and describes its logits in
:meth:`~PositionalAttention.score_terms` so that the streamed probes (:mod:`pathlab.probes.scores`) can form them
at any length. Everything the model, the probes and the task runner need to know about a variant comes from these
methods and class attributes, so a new variant is one module plus one registry entry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class ScoreTerms:
    """The positional part of one layer's logits for a batch, as the streamed probes consume it:

        s_ij = q_iᵀ P_{i←j} k_j / √D  +  Σ_{l=j+1}^{i} g_l  −  m_h (i − j)     (j ≤ i)

    The transport P_{i←j} is the identity when neither ``phase`` nor ``householder`` is set; the rotation
    R(Φ_i − Φ_j) with ``phase`` (block b = the coordinate pair (x_b, x_{b+D/2}), so s_ij = R(−Φ_i)q_i · R(−Φ_j)k_j);
    the Householder product H_i ⋯ H_{j+1}, H_t = I − β_t w_t w_tᵀ, with ``householder``. The gate sum and the
    distance bias are not scaled by 1/√D. Tensors may stay in the model's dtype; the probes cast them to fp64.
    """

    phase: torch.Tensor | None = None  # [B, T, H, D/2] accumulated phases Φ_t (fp64)
    rotate_values: bool = False  # with ``phase``: values transported too, o_i = Σ_j α_ij R(Φ_i − Φ_j) v_j
    householder: tuple[torch.Tensor, torch.Tensor] | None = None  # (unit w [B, T, Hkv, D], β [B, T, Hkv])
    log_gate: torch.Tensor | None = None  # [B, T, H] log forget gates g_t ≤ 0
    slopes: torch.Tensor | None = None  # [H] distance slopes m_h

    @property
    def transported(self) -> bool:
        """Whether the logit carries a transport (the probes then also measure s⁰ = q_iᵀk_j/√D without it)."""
        return self.phase is not None or self.householder is not None


@dataclass
class AttentionRecord:
    """Pre- and post-softmax scores of one layer, ``[B, H, T, T]`` fp64 (−inf and 0 above the diagonal)."""

    logits: torch.Tensor
    probs: torch.Tensor


class PositionalAttention(nn.Module):
    """Base class. Subclasses implement :meth:`attend`, :meth:`reference`, :meth:`score_terms`, :meth:`prefill`
    and :meth:`step`, and set the class attributes below that apply to them."""

    #: the variant rotates coordinate pairs, so the head dimension must be even (checked by ``ModelConfig``)
    even_head_dim: bool = False
    #: :meth:`step_angles` returns per-token step angles (accumulated rotations; the M2 probes read them)
    has_step_angles: bool = False
    #: options that rerun the variant on its plain-PyTorch path after a fast kernel failed (the task suite's retry)
    fallback_options: dict = {}

    @classmethod
    def mixes(cls, **options) -> bool:
        """Whether the variant built with ``options`` transports keys by accumulated data-dependent or random steps,
        which can decorrelate scores over distance (the subjects of the M2 mixing claims). A fixed transport, such as
        RoPE's phases n·ω, can only dephase: the claims' control."""
        return False

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

    # ----------------------------------------------------------------- what the probes and the runner read
    def score_terms(self, x, idx=None) -> ScoreTerms:
        """The positional terms of the logits for layer input ``x [B, T, C]`` and tokens ``idx [B, T]``, computed
        for the whole batch as in the forward pass (same rounding)."""
        raise NotImplementedError(f"no streamed logits for attention module {type(self).__name__}: it does not "
                                  "implement score_terms")

    def step_angles(self, x, idx=None) -> torch.Tensor | None:
        """Step angles θ ``[B, T, H, D/2]`` whose running sums are the rotation phases; None for variants without
        (set :attr:`has_step_angles` when overriding)."""
        return None

    def kernel_backend(self, device) -> str | None:
        """The kernel backend this layer runs on ``device`` (e.g. "triton" or "torch") for variants that choose
        one; None otherwise."""
        return None

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

