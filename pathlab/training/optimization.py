"""What the language-model trainer and the synthetic-task runner share: AdamW's parameter groups, the learning-rate
schedule and the autocast context.

Weight decay applies to parameters of two or more dimensions (matrices, embeddings) and not to gains, biases and
per-head scalars, as in GPT-2's training. The schedule is a linear warm-up then a cosine decay:

    lr(s) = lr · (s + 1) / (warmup + 1)                          for s < warmup
    lr(s) = min_lr + ½ (lr − min_lr) (1 + cos(π · clip(f, 0, 1)))  after it,

where f is the fraction of the decay done: iterations for a fixed-length run, the time budget used for a
time-budgeted task run.
"""

from __future__ import annotations

import contextlib
import math

import torch


def adamw(model: torch.nn.Module, *, lr: float, betas: tuple[float, float], weight_decay: float,
          fused: bool = False) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, decay on those of 2+ dimensions only."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, **({"fused": True} if fused else {}))


def warmup_cosine(step: int, *, warmup: int, fraction: float, lr: float, min_lr: float) -> float:
    """The learning rate at ``step`` (module docstring), ``fraction`` being f."""
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    f = min(max(fraction, 0.0), 1.0)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * f))


def autocast(device: torch.device, bf16: bool):
    """A context factory: bf16 autocast on ``device`` when ``bf16``, else full precision."""
    if bf16:
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext
