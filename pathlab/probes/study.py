"""The model study behind the model-based figures: measure each trained variant once per length, cache, summarise.

:func:`measurements` runs :func:`pathlab.probes.model.measure_model` for every (variant, length) of a profile and
caches the arrays under ``build/probe_cache/<profile>[-fast]/`` (keyed by the run's checkpoint and the probe
settings), so the notebooks share one pass over the models. The ``*_summary`` functions turn the measurements into
the ``(data, claims)`` of each figure.

Per profile: evaluation lengths (the first is the training context), windows per length, sampled queries per
window (in the last ``span`` positions), fixed near-set widths W reported alongside, the largest lag of the M2 angle
statistics and the windows of the M2 pass that sets the per-head widths.

Near/far split: by default the main width is W per (layer, head) from the M2 measurement of the same model at the
training length (:func:`pathlab.probes.model.learned_head_windows`: W_h = min{n : c_h(n) ≤ ε} with the
score-weighted coherence c_h(n) = Σ_b |u_b| |C_b(n)| / Σ_b |u_b|); heads
without a finite window (RoPE, ALiBi, FoX, PaTH, or no mixing within ``angle_lag``) fall back to the training
context length, so that far = beyond training (docs/theory.md#near-set). ``near_width=<int>`` overrides it for
every head. The fixed ``near`` widths follow as extra widths (index 1, 2, …). Every summary records the widths
used under ``data["near_sets"]``.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
from pathlib import Path

import numpy as np

from pathlab.probes import farmass, runs

SETTINGS = {
    "tiny-cpu": {"lengths": [256, 1024, 4096], "n_windows": 2, "n_queries": 32, "span": 128, "near": [32, 128],
                 "angle_lag": 255, "m2_windows": 8},
    "h200-mini": {"lengths": [512, 2048, 8192, 32768, 65536], "n_windows": 4, "n_queries": 64, "span": 512,
                  "near": [64, 512], "angle_lag": 4096, "m2_windows": 64},
    "owt16": {"lengths": [512, 2048, 8192, 32768, 65536], "n_windows": 4, "n_queries": 64, "span": 512,
              "near": [64, 512], "angle_lag": 4096, "m2_windows": 64},
}
# Trained variants each figure compares; a fast (CI) run keeps only runs.FAST_VARIANTS.
FIGURE_VARIANTS = {
    "spectral_mixing": ["rope", "rot_random_qk", "rot_learned_qk"],
    "score_gaps": ["rope", "alibi", "rot_random_qk", "rot_learned_qk"],
    "far_mass": ["rope", "alibi", "rot_random_qk", "rot_random_qkv", "rot_learned_qk", "path", "path_fox"],
    "lower_bound": ["rope", "alibi", "rot_random_qk", "rot_random_qkv", "rot_learned_qk", "path", "path_fox"],
    "value_incoherence": ["rot_random_qk", "rot_random_qkv"],
    "length_extrapolation": ["rope", "alibi", "rot_random_qk", "rot_random_qkv", "rot_learned_qk", "path",
                             "path_fox"],
    "ablations": ["rope", "rot_iid_tau0.5", "rot_iid_tau1", "rot_random_qk", "path", "path_fox"],
}


def run_info(profile: str, variants, *, fast: bool = False) -> dict:
    """Per variant: iterations, final train/val loss and tokens of its run (from the run's ``summary.json``)."""
    out = {}
    for v in variants:
        path = runs.run_dir(profile, v, fast) / "summary.json"
        if path.is_file():
            summary = json.loads(path.read_text())
            out[v] = {k: summary.get(k) for k in ("iterations", "train_loss", "val_loss", "tokens", "parameters")}
    return out


def variants_for(figure: str, fast: bool, only=None) -> list[str]:
    """The trained variants a figure uses (fast: the CI subset; ``only``: a list or comma string to restrict to)."""
    if figure not in FIGURE_VARIANTS:
        raise ValueError(f"unknown figure {figure!r}; known: {', '.join(FIGURE_VARIANTS)}")
    chosen = [v for v in FIGURE_VARIANTS[figure] if not fast or v in runs.FAST_VARIANTS]
    if only is not None and not isinstance(only, (str, list, tuple)):
        raise ValueError(f"variants must be None, a comma-separated string or a list of names, got {only!r}")
    if only is not None:
        only = [x.strip() for x in only.split(",")] if isinstance(only, str) else list(only)
        unknown = [v for v in only if v not in runs.VARIANTS]
        if unknown:
            raise ValueError(f"variants: unknown {unknown}; known: {', '.join(runs.VARIANTS)}")
        chosen = [v for v in chosen if v in only]
    return chosen


FAST = {"lengths": [256, 768], "n_windows": 1, "n_queries": 8, "span": 64, "near": [32, 128], "angle_lag": 255,
        "m2_windows": 2}
M2_EPS = 0.05  # ε of the per-head mixing window W_h(ε) that sets the near set


def settings(profile: str, fast: bool) -> dict:
    from pathlab.figures import PROFILES

    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {', '.join(PROFILES)}, got {profile!r}")
    return dict(FAST if fast else SETTINGS[profile])


def probe_device() -> str:
    """Where the models run for the probes: the GPU when there is one (the streamed statistics stay on the CPU)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _fingerprint(run: Path, params: dict) -> str:
    ckpt = run / "ckpt.pt"
    stat = ckpt.stat()
    text = json.dumps({"ckpt": [stat.st_size, int(stat.st_mtime)], "params": params, "version": 3}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        elif v is not None:
            out[f"{prefix}{k}"] = np.asarray(v)
    return out


def _unflatten(arrays) -> dict:
    out: dict = {}
    for key in arrays.files:
        node = out
        *path, leaf = key.split("/")
        for p in path:
            node = node.setdefault(p, {})
        value = arrays[key]
        node[leaf] = value.item() if value.ndim == 0 else value
    return out


def show_progress() -> bool:
    """Progress output for long work, except under ``pathlab figures`` (which sets ``PATHLAB_NO_PROGRESS``)."""
    return not os.environ.get("PATHLAB_NO_PROGRESS")


def check_near_width(near_width) -> int | None:
    """``None`` (per-head W from M2, the default) or a fixed width ≥ 1 for every layer and head."""
    if near_width is None:
        return None
    if isinstance(near_width, bool) or not isinstance(near_width, (int, np.integer)) or near_width < 1:
        raise ValueError(f"near_width must be None (per-head W from M2) or an integer ≥ 1, got {near_width!r}")
    return int(near_width)


def near_widths(model, run_cfg, cfg: dict, seed: int, near_width: int | None) -> dict:
    """The main near-set width per (layer, head): M2 (:func:`learned_head_windows`) or the ``near_width`` override.

    Returns ``{"W": [layers, H], "source": [layers, H] of "m2" | "fallback" | "override", "fallback_width", "eps"}``
    plus the M2 curves (``coherence``, ``rho_s_pred`` ``[n, layers, H]``) when measured.
    """
    from pathlab.probes.model import learned_head_windows

    block = int(run_cfg["data"]["block_size"])
    L0 = cfg["lengths"][0]
    if near_width is not None:
        shape = (len(model.blocks), model.blocks[0].attn.n_head)
        return {"W": np.full(shape, float(near_width)), "source": np.full(shape, "override"),
                "fallback_width": block, "eps": M2_EPS}
    windows = runs.validation_windows(run_cfg, L0, cfg["m2_windows"], seed + 1)
    hw = learned_head_windows(model, windows, n_max=min(cfg["angle_lag"], L0 - 1), fallback=block, eps=M2_EPS)
    out = {"W": hw["W"], "W_m2": hw["W_m2"], "source": np.where(hw["fallback"], "fallback", "m2"),
           "fallback_width": block, "eps": M2_EPS}
    if hw["coherence"] is not None:
        out.update(coherence=hw["coherence"], rho_s_pred=hw["rho_s_pred"])
    return out


def measurements(profile: str, variants, *, fast: bool = False, seed: int = 0, progress: bool | None = None,
                 near_width: int | None = None) -> dict:
    """``{variant: {length: measure_model(...) result}}``, computed once and cached per checkpoint.

    The main near-set width is W per (layer, head) from M2 (``near_width=None``) or ``near_width`` for every head;
    each result holds it as ``near`` (see :func:`near_widths`) and ``near_windows[0]``.
    """
    from pathlab.figures import project_path
    from pathlab.probes.model import measure_model
    from pathlab.train import load_run

    near_width = check_near_width(near_width)
    cfg = settings(profile, fast)
    progress = show_progress() if progress is None else progress
    dirs = runs.ensure_runs(profile, variants, fast=fast, progress=progress)
    cache = project_path("build/probe_cache") / (profile + ("-fast" if fast else ""))
    out = {}
    for v in variants:
        out[v] = {}
        model = run_cfg = near = None
        for L in cfg["lengths"]:
            params = {k: cfg[k] for k in ("n_windows", "n_queries", "span", "near", "angle_lag", "m2_windows")} | {
                "L": L, "seed": seed, "near_width": near_width, "m2_eps": M2_EPS}
            path = cache / v / f"L{L}-{_fingerprint(dirs[v], params)}.npz"
            if path.exists():
                with np.load(path) as arrays:
                    out[v][L] = _unflatten(arrays)
                continue
            if model is None:
                model, run_cfg = load_run(dirs[v], device=probe_device())
                near = near_widths(model, run_cfg, cfg, seed, near_width)
            windows = runs.validation_windows(run_cfg, L, cfg["n_windows"], seed)
            res = measure_model(model, windows, n_queries=cfg["n_queries"], span=min(cfg["span"], L),
                                near_windows=[near["W"], *cfg["near"]], angle_lag=min(cfg["angle_lag"], L - 1),
                                seed=seed)
            res["block_size"] = run_cfg["data"]["block_size"]
            # the widths used (every length); the M2 curves once, with the training length
            res["near"] = {k: v_ for k, v_ in near.items() if L == cfg["lengths"][0] or k not in
                           ("coherence", "rho_s_pred")}
            buf = io.BytesIO()
            np.savez_compressed(buf, **_flatten(res))
            from pathlab.results import atomic_write_bytes

            atomic_write_bytes(path, buf.getvalue())
            out[v][L] = res
    return out


# ----------------------------------------------------------------------------------------------------------------
# summaries


def _median_heads(a, axis=-1):
    with np.errstate(all="ignore"):
        return np.nanmedian(a, axis=axis)


def main_widths(m: dict) -> np.ndarray:
    """The main near-set width W per (layer, head) of one measurement, ``[layers, H]``."""
    return np.asarray(m["near_windows"])[0]


def near_sets(meas: dict) -> dict:
    """Per variant, the near-set widths used (training-length measurement): ``W`` ``[layers, H]``, where each came
    from (``source``: "m2", "fallback" = training context, "override"), the fallback width, ε and the extra fixed
    widths."""
    out = {}
    for v, by_len in meas.items():
        m = by_len[min(by_len)]
        W = main_widths(m)
        near = m.get("near") or {}
        source = near.get("source", np.full(W.shape, "given"))
        out[v] = {"W": W, "source": np.asarray(source).tolist(), "fallback_width": near.get("fallback_width"),
                  "eps": near.get("eps"), "extra_widths": [float(np.median(w)) for w in np.asarray(m["near_windows"])[1:]],
                  "fallback_fraction": float(np.mean(np.asarray(source) == "fallback"))}
    return out


def far_mass_summary(meas: dict) -> tuple[dict, dict]:
    """M4: ρ_D(L) per variant (mean over queries, median over heads, per layer) and its prediction from the
    training-length gap alone (:func:`farmass.predict_far_mass`): Γ̂ = median over the training-length queries per
    layer/head, ρ̂ = mean_i M_L(i) / (M_L(i) + e^{Γ̂}), M_L(i) = i − W + 1 with the per-head W.

    Γ̂ is NaN for heads without a far key at the training length (W ≥ training context: the fallback heads), so
    ``predicted`` and ``measured_predictable`` are medians over the predictable heads only (NaN if none);
    ``measured`` is over every head."""
    data, claims = {"variants": {}, "near_sets": near_sets(meas)}, {}
    for v, by_len in meas.items():
        lengths = sorted(by_len)
        base = by_len[lengths[0]]
        gap_train = base["per_query"]["gap"][:, 0]  # [layers, Q, H]
        gap_hat = farmass.fit_gap_per_head(gap_train, axis=1)  # [layers, H]
        ok = np.isfinite(gap_hat)
        rows = {"lengths": lengths, "measured": [], "predicted": [], "measured_predictable": [], "measured_heads": [],
                "predicted_heads": [], "lam_median": []}
        for L in lengths:
            pq = by_len[L]["per_query"]
            rho = np.nanmean(pq["far_mass"][:, 0], axis=1)  # [layers, H]
            pred = np.nanmean(farmass.predict_far_mass(gap_train, pq["m_far"][:, 0]), axis=1)  # [layers, H]
            rows["measured"].append(_median_heads(rho))  # [layers]
            rows["predicted"].append(_median_heads(np.where(ok, pred, np.nan)))
            rows["measured_predictable"].append(_median_heads(np.where(ok, rho, np.nan)))
            rows["measured_heads"].append(rho)
            rows["predicted_heads"].append(pred)
            rows["lam_median"].append(float(np.nanmedian(pq["lam"][:, 0])))
        rows["gap_hat"] = gap_hat
        rows["W"] = main_widths(base)  # [layers, H]
        rows["predictable_fraction"] = float(np.mean(ok))
        data["variants"][v] = rows
    for v in ("rot_random_qk", "rot_learned_qk"):
        if v in data["variants"]:
            r = np.mean(np.array(data["variants"][v]["measured"]), axis=1)
            claims[f"{v}_far_mass_rises_with_length"] = bool(np.all(np.diff(r) > 0))
            p = np.mean(np.array(data["variants"][v]["predicted"]), axis=1)
            rp = np.mean(np.array(data["variants"][v]["measured_predictable"]), axis=1)
            claims[f"{v}_prediction_within_0.1"] = bool(np.all(np.abs(p - rp) <= 0.1))  # False if none predictable
    if "alibi" in data["variants"]:
        r = np.mean(np.array(data["variants"]["alibi"]["measured"]), axis=1)
        claims["alibi_far_mass_saturates"] = bool(abs(r[-1] - r[-2]) < 0.05)
    return data, claims


def bound_summary(meas: dict, eps: float = 0.5) -> tuple[dict, dict]:
    """M5: every sampled query's (bound, ρ_D), λ per length, and the implied maximum safe length L_max(ε)."""
    from pathlab.probes.bounds import max_safe_length

    data, claims, violations = {"variants": {}, "eps": eps, "near_sets": near_sets(meas)}, {}, 0
    for v, by_len in meas.items():
        rows = {}
        for L, m in sorted(by_len.items()):
            pq = m["per_query"]
            rho, bound, lam = pq["far_mass"][:, 0].ravel(), pq["bound"][:, 0].ravel(), pq["lam"][:, 0].ravel()
            ok = np.isfinite(rho) & (pq["m_far"][:, 0].ravel() > 0)
            violations += int(np.sum(rho[ok] < bound[ok] * (1 - 1e-9)))
            k = pq["k_near"][:, 0].ravel()
            W = np.broadcast_to(main_widths(m)[:, None, :], pq["lam"][:, 0].shape).ravel()  # per query and head
            lmax = max_safe_length(eps, np.maximum(k, 1), lam, W)
            rows[str(L)] = {"far_mass": rho[ok], "bound": bound[ok], "lam_median": float(np.median(lam)),
                            "lam_max": float(np.max(lam)), "L_max_median": float(np.median(lmax))}
        data["variants"][v] = rows
    claims["bound_never_violated"] = violations == 0
    lam = lambda v: [r["lam_median"] for _, r in sorted(data["variants"][v].items(), key=lambda t: int(t[0]))]  # noqa
    if "alibi" in data["variants"]:
        claims["alibi_lambda_grows_with_length"] = bool(lam("alibi")[-1] > 1.5 * lam("alibi")[0])
    for v in ("rot_random_qk", "rot_random_qkv"):
        if v in data["variants"]:
            claims[f"{v}_lambda_stays_bounded"] = bool(lam(v)[-1] <= 1.5 * lam(v)[0])
    return data, claims


def score_summary(meas: dict) -> tuple[dict, dict]:
    """M3: μ(n), σ(n), log m(n) (median over heads, first and last layer) per length; the gaps Δ^max, Δ^mean, Γ
    for the main (per-head) W and the extra fixed widths. ``W``: per width, the median over layer 0's heads."""
    data, claims = {"variants": {}, "near_sets": near_sets(meas)}, {}
    for v, by_len in meas.items():
        rows = {}
        for L, m in sorted(by_len.items()):
            pb, pq = m["per_bin"], m["per_query"]
            edges = m["edges"]
            centers = np.sqrt(np.maximum(edges[:-1], 0.5) * np.maximum(edges[1:] - 1, 0.5))
            keep = pb["count"][0, :, 0] > 0
            rows[str(L)] = {"n": centers[keep],
                            **{f"{k}_layer{l}": _median_heads(pb[k][l][keep]) for k in ("mean", "std", "log_mean_exp")
                               for l in (0, pb["mean"].shape[0] - 1)},
                            "gaps": {g: [float(np.nanmedian(pq[g][l, 0])) for l in range(pq[g].shape[0])]
                                     for g in ("delta_max", "delta_mean", "gap")},
                            "W": [float(np.median(w[0])) for w in np.asarray(m["near_windows"])],
                            "W_heads": main_widths(m)}
        data["variants"][v] = rows
    for v in ("rot_random_qk", "rot_learned_qk", "rot_random_qkv"):
        if v in data["variants"]:
            r = data["variants"][v]
            Ls = sorted(r, key=int)
            a, b = r[Ls[0]], r[Ls[-1]]
            common = min(len(a["n"]), len(b["n"]))
            diff = np.abs(a["mean_layer0"][:common] - b["mean_layer0"][:common])
            claims[f"{v}_score_curves_coincide_across_lengths"] = bool(
                np.nanmax(diff / (a["std_layer0"][:common] + 1e-9)) < 0.5)
    if "alibi" in meas:
        m = meas["alibi"][max(meas["alibi"])]
        from pathlab.ops.positions import alibi_slopes

        H = m["per_bin"]["mean"].shape[-1]
        edges = m["edges"]
        centers = 0.5 * (edges[:-1] + edges[1:] - 1)
        W0 = main_widths(m)[0]  # [H], layer 0
        far = [(edges[:-1] >= W0[h]) & (m["per_bin"]["count"][0, :, 0] > 0) for h in range(H)]
        far = [f if f.sum() >= 2 else (m["per_bin"]["count"][0, :, 0] > 0) & (edges[:-1] >= 1) for f in far]
        slopes = [np.polyfit(centers[far[h]], m["per_bin"]["log_mean_exp"][0, far[h], h], 1)[0] for h in range(H)]
        rel = np.abs(np.array(slopes) + alibi_slopes(H).numpy()) / alibi_slopes(H).numpy()
        data["alibi_log_mean_exp_slopes"] = {"fitted": slopes, "minus_m_h": (-alibi_slopes(H)).tolist()}
        claims["alibi_log_mean_exp_slope_is_minus_m_h"] = bool(np.median(rel) < 0.25)
    return data, claims


def coherence_summary(meas: dict) -> tuple[dict, dict]:
    """M6: κ against 1/√M_eff per query (Q/K/V vs Q/K), and ‖o_F‖/‖o_N‖ against L."""
    data, claims = {"variants": {}, "near_sets": near_sets(meas)}, {}
    for v, by_len in meas.items():
        rows = {"lengths": sorted(by_len), "far_near_ratio": [], "kappa_median": [], "inv_sqrt_meff_median": []}
        for L in rows["lengths"]:
            pq = by_len[L]["per_query"]
            kappa = pq["kappa"].ravel()
            meff = pq["m_eff"][:, 0].ravel()
            ok = np.isfinite(kappa) & np.isfinite(meff) & (meff > 0)
            rows["far_near_ratio"].append(float(np.nanmedian(pq["far_near_norm_ratio"])))
            rows["kappa_median"].append(float(np.median(kappa[ok])) if ok.any() else math.nan)
            rows["inv_sqrt_meff_median"].append(float(np.median(1 / np.sqrt(meff[ok]))) if ok.any() else math.nan)
            if L == rows["lengths"][-1]:
                rows["kappa"], rows["inv_sqrt_meff"] = kappa[ok], 1 / np.sqrt(meff[ok])
        data["variants"][v] = rows
    if "rot_random_qk" in data["variants"]:
        claims["qk_kappa_is_one"] = bool(np.allclose(data["variants"]["rot_random_qk"]["kappa"], 1.0, atol=1e-6))
    if "rot_random_qkv" in data["variants"]:
        claims["qkv_far_background_incoherent"] = bool(data["variants"]["rot_random_qkv"]["kappa_median"][-1] < 0.5)
    if {"rot_random_qk", "rot_random_qkv"} <= set(data["variants"]):
        def growth(v):  # from the first length with far keys (none at the training length for fallback heads)
            r = np.asarray(data["variants"][v]["far_near_ratio"], np.float64)
            ok = np.nonzero(np.isfinite(r) & (r > 0))[0]
            return r[-1] / r[ok[0]] if ok.size >= 2 else np.nan

        claims["qkv_far_output_grows_slower"] = bool(growth("rot_random_qkv") < growth("rot_random_qk"))
    return data, claims


def _bin_average(curve, edges) -> np.ndarray:
    """Mean of ``curve[k] = f(k + 1)`` ``[n, ...]`` over the distances of each bin [edges_k, edges_{k+1}) -> ``[n_bins, ...]``
    (NaN for bins outside 1 … n)."""
    curve = np.asarray(curve, np.float64)
    n = np.arange(1, curve.shape[0] + 1)
    out = np.full((len(edges) - 1,) + curve.shape[1:], np.nan)
    for b in range(len(edges) - 1):
        sel = (n >= edges[b]) & (n < edges[b + 1])
        if sel.any():
            out[b] = np.nanmean(curve[sel], axis=0)
    return out


def learned_summary(meas: dict, eps: float = 0.05, vanish: float = 0.1) -> tuple[dict, dict]:
    """M2: learned γ and W per layer/head/block (training length), ρ_s(n) at every length, the prediction
    ρ̂_s(n) = Σ_b Re(u_b C_b(n)) and the per-head windows W_h of the near set.

    Claims (expected outcomes of docs/theory.md#m2): ``*_rho_s_stationary_across_lengths`` (median-head curves at
    the first and last length within 0.1); ``*_rho_s_vanishes_beyond_window`` (median |ρ_s| over the bins at
    n ≥ W_h of the heads with an M2 window, at the largest length, below ``vanish``; False when no head mixes);
    ``*_rho_s_matches_prediction`` (measured and predicted median-head curves within 0.1 at the training length);
    ``rope_rho_s_does_not_decay`` (median over heads of |ρ_s| in the farthest bin above ``vanish``)."""
    data, claims = {"variants": {}, "eps": eps, "near_sets": near_sets(meas)}, {}
    for v, by_len in meas.items():
        Ls = sorted(by_len)
        rows = {"rho_s": {}, "W_heads": main_widths(by_len[Ls[0]])}
        base = by_len[Ls[0]]
        near = base.get("near") or {}
        if "angles" in base:
            a = base["angles"]
            rows.update({"gamma": a["gamma"], "W_emp": a["W_emp"], "W_pred": a["W_pred"],
                         "coherence_median": np.median(a["coherence"], axis=(1, 2)),
                         "finite_window_fraction": float(np.mean(np.isfinite(a["W_emp"])))})
        if "W_m2" in near:
            rows["W_m2"] = near["W_m2"]  # [layers, H], inf: no mixing within the measured lags
        for L in Ls:
            pb = by_len[L]["per_bin"]
            if pb.get("rho_s") is None:
                continue
            edges = by_len[L]["edges"]
            keep = pb["count"][0, :, 0] > 0
            rows["rho_s"][str(L)] = {"n": (0.5 * (edges[:-1] + edges[1:] - 1))[keep],
                                     "rho_s": _median_heads(np.nanmean(pb["rho_s"], axis=0)[keep])}
        if near.get("rho_s_pred") is not None and base["per_bin"].get("rho_s") is not None:
            edges = base["edges"]
            keep = base["per_bin"]["count"][0, :, 0] > 0
            pred = _bin_average(near["rho_s_pred"], edges)[keep]  # [bins, layers, H]
            with np.errstate(all="ignore"):
                rows["rho_s_pred"] = {"n": (0.5 * (edges[:-1] + edges[1:] - 1))[keep],
                                      "rho_s_pred": _median_heads(np.nanmean(pred, axis=1)),
                                      "head_coherence_median": _median_heads(np.nanmean(
                                          _bin_average(near["coherence"], edges)[keep], axis=1))}
        data["variants"][v] = rows
    for v in ("rot_random_qk", "rot_learned_qk", "rot_random_qkv"):
        if v not in meas:
            continue
        r = data["variants"][v]
        rs = r.get("rho_s", {})
        if len(rs) >= 2:
            Ls = sorted(rs, key=int)
            a, b = rs[Ls[0]], rs[Ls[-1]]
            common = min(len(a["n"]), len(b["n"]))
            claims[f"{v}_rho_s_stationary_across_lengths"] = bool(
                np.nanmax(np.abs(a["rho_s"][:common] - b["rho_s"][:common])) < 0.1)
        m = meas[v][max(meas[v])]
        if m["per_bin"].get("rho_s") is not None and "W_m2" in r:
            lower = np.asarray(m["edges"])[:-1]
            counted = m["per_bin"]["count"] > 0  # [layers, bins, H]
            beyond = (lower[None, :, None] >= np.asarray(r["W_m2"])[:, None, :]) & counted
            vals = np.abs(m["per_bin"]["rho_s"])[beyond]
            claims[f"{v}_rho_s_vanishes_beyond_window"] = bool(vals.size and np.nanmedian(vals) < vanish)
        if "rho_s_pred" in r:
            meas0 = r["rho_s"][str(min(meas[v]))]["rho_s"]
            diff = np.abs(meas0 - r["rho_s_pred"]["rho_s_pred"])
            claims[f"{v}_rho_s_matches_prediction"] = bool(np.any(np.isfinite(diff)) and np.nanmax(diff) < 0.1)
    if "rope" in meas:
        m = meas["rope"][max(meas["rope"])]
        if m["per_bin"].get("rho_s") is not None:
            last = np.nonzero(m["per_bin"]["count"][0, :, 0] > 0)[0][-1]
            claims["rope_rho_s_does_not_decay"] = bool(np.nanmedian(np.abs(m["per_bin"]["rho_s"][:, last])) > vanish)
    return data, claims


# ----------------------------------------------------------------------------------------------------------------
# M7 and M8: perplexity against length


EVAL = {"tiny-cpu": {"lengths": [256, 512, 1024, 2048, 4096], "n_windows": 4},
        "h200-mini": {"lengths": [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536], "n_windows": 8},
        "owt16": {"lengths": [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536], "n_windows": 16}}
EVAL_FAST = {"lengths": [256, 768], "n_windows": 1}


def length_study(profile: str, variants, *, fast: bool = False, seed: int = 0, ntk: bool = False,
                 progress: bool | None = None) -> dict:
    """``{label: {lengths, mean_loss, ppl_ratio, position, position_loss}}`` for every variant (cached)."""
    from pathlab.figures import project_path
    from pathlab.probes.extrapolation import length_curves
    from pathlab.results import atomic_write_text, to_jsonable
    from pathlab.train import load_run

    cfg = dict(EVAL_FAST if fast else EVAL[profile])
    dirs = runs.ensure_runs(profile, variants, fast=fast, progress=show_progress() if progress is None else progress)
    cache = project_path("build/probe_cache") / (profile + ("-fast" if fast else ""))
    out = {}
    for v in variants:
        # the NTK variant only exists for RoPE models: other models share one cache entry with or without it
        params = cfg | {"seed": seed, "ntk": ntk and runs.VARIANTS[v][0] == "rope", "kind": "length-same-tokens"}
        path = cache / v / f"length-{_fingerprint(dirs[v], params)}.json"
        if path.exists():
            out.update(json.loads(path.read_text()))
            continue
        model, run_cfg = load_run(dirs[v], device=probe_device())
        res = length_curves({v: (model, run_cfg)},
                            lambda c, n: runs.validation_windows(c, n, cfg["n_windows"], seed), cfg["lengths"],
                            ntk=ntk)
        atomic_write_text(path, json.dumps(to_jsonable(res)))
        out.update(json.loads(json.dumps(to_jsonable(res))))
    return out


def extrapolation_summary(curves: dict) -> tuple[dict, dict]:
    """M7: r(L) per variant, the published ratios at the same L / L_train, and the expected-shape claims."""
    from pathlab.probes.extrapolation import PUBLISHED

    data = {"variants": curves, "published": [
        {"model": m, "L": L, "L_train": Lt, "ratio": r, "length_multiple": L / Lt} for m, L, Lt, r in PUBLISHED]}
    table = []
    for v, r in curves.items():
        for L, ratio in zip(r["lengths"], r["ppl_ratio"]):
            table.append({"variant": v, "L": L, "length_multiple": L / r["train_length"], "ppl_ratio": ratio})
    data["table"] = table
    last = {v: r["ppl_ratio"][-1] for v, r in curves.items()}
    claims = {}
    if "rope" in last:
        claims["rope_degrades_beyond_training"] = bool(last["rope"] > 2.0)
    if "alibi" in last:
        claims["alibi_stays_flat"] = bool(last["alibi"] < 1.2)
    if {"rope", "rot_random_qk"} <= set(last):
        claims["accumulated_rotations_beat_rope"] = bool(last["rot_random_qk"] < last["rope"])
    if {"rot_random_qk", "rot_random_qkv"} <= set(last):
        claims["qkv_flatter_than_qk"] = bool(last["rot_random_qkv"] < last["rot_random_qk"])
    return data, claims


def ablation_summary(curves: dict, meas: dict) -> tuple[dict, dict]:
    """M8: (a) dispersion sweep τ (RoPE = τ 0), (b) far-mass control PaTH vs PaTH-FoX, (c) NTK-scaled RoPE."""
    data, claims = {}, {}
    taus = [(0.0, "rope"), (0.5, "rot_iid_tau0.5"), (1.0, "rot_iid_tau1")]
    sweep = [{"tau": t, "variant": v, "ppl_ratio_max_L": curves[v]["ppl_ratio"][-1],
              "finite_window_fraction": (float(np.mean(np.isfinite(meas[v][min(meas[v])]["angles"]["W_emp"])))
                                         if v in meas and "angles" in meas[v][min(meas[v])] else None)}
             for t, v in taus if v in curves]
    data["dispersion_sweep"] = sweep
    if len(sweep) >= 2:
        r = [s["ppl_ratio_max_L"] for s in sweep]
        claims["extrapolation_improves_with_dispersion"] = bool(np.all(np.diff(r) < 0))
    if {"path", "path_fox"} <= set(curves):
        data["far_mass_control"] = {v: {"lengths": curves[v]["lengths"], "ppl_ratio": curves[v]["ppl_ratio"]}
                                    for v in ("path", "path_fox")}
        claims["forget_gate_improves_extrapolation"] = bool(
            curves["path_fox"]["ppl_ratio"][-1] <= curves["path"]["ppl_ratio"][-1])
        if {"path", "path_fox"} <= set(meas):
            fm, _ = far_mass_summary({v: meas[v] for v in ("path", "path_fox")})
            data["far_mass_control_rho"] = {v: np.mean(np.array(fm["variants"][v]["measured"]), axis=1)
                                            for v in ("path", "path_fox")}
            rise = {v: data["far_mass_control_rho"][v][-1] - data["far_mass_control_rho"][v][0]
                    for v in ("path", "path_fox")}
            claims["forget_gate_limits_far_mass_growth"] = bool(rise["path_fox"] <= rise["path"])
    if {"rope", "rope+ntk"} <= set(curves):
        data["ntk"] = {v: {"lengths": curves[v]["lengths"], "ppl_ratio": curves[v]["ppl_ratio"]}
                       for v in ("rope", "rope+ntk")}
        claims["ntk_scaling_helps_rope"] = bool(curves["rope+ntk"]["ppl_ratio"][-1] < curves["rope"]["ppl_ratio"][-1])
    return data, claims


def extrapolation_markdown(data) -> str:
    """Table N1: r(L) per variant and length, with the published ratios below it."""
    variants = data["variants"]
    lengths = sorted({L for r in variants.values() for L in r["lengths"]})
    head = "| variant | " + " | ".join(f"r({L})" for L in lengths) + " |"
    lines = [head, "|---" * (len(lengths) + 1) + "|"]
    for v, r in variants.items():
        cells = {L: f"{x:.2f}" for L, x in zip(r["lengths"], r["ppl_ratio"])}
        lines.append(f"| {v} | " + " | ".join(cells.get(L, "—") for L in lengths) + " |")
    lines += ["", "Published (L_train = 512): " + "; ".join(
        f"{p['model']} r({p['L']}) = {p['ratio']}× ({p['length_multiple']:.0f}× L_train)" for p in data["published"])]
    return "\n".join(lines)
