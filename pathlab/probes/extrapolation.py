"""M7/M8: length extrapolation of a trained model: perplexity ratios and per-position loss.

    r(L) = PPL(L) / PPL(L_train),   PPL(L) = exp(mean token cross-entropy over non-overlapping length-L windows),

the same windows for every model (seeded by L). PPL(L_train) is measured on the same tokens: each length-L window
is also cut into L / L_train consecutive training-length windows, so r(L) compares the same predicted tokens with
long and with training-length context, free of the text-to-text variance of a few windows. The per-position loss loss(t) is averaged over the windows in
log-spaced position buckets (Fig N8). The vocabulary projection is applied in position chunks, so a 65K window never
materialises a T×V logit matrix. NTK-scaled RoPE (M8 c) evaluates a RoPE model with base · s^{d/(d−2)},
s = L / L_train.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F


# Published perplexity ratios ("Why Do Accumulated Transformations Extrapolate?", arXiv:2606.24975, as reported in
# its abstract and public summaries; docs/theory.md#m7): (variant, L, L_train, ratio)
PUBLISHED = [
    ("rope", 8192, 512, 16.2),
    ("random accumulated (Q/K or Q/K/V, not stated)", 8192, 512, 1.60),
    ("rot_random_qkv", 65536, 512, 1.59),
    ("rot_random_qk", 65536, 512, 7.49),
    ("alibi", 65536, 512, 0.96),
]


@torch.no_grad()
def per_position_loss(model, windows: torch.Tensor, chunk: int = 2048) -> np.ndarray:
    """Cross-entropy of token t + 1 given tokens ≤ t, per position, mean over windows: ``windows [B, L + 1]`` ->
    ``[L]`` (fp64 numpy)."""
    model.eval()
    windows = windows.to(next(model.parameters()).device)
    idx, targets = windows[:, :-1], windows[:, 1:]
    x = model.drop(model.wte(idx))
    for block in model.blocks:
        x = block(x, idx)
    x = model.ln_f(x)
    losses = []
    for start in range(0, idx.shape[1], chunk):
        logits = model.lm_head(x[:, start:start + chunk]).float()
        ce = F.cross_entropy(logits.transpose(1, 2), targets[:, start:start + chunk], reduction="none")
        losses.append(ce.double())
    return torch.cat(losses, dim=1).mean(0).cpu().numpy()


@torch.no_grad()
def chunked_loss(model, windows: torch.Tensor, length: int) -> float:
    """Mean loss of the same predicted tokens as ``per_position_loss(windows)`` with the context cut every ``length``
    tokens: ``windows [B, L + 1]`` (L a multiple of ``length``) evaluated as L / length windows of ``length + 1``."""
    B, n = windows.shape
    L = n - 1
    if L % length:
        raise ValueError(f"length {L} must be a multiple of the training length {length}")
    chunks = torch.stack([windows[:, c:c + length + 1] for c in range(0, L, length)], dim=1)  # [B, L/l, l + 1]
    return float(per_position_loss(model, chunks.reshape(-1, length + 1)).mean())


def bucket_positions(loss: np.ndarray, per_decade: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Mean loss in log-spaced position buckets: returns (bucket centre positions, mean loss)."""
    L = len(loss)
    edges = np.unique(np.round(np.geomspace(1, L, max(2, int(per_decade * np.log10(L)) + 1))).astype(int))
    edges[0] = 0
    centres, means = [], []
    for a, b in zip(edges[:-1], edges[1:]):
        if b > a:
            centres.append(float(np.sqrt(max(a, 1) * b)))
            means.append(float(np.mean(loss[a:b])))
    return np.array(centres), np.array(means)


def ntk_base(base: float, scale: float, head_dim: int) -> float:
    """NTK-aware RoPE base for a length scale s ≥ 1: base · s^{d/(d−2)}."""
    return float(base * max(scale, 1.0) ** (head_dim / (head_dim - 2)))


@contextmanager
def rope_base(model, base: float):
    """Temporarily set the base of every RoPE layer of ``model``."""
    from pathlab.attention.rope import RoPE

    mods = [b.attn.positional for b in model.blocks if isinstance(b.attn.positional, RoPE)]
    if not mods:
        raise ValueError("rope_base needs a model with RoPE layers")
    old = [m.base for m in mods]
    try:
        for m in mods:
            m.base = float(base)
        yield model
    finally:
        for m, b in zip(mods, old):
            m.base = b


def length_curves(models: dict, windows_for, lengths, *, ntk: bool = False) -> dict:
    """For each variant: mean loss and perplexity ratio at every length, and the bucketed per-position loss at the
    longest. ``models``: {name: (model, run_config)}; ``windows_for(run_config, L + 1)`` -> ``[B, L + 1]`` tokens.
    With ``ntk``, a ``"<name>+ntk"`` entry is added for every RoPE model (base rescaled per length)."""
    out = {}
    for name, (model, cfg) in models.items():
        entries = [(name, None)]
        if ntk and cfg["model"]["attention"] == "rope":
            entries.append((f"{name}+ntk", cfg["model"].get("attention_kwargs", {}).get("base", 10000.0)))
        for label, base in entries:
            train_len = cfg["data"]["block_size"]
            row = {"lengths": [], "mean_loss": [], "train_length_loss": [], "ppl_ratio": [], "train_length": train_len}
            for L in lengths:
                windows = windows_for(cfg, L + 1)
                if base is None:
                    loss = per_position_loss(model, windows)
                else:
                    scale = L / train_len
                    with rope_base(model, ntk_base(base, scale, cfg["model"]["n_embd"] // cfg["model"]["n_head"])):
                        loss = per_position_loss(model, windows)
                reference = chunked_loss(model, windows, train_len)
                row["lengths"].append(L)
                row["mean_loss"].append(float(loss.mean()))
                row["train_length_loss"].append(reference)
                row["ppl_ratio"].append(float(np.exp(loss.mean() - reference)))
                if L == max(lengths):
                    row["position"], row["position_loss"] = bucket_positions(loss)
            out[label] = row
    return out
