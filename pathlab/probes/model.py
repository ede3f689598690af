"""Probes of a trained model at any evaluation length: hooks on every layer's positional module.

:func:`measure_model` runs the model's blocks (not the vocabulary head) on token windows ``[B, L]`` and, inside a
forward pre-hook of each ``blocks[l].attn.positional``, streams the logits of sampled queries
(:mod:`pathlab.probes.scores`). Memory stays O(L·D) per query: ~64 sampled queries per window, keys in chunks,
running log-sum-exp per distance bin.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from pathlab.probes import learned, scores


def sample_query_positions(length: int, n_queries: int, span: int, n_windows: int, seed: int = 0) -> torch.Tensor:
    """``[n_windows, m]`` sorted distinct positions in [L − span, L) (m = min(n_queries, span)), seeded."""
    if not 1 <= span <= length:
        raise ValueError(f"span must lie in [1, length={length}], got {span}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + length)
    m = min(n_queries, span)
    rows = [torch.sort(torch.randperm(span, generator=g)[:m] + (length - span)).values for _ in range(n_windows)]
    return torch.stack(rows)


@contextmanager
def positional_hooks(model, callback):
    """Call ``callback(layer, module, q, k, v, x, idx)`` before each layer's positional module runs."""
    handles = []
    for layer, block in enumerate(model.blocks):
        def hook(module, args, kwargs, layer=layer):
            q, k, v = (list(args) + [kwargs.get(n) for n in ("q", "k", "v")][len(args):])[:3]
            callback(layer, module, q, k, v, kwargs.get("x"), kwargs.get("idx"))
        handles.append(block.attn.positional.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def run_blocks(model, idx: torch.Tensor, n_layers: int | None = None) -> None:
    """The model's forward through its first ``n_layers`` blocks only (no T×V logits)."""
    x = model.drop(model.wte(idx))
    for block in list(model.blocks)[: n_layers or len(model.blocks)]:
        x = block(x, idx)


@torch.no_grad()
def measure_model(model, windows: torch.Tensor, *, n_queries: int = 64, span: int = 512, near_windows=(64,),
                  chunk: int = 1024, batch: int = 1, angle_lag: int | None = None, seed: int = 0,
                  eps: float = 0.05) -> dict:
    """Streamed score statistics of every layer on ``windows [B, L]`` (token ids).

    Returns numpy arrays: ``bins`` (edges), per layer ``per_bin`` fields ``[layers, n_bins, H]``, per layer
    ``per_query`` fields ``[layers, n_W, B·m, H]`` (κ and ‖o_F‖/‖o_N‖ for the first W: ``[layers, B·m, H]``) and,
    for rotation models, ``angles`` (M2: γ, c(n), windows per layer/head/block).
    """
    model.eval()
    device = next(model.parameters()).device
    windows = windows.to(device)
    B, L = windows.shape
    positions = sample_query_positions(L, n_queries, min(span, L), B, seed)
    edges = scores.distance_bin_edges(L - 1)
    n_layer = len(model.blocks)
    per_bin = [[] for _ in range(n_layer)]
    per_query = [[] for _ in range(n_layer)]
    thetas = [[] for _ in range(n_layer)]

    def callback(layer, module, q, k, v, x, idx):
        if hasattr(module, "angles") and angle_lag:
            thetas[layer].append(module.angles(x, idx).detach().float().cpu())
        res = scores.probe_layer(module, q, k, v, x, idx, positions[start:start + q.shape[0]], edges=edges,
                                 windows=near_windows, chunk=chunk)
        for acc, _ in res:
            per_bin[layer].append(acc)
            per_query[layer].append(acc.per_query())

    with positional_hooks(model, callback):
        for start in range(0, B, batch):
            run_blocks(model, windows[start:start + batch])

    out = {"length": L, "edges": edges, "positions": positions.numpy(), "near_windows": list(near_windows),
           "per_bin": _merge_bins(per_bin), "per_query": _merge_queries(per_query)}
    if angle_lag and thetas[0]:
        stats = [learned.angle_statistics(torch.cat(t), min(angle_lag, L - 1), eps) for t in thetas]
        out["angles"] = {k: np.stack([s[k] for s in stats]) for k in stats[0]}
    return out


def _merge_bins(per_layer):
    """Sum the bin accumulators of all windows of a layer, then derive μ, σ, log m, ρ_s: ``[layers, n_bins, H]``."""
    merged = []
    for accs in per_layer:
        base = accs[0]
        for other in accs[1:]:
            base.bin_count += other.bin_count
            base.bin_sum += other.bin_sum
            base.bin_sumsq += other.bin_sumsq
            base.bin_cross += other.bin_cross
            base.bin_raw_sq += other.bin_raw_sq
            new_max = torch.maximum(base.bin_max, other.bin_max)
            safe = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
            base.bin_sumexp = torch.nan_to_num(base.bin_sumexp * torch.exp(base.bin_max - safe)) + \
                torch.nan_to_num(other.bin_sumexp * torch.exp(other.bin_max - safe))
            base.bin_max = new_max
        merged.append(base.per_bin())
    keys = merged[0].keys()
    return {k: (np.stack([m[k] for m in merged]) if merged[0][k] is not None else None) for k in keys}


def _merge_queries(per_layer):
    out = {}
    for key in per_layer[0][0]:
        if per_layer[0][0][key] is None:
            out[key] = None
            continue
        axis = 1 if per_layer[0][0][key].ndim == 3 else 0  # [n_W, m, H] or [m, H]
        out[key] = np.stack([np.concatenate([q[key] for q in qs], axis=axis) for qs in per_layer])
    return out
