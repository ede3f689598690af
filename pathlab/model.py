"""A nanoGPT-style decoder whose attention variant is picked by name.

Pre-LayerNorm blocks, GELU MLP, tied input/output embeddings, no absolute position embedding: every
positional signal comes from the attention variant (:mod:`pathlab.attention`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pathlab._checks import debug_enabled
from pathlab.attention.registry import REGISTRY, attention_class, build_attention


@dataclass
class ModelConfig:
    """Model hyper-parameters. The paper setting is 16 layers, width 768, 12 heads (``ModelConfig.paper()``)."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    vocab_size: int = 50304
    attention: str = "rope"
    attention_kwargs: dict = field(default_factory=dict)
    n_kv_head: int | None = None  # grouped-query attention when smaller than n_head
    mlp_ratio: int = 4
    dropout: float = 0.0
    bias: bool = False
    init_std: float = 0.02

    def __post_init__(self):
        for name in ("n_layer", "n_head", "n_embd", "vocab_size", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if not isinstance(self.n_kv_head, int) or self.n_kv_head < 1 or self.n_head % self.n_kv_head:
            raise ValueError(f"ModelConfig.n_kv_head must divide n_head ({self.n_head}), got {self.n_kv_head!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"ModelConfig.n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if self.attention not in REGISTRY:
            raise ValueError(f"ModelConfig.attention: unknown attention {self.attention!r}; known: {', '.join(REGISTRY)}")
        if not isinstance(self.attention_kwargs, dict):
            raise ValueError(f"ModelConfig.attention_kwargs must be a dict, got {type(self.attention_kwargs).__name__}")
        if not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"ModelConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if not isinstance(self.init_std, (int, float)) or not self.init_std > 0:
            raise ValueError(f"ModelConfig.init_std must be positive, got {self.init_std!r}")
        if attention_class(self.attention).even_head_dim and self.head_dim % 2:
            raise ValueError(f"attention {self.attention!r} needs an even head dim, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def paper(cls, attention: str = "rope", **overrides) -> "ModelConfig":
        """The theory paper's setting: 16 layers, width 768, 12 heads (d_h = 64), GPT-2 vocabulary."""
        return cls(n_layer=16, n_head=12, n_embd=768, vocab_size=50304, attention=attention, **overrides)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig keys {unknown}; valid keys are {sorted(known)}")
        return cls(**d)


class CausalSelfAttention(nn.Module):
    """q/k/v/o projections around a positional variant."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        qkv_dim = (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim
        self.c_attn = nn.Linear(cfg.n_embd, qkv_dim, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=cfg.bias)
        self.c_proj.is_residual_projection = True
        self.positional = build_attention(
            cfg.attention, n_embd=cfg.n_embd, n_head=cfg.n_head, n_kv_head=cfg.n_kv_head, head_dim=cfg.head_dim,
            vocab_size=cfg.vocab_size, layer_idx=layer_idx, **cfg.attention_kwargs,
        )
        self.dropout = nn.Dropout(cfg.dropout)

    def _qkv(self, x):
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).split(
            [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim], dim=-1
        )
        return (q.view(B, T, self.n_head, self.head_dim), k.view(B, T, self.n_kv_head, self.head_dim),
                v.view(B, T, self.n_kv_head, self.head_dim))

    def _out(self, o):
        return self.dropout(self.c_proj(o.reshape(*o.shape[:2], -1)))

    def forward(self, x, idx=None, return_attention: bool = False):
        q, k, v = self._qkv(x)
        out = self.positional(q, k, v, x=x, idx=idx, return_attention=return_attention)
        if return_attention:
            o, record = out
            return self._out(o), record
        return self._out(out)

    def forward_cached(self, x, idx, cache, prefill: bool):
        q, k, v = self._qkv(x)
        run = self.positional.prefill if prefill else self.positional.step
        return self._out(run(cache, q, k, v, x=x, idx=idx))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.is_residual_projection = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg, layer_idx)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x, idx=None, return_attention: bool = False):
        record = None
        if return_attention:
            a, record = self.attn(self.ln_1(x), idx, return_attention=True)
        else:
            a = self.attn(self.ln_1(x), idx)
        x = x + a
        x = x + self.mlp(self.ln_2(x))
        return (x, record) if return_attention else x

    def forward_cached(self, x, idx, cache, prefill: bool):
        x = x + self.attn.forward_cached(self.ln_1(x), idx, cache, prefill)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied embeddings
        self.apply(self._init_weights)

    def _init_weights(self, module):
        std = self.config.init_std
        if isinstance(module, nn.Linear) and not getattr(module, "is_zero_init", False):
            if getattr(module, "is_residual_projection", False):
                std = std / math.sqrt(2 * self.config.n_layer)  # GPT-2's scaled residual init
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Parameter count (tied embeddings counted once); ``non_embedding`` leaves the token embedding out."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wte.weight.numel() if non_embedding else n

    def _check_idx(self, idx, name="idx", low=0):
        if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int64, torch.int32) or idx.ndim != 2:
            got = f"{idx.dtype}, shape {tuple(idx.shape)}" if isinstance(idx, torch.Tensor) else type(idx).__name__
            raise ValueError(f"{name} must be an integer tensor [B, T] of token ids, got {got}")
        # The id range is a value check: free on the CPU, a device synchronisation elsewhere, and a graph break
        # under torch.compile. So it runs on CPU tensors outside compilation, and on any device with
        # PATHLAB_DEBUG=1; training corpora are range-checked once when opened (pathlab.data.tokens).
        if idx.numel() == 0 or torch.compiler.is_compiling() or (idx.device.type != "cpu" and not debug_enabled()):
            return
        lo, hi = int(idx.min()), int(idx.max())
        if lo < low or hi >= self.config.vocab_size:
            ignored = " (-1 marks an ignored target)" if low < 0 else ""
            raise ValueError(f"{name} holds token ids in [{lo}, {hi}]; the model's vocabulary is "
                             f"[0, {self.config.vocab_size}){ignored}")

    def forward(self, idx, targets=None, return_attention: bool = False):
        """``idx [B, T]`` -> logits ``[B, T, V]`` and the mean cross-entropy against ``targets`` (−1 = ignored).

        With ``return_attention`` every layer runs its fp64 reference path and the per-layer
        :class:`~pathlab.attention.AttentionRecord` list is returned as a third element (T×T: small T only).
        """
        self._check_idx(idx)
        x = self.drop(self.wte(idx))
        records = []
        for block in self.blocks:
            if return_attention:
                x, record = block(x, idx, return_attention=True)
                records.append(record)
            else:
                x = block(x, idx)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            self._check_idx(targets, "targets", low=-1)
            if targets.shape != idx.shape:
                raise ValueError(f"targets must have the shape of idx {tuple(idx.shape)}, got {tuple(targets.shape)}")
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-1)
        return (logits, loss, records) if return_attention else (logits, loss)

    def _forward_cached(self, idx, caches, prefill: bool):
        x = self.wte(idx)
        for block, cache in zip(self.blocks, caches):
            x = block.forward_cached(x, idx, cache, prefill)
        return self.lm_head(self.ln_f(x[:, -1:]))[:, -1]

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 use_cache: bool = True):
        """Sample ``max_new_tokens`` tokens after the prompt ``idx [B, T]`` (temperature 0 = greedy).

        With ``use_cache`` each layer keeps a cache (keys transported by PaTH's transitions for PaTH, an ordinary
        KV cache otherwise), so a step costs O(T·D) per layer; without it the whole sequence is recomputed.
        """
        self._check_idx(idx)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
        if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
        if max_new_tokens == 0:
            return idx
        B, T0 = idx.shape
        p = next(self.parameters())
        if use_cache:
            caches = [blk.attn.positional.new_cache(B, T0 + max_new_tokens, device=idx.device, dtype=p.dtype)
                      for blk in self.blocks]
            logits = self._forward_cached(idx, caches, prefill=True)
        else:
            logits = self(idx)[0][:, -1]
        tokens = [idx]
        for step in range(max_new_tokens):
            nxt = self._sample(logits, temperature, top_k)
            tokens.append(nxt)
            if step + 1 == max_new_tokens:
                break
            if use_cache:
                logits = self._forward_cached(nxt, caches, prefill=False)
            else:
                logits = self(torch.cat(tokens, dim=1))[0][:, -1]
        return torch.cat(tokens, dim=1)

    @staticmethod
    def _sample(logits, temperature: float, top_k: int | None):
        logits = logits.float()
        if temperature == 0:
            return logits.argmax(dim=-1, keepdim=True)
        logits = logits / temperature
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1)


def build_model(config: ModelConfig | dict) -> GPT:
    """Build the decoder for ``config`` (a :class:`ModelConfig` or a dict of its fields)."""
    if isinstance(config, dict):
        config = ModelConfig.from_dict(config)
    if not isinstance(config, ModelConfig):
        raise ValueError(f"config must be a ModelConfig or a dict, got {type(config).__name__}")
    return GPT(config)
