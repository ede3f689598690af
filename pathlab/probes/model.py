"""Probes of a trained model at any evaluation length: hooks on every layer's positional module.

:func:`measure_model` runs the model's blocks (not the vocabulary head) on token windows ``[B, L]`` and, inside a
forward pre-hook of each ``blocks[l].attn.positional``, streams the logits of sampled queries
(:mod:`pathlab.probes.scores`). Memory stays O(L·D) per query: ~64 sampled queries per window, keys in chunks,
running log-sum-exp per distance bin. The statistics run in fp64 on the model's device; the results are numpy.

The near/far split uses one width W per (layer, head): :func:`learned_head_windows` measures it from the model's
own step angles (M2, :mod:`pathlab.probes.learned`), with a fallback width for heads that do not mix.
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
def learned_head_windows(model, windows: torch.Tensor, *, n_max: int, fallback: int, eps: float = 0.05,
                         batch: int = 1) -> dict:
    """M2 near-set widths W per (layer, head) of a model, from its step angles on ``windows [B, L]`` (token ids).

    Per layer with step angles θ (accumulated rotations): C_{h,b}(n) (:func:`learned.phase_correlation`), the
    score weights u_{h,b} of the unrotated q, k (:func:`learned.block_score_weights`), the envelope
    c_h(n) = Σ_b |u_b| |C_b(n)| / Σ_b |u_b| for n = 1 … n_max and W_h = min{n : c_h(n) ≤ ε}.
    Fallback ``fallback`` (docs/theory.md#near-set:
    the training context, so far = beyond training) for heads with no such n, and for every head of a layer
    whose variant has no step angles (:meth:`~pathlab.attention.base.PositionalAttention.step_angles` gives None;
    RoPE: deterministic, no mixing; ALiBi, FoX, NoPE: no transport; PaTH: its Householder transport has no
    per-block phase, which this measurement does not cover).

    Returns numpy arrays: ``W`` ``[layers, H]`` (the widths to use), ``W_m2`` (inf where the head did not mix),
    ``fallback`` (bool ``[layers, H]``), ``eps``, ``n_max`` and, when some layer has angles, ``coherence`` c_h(n) (normalised, in [0, 1])
    and ``rho_s_pred`` ρ̂_s(n) ``[n_max, layers, H]`` (NaN for layers without angles).

    θ, q and k are kept on the model's device in their own dtype and the statistics (an FFT per block, and
    :func:`learned.block_score_weights`, O(B·T²·H·D) per layer) run there in fp64.
    """
    from pathlab._checks import expand_kv_heads

    model.eval()
    n_layer = len(model.blocks)
    if not 1 <= n_max < windows.shape[1]:
        raise ValueError(f"n_max must lie in [1, L) = [1, {windows.shape[1]}), got {n_max}")
    thetas = [[] for _ in range(n_layer)]
    qs, ks = [[] for _ in range(n_layer)], [[] for _ in range(n_layer)]
    heads = [None] * n_layer

    def callback(layer, module, q, k, v, x, idx):
        heads[layer] = q.shape[2]
        theta = module.step_angles(x, idx)
        if theta is not None:
            thetas[layer].append(theta.detach())
            qs[layer].append(q.detach())
            ks[layer].append(expand_kv_heads(k, q.shape[2]).detach())

    device = next(model.parameters()).device
    windows = windows.to(device)
    any_angles = any(b.attn.positional.has_step_angles for b in model.blocks)
    if any_angles:
        with positional_hooks(model, callback):
            for start in range(0, windows.shape[0], batch):
                run_blocks(model, windows[start:start + batch])
    H = heads[0] if heads[0] is not None else model.blocks[0].attn.n_head
    w_m2 = np.full((n_layer, H), np.inf)
    coh = np.full((n_max, n_layer, H), np.nan) if any_angles else None
    pred = np.full((n_max, n_layer, H), np.nan) if any_angles else None
    for layer in range(n_layer):
        if not thetas[layer]:
            continue
        corr = learned.phase_correlation(torch.cat(thetas[layer]), n_max)  # [n, H, Db]
        u = learned.block_score_weights(torch.cat(qs[layer]), torch.cat(ks[layer]))  # [H, Db]
        coh[:, layer] = learned.head_coherence(corr, u)
        pred[:, layer] = learned.predicted_score_decorrelation(corr, u)
        w_m2[layer] = learned.head_windows(coh[:, layer], eps)[0]
    fell_back = ~np.isfinite(w_m2)
    return {"W": np.where(fell_back, float(fallback), w_m2), "W_m2": w_m2, "fallback": fell_back, "eps": eps,
            "n_max": n_max, "coherence": coh, "rho_s_pred": pred}


def _windows_per_layer(near_windows, n_layer: int, n_head: int) -> list[np.ndarray]:
    """Each entry of ``near_windows`` (an int, or ``[layers, H]`` widths) as ``[n_W, layers, H]`` float widths."""
    out = []
    for w in near_windows:
        a = np.asarray(w, dtype=np.float64)
        if a.ndim == 0:
            a = np.full((n_layer, n_head), float(a))
        if a.shape != (n_layer, n_head) or not np.all(np.isfinite(a)) or np.any(a < 1) or np.any(a != np.round(a)):
            raise ValueError(f"near_windows entries must be integer widths ≥ 1, each an int or [layers={n_layer}, "
                             f"H={n_head}], got {w!r}")
        out.append(a)
    return np.stack(out)


@torch.no_grad()
def measure_model(model, windows: torch.Tensor, *, n_queries: int = 64, span: int = 512, near_windows=(64,),
                  chunk: int | None = None, batch: int = 1, angle_lag: int | None = None, seed: int = 0,
                  eps: float = 0.05) -> dict:
    """Streamed score statistics of every layer on ``windows [B, L]`` (token ids).

    ``near_windows``: the near-set widths W, each an int (every layer and head) or ``[layers, H]`` widths per layer
    and head (e.g. ``learned_head_windows(...)["W"]``); the first is the main one.
    Returns numpy arrays: ``near_windows`` ``[n_W, layers, H]``, ``bins`` (edges), per layer ``per_bin`` fields ``[layers, n_bins, H]``, per layer
    ``per_query`` fields ``[layers, n_W, B·m, H]`` (κ and ‖o_F‖/‖o_N‖ for the first W: ``[layers, B·m, H]``) and,
    for rotation models, ``angles`` (M2: γ, c(n), windows per layer/head/block).

    Distance bins are :func:`scores.distance_bin_edges` (L − 1): one grid at every L, so bin k of two lengths is
    the same range of distances. The streamed statistics (and the angle statistics) run in fp64 on the model's
    device; ``chunk``: keys per chunk (None: :func:`scores.default_chunk` for that device).
    """
    model.eval()
    device = next(model.parameters()).device
    windows = windows.to(device)
    B, L = windows.shape
    positions = sample_query_positions(L, n_queries, min(span, L), B, seed)
    edges = scores.distance_bin_edges(L - 1)
    n_layer = len(model.blocks)
    widths = _windows_per_layer(near_windows, n_layer, model.blocks[0].attn.n_head)  # [n_W, layers, H]
    per_bin = [[] for _ in range(n_layer)]
    per_query = [[] for _ in range(n_layer)]
    thetas = [[] for _ in range(n_layer)]

    def callback(layer, module, q, k, v, x, idx):
        theta = module.step_angles(x, idx) if angle_lag else None
        if theta is not None:
            thetas[layer].append(theta.detach().float())
        res = scores.probe_layer(module, q, k, v, x, idx, positions[start:start + q.shape[0]], edges=edges,
                                 windows=widths[:, layer], chunk=chunk)
        for acc, _ in res:
            per_bin[layer].append(acc)
            per_query[layer].append(acc.per_query())

    with positional_hooks(model, callback):
        for start in range(0, B, batch):
            run_blocks(model, windows[start:start + batch])

    out = {"length": L, "edges": edges, "positions": positions.numpy(), "near_windows": widths,
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
