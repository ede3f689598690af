"""Figure summaries of a study: ``(data, claims, checks)`` per figure from the cells' compact results.

Every function takes ``cells = {name: {"cell": cell.json, "eval": eval.json, "record": probe record}}``
(:func:`pathlab.study.load_cells`) and returns the plotted numbers, the claims the figure is evidence for
(True, False, or None where a claim is undefined in the run) and the consistency checks (identities and
theorems that hold whenever the code is right; never evidence). Every claim that a theory variant is expected to
pass is computed for every cell of the figure, so RoPE (or NoPE) serves as its negative control in the same
JSON; ``tests/test_probes_summaries.py`` checks on synthetic records that each claim can fail.

Widths: a record holds the near-set widths "per-head" (the M2 window of each head, the training length where a
head does not mix) and the fixed widths of the study (e.g. "64", "128"); ``width`` picks the main one.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from pathlab.attention.registry import attention_class, attention_settings
from pathlab.intervals import compare, margin_at, order, paired_ratio, paired_table, verdict
from pathlab.probes.records import length_entry


def _nanmedian(a, axis=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmedian(a, axis=axis)


def _nanmean(a, axis=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(a, axis=axis)


def width_index(record: dict, width) -> int:
    """The index of a near-set width label ("per-head", "64", …; an int is read as its label)."""
    labels = [str(x) for x in np.atleast_1d(record["width_labels"])]
    label = "per-head" if width is None else str(width)
    if label not in labels:
        raise ValueError(f"width must be one of {labels} (the widths this study measured), got {width!r}")
    return labels.index(label)


def near_sets(cells: dict) -> dict:
    """Per cell: the widths of every label (``W`` ``[layers, H]`` per label), where the per-head width came from
    (``source``: "m2" or "fallback" = the training length) and the fraction of heads that fell back."""
    out = {}
    for c, entry in cells.items():
        rec = entry["record"]
        labels = [str(x) for x in np.atleast_1d(rec["width_labels"])]
        source = np.asarray(rec["width_source"]).astype(str)
        out[c] = {"labels": labels, "W": {lab: rec["widths"][i] for i, lab in enumerate(labels)},
                  "source": source.tolist(), "fallback_width": rec["train_length"], "eps": rec["eps"],
                  "fallback_fraction": float(np.mean(source == "fallback"))}
    return out


def _cell_kind(entry) -> dict:
    """The attention variant and its options of a cell."""
    c = entry["cell"]
    return {"attention": c["attention"], **(c.get("attention_kwargs") or {})}


def _settings(entry) -> dict:
    """Every option of the cell's variant: its registered settings, then the cell's options."""
    c = entry["cell"]
    return attention_settings(c["attention"], **(c.get("attention_kwargs") or {}))


def rotates_values(entry) -> bool:
    """Whether the cell's variant rotates the values."""
    return bool(_settings(entry).get("rotate_values", False))


def mixes(entry) -> bool:
    """Whether the cell's variant, with its options, mixes (:meth:`PositionalAttention.mixes`)."""
    return attention_class(entry["cell"]["attention"]).mixes(**_settings(entry))


def tokens_of(entry) -> int | None:
    """The cell's training budget in tokens (``cell.json``; None where not recorded)."""
    return entry.get("cell", {}).get("tokens")


def one_budget(cells: dict, what: str) -> int | None:
    """The one training budget of the cells a comparison of r(L) reads, or a ValueError naming each cell's.

    r(L) moves with the budget as much as with the variant (here the 100M-token RoPE's r(65K) is 1.8 times the
    50M-token one's), so cells of two budgets are no comparison of their variants."""
    budgets = {c: tokens_of(e) for c, e in cells.items()}
    if len(set(budgets.values())) > 1:
        listed = ", ".join(f"{c} {'?' if t is None else f'{t / 1e6:.1f}M'}" for c, t in budgets.items())
        raise ValueError(f"{what}: the cells were trained on different budgets ({listed} tokens); compare cells "
                         "of one budget")
    return next(iter(budgets.values()), None)


# ----------------------------------------------------------------------------------------------------------------
# M4: far mass


def far_mass_summary(cells: dict, width=None, tolerance: float = 0.1,
                     min_rise: float = 0.05) -> tuple[dict, dict, dict]:
    """M4: ρ_D(L) per cell (mean over queries, median over heads, per layer) and its prediction from the
    training-length gap alone: ρ̂_D = mean_i M_L(i) / (M_L(i) + e^{Γ̂}), Γ̂ = median over the training-length
    queries per (layer, head), M_L(i) = i − W + 1.

    Γ̂ is undefined for heads with no far key at the training length (W ≥ L_train), so ``predicted`` and
    ``measured_predictable`` are medians over the predictable heads, and ``predictable_fraction`` says how many.

    Claims, per cell: ``<c>_far_mass_rises_with_length`` (the mean over layers rises at every step and by at
    least ``min_rise`` from the shortest to the longest length: a mass that moves by less stays where it was, so
    ALiBi's and PaTH-FoX's near-zero far mass, the negative controls, cannot pass by drifting up in the third
    decimal) and
    ``<c>_prediction_within_<tol>`` (|ρ̂ − ρ| ≤ tol at every length, over the predictable heads; None when no head
    is predictable). The prediction assumes stationary statistics, so RoPE is its negative control.
    """
    data, claims = {"cells": {}, "near_sets": near_sets(cells), "width": "per-head" if width is None else str(width),
                    "tolerance": tolerance}, {}
    for c, entry in cells.items():
        rec = entry["record"]
        w = width_index(rec, width)
        gap_hat = np.asarray(rec["gap_hat"])[:, w]  # [layers, H]
        ok = np.isfinite(gap_hat)
        rows = {"lengths": rec["lengths"], "measured": [], "predicted": [], "measured_predictable": [],
                "lam_median": [], "W": np.asarray(rec["widths"])[w], "gap_hat": gap_hat,
                "predictable_fraction": float(np.mean(ok))}
        for L in rec["lengths"]:
            e = length_entry(rec, L)
            rho = np.asarray(e["heads"]["far_mass"])[:, w]  # [layers, H]
            pred = np.asarray(e["predicted_far_mass"])[:, w]
            rows["measured"].append(_nanmedian(rho, axis=-1))
            rows["predicted"].append(_nanmedian(np.where(ok, pred, np.nan), axis=-1))
            rows["measured_predictable"].append(_nanmedian(np.where(ok, rho, np.nan), axis=-1))
            rows["lam_median"].append(float(_nanmedian(np.asarray(e["heads"]["lam_median"])[:, w])))
        data["cells"][c] = rows
        r = np.mean(np.asarray(rows["measured"]), axis=1)
        claims[f"{c}_far_mass_rises_with_length"] = bool(np.all(np.diff(r) > 0) and r[-1] - r[0] >= min_rise)
        p = _nanmean(np.asarray(rows["predicted"]), axis=1)
        rp = _nanmean(np.asarray(rows["measured_predictable"]), axis=1)
        claims[f"{c}_prediction_within_{tolerance:g}"] = (
            None if not ok.any() or not np.all(np.isfinite(p)) else bool(np.all(np.abs(p - rp) <= tolerance)))
    return data, claims, {}


# ----------------------------------------------------------------------------------------------------------------
# M5: the lower bound


def bound_summary(cells: dict, width=None, eps: float = 0.5) -> tuple[dict, dict, dict]:
    """M5: sampled queries' (bound, ρ_D), λ per length, the violations of the bound and the implied maximum safe
    length L_max(ε) = W + ε/(1 − ε) K e^{2λ}, beside the length where r(L) first exceeds 1.1.

    Check (a theorem for any logits): ``bound_never_violated``. Claims: ``<c>_lambda_stays_bounded`` (median λ at
    the longest length ≤ 1.5 × at the training length; rotations are orthogonal, ALiBi's and FoX's logits are
    not bounded below, so they are the negative controls).
    """
    data, claims = {"cells": {}, "eps": eps, "width": "per-head" if width is None else str(width)}, {}
    violations = checked = 0
    for c, entry in cells.items():
        rec = entry["record"]
        w = width_index(rec, width)
        rows = {}
        for L in rec["lengths"]:
            e = length_entry(rec, L)
            violations += int(np.asarray(e["bound_violations"])[w])
            checked += int(np.asarray(e["bound_checked"])[w])
            lam = np.asarray(e["heads"]["lam_median"])[:, w]
            rows[str(L)] = {"lam_median": float(_nanmedian(lam)), "lam_max": float(np.nanmax(lam)),
                            "L_max_median": float(np.asarray(e["max_safe_length_median"])[w]),
                            "violations": int(np.asarray(e["bound_violations"])[w]),
                            "checked": int(np.asarray(e["bound_checked"])[w])}
            if L == rec["lengths"][-1] and w == 0:
                keep = np.isfinite(e["sample"]["far_mass"]) & (e["sample"]["bound"] > 0)
                rows[str(L)].update(far_mass=e["sample"]["far_mass"][keep], bound=e["sample"]["bound"][keep])
        onset = degradation_onset(entry["eval"])
        data["cells"][c] = {"lengths": rows, "degradation_onset": onset}
        Ls = sorted(rows, key=int)
        claims[f"{c}_lambda_stays_bounded"] = bool(rows[Ls[-1]]["lam_median"] <= 1.5 * rows[Ls[0]]["lam_median"])
    data["violations"], data["checked"] = violations, checked
    return data, claims, {"bound_never_violated": violations == 0 and checked > 0}


def degradation_onset(ev: dict, rise: float = 1.1):
    """The first evaluation length where r(L) > ``rise`` (None if it never does)."""
    for L, r in sorted(ev["lengths"].items(), key=lambda t: int(t[0])):
        if r["ratio"] > rise:
            return int(L)
    return None


# ----------------------------------------------------------------------------------------------------------------
# M3: score statistics


def _centres(edges) -> np.ndarray:
    edges = np.asarray(edges, np.float64)
    return np.sqrt(np.maximum(edges[:-1], 0.5) * np.maximum(edges[1:] - 1, 0.5))


def far_statistics(entry_L: dict, W_lo: float, W_hi: float, layer: str = "first") -> tuple[float, float]:
    """Count-weighted mean μ and σ of the median head over the distance bins with lower edge in [W_lo, W_hi)."""
    edges = np.asarray(entry_L["edges"])
    lower = edges[:-1]
    sel = (lower >= W_lo) & (lower < W_hi)
    b = entry_L["bins"]
    cnt = _nanmedian(np.asarray(b["count"][layer]), axis=-1)[sel]
    mu = _nanmedian(np.asarray(b["mean"][layer]), axis=-1)[sel]
    sd = _nanmedian(np.asarray(b["std"][layer]), axis=-1)[sel]
    ok = np.isfinite(mu) & np.isfinite(sd) & (cnt > 0)
    if not ok.any():
        return math.nan, math.nan
    wts = cnt[ok] / cnt[ok].sum()
    return float(np.sum(wts * mu[ok])), float(np.sum(wts * sd[ok]))


def score_summary(cells: dict, width=None, tolerance: float = 0.25) -> tuple[dict, dict, dict]:
    """M3: μ(n), σ(n) and log m(n) (median over heads, first and last layer) per length on common distance bins;
    the gaps Δ^max, Δ^mean and Γ per layer for every width.

    Claim, per cell: ``<c>_far_scores_stationary_beyond_training``: at the longest length, the far scores beyond
    the training length (n ≥ L_train) have the statistics of the far scores inside it (the median head's μ and σ
    over n ∈ [W, L_train)): |Δμ| ≤ tol·σ and |Δσ| ≤ tol·σ, in the first layer. Mixing predicts it for rotations;
    RoPE meets distances it never saw (its negative control). ``<c>_curves_coincide_within_training``: μ(n) at
    the training length and at the longest length agree within 0.5 σ for n < L_train (SPEC M3; a necessary
    condition only: the same relative positions, so RoPE is expected to pass it too, except where its queries
    near the start of a training-length window see the first tokens).
    ``alibi_log_mean_exp_slope_is_minus_m_h``: the fitted slope of log m(n) per head against −m_h.
    """
    data, claims, checks = {"cells": {}, "near_sets": near_sets(cells)}, {}, {}
    for c, entry in cells.items():
        rec = entry["record"]
        w = width_index(rec, width)
        L0 = rec["train_length"]
        rows = {}
        for L in rec["lengths"]:
            e = length_entry(rec, L)
            b = e["bins"]
            keep = np.asarray(b["count"]["heads_median"])[0] > 0
            row = {"n": _centres(e["edges"])[keep]}
            for k in ("mean", "std", "log_mean_exp"):
                for layer in ("first", "last"):
                    row[f"{k}_{layer}"] = _nanmedian(np.asarray(b[k][layer]), axis=-1)[keep]
            row["gaps"] = {g: [float(v) for v in _nanmedian(np.asarray(e["heads"][g])[:, w], axis=-1)]
                           for g in ("delta_max", "delta_mean", "gap")}
            row["W"] = float(_nanmedian(np.asarray(rec["widths"])[w][0]))
            rows[str(L)] = row
        data["cells"][c] = rows
        Lmax = rec["lengths"][-1]
        e = length_entry(rec, Lmax)
        W = float(_nanmedian(np.asarray(rec["widths"])[w][0]))
        inside = far_statistics(e, min(W, L0 / 2), L0)
        beyond = far_statistics(e, L0, Lmax)
        data["cells"][c]["far_inside_vs_beyond"] = {"inside": inside, "beyond": beyond}
        if all(map(math.isfinite, inside + beyond)) and inside[1] > 0:
            claims[f"{c}_far_scores_stationary_beyond_training"] = bool(
                abs(beyond[0] - inside[0]) <= tolerance * inside[1] and abs(beyond[1] - inside[1]) <= tolerance * inside[1])
        else:
            claims[f"{c}_far_scores_stationary_beyond_training"] = None
        a, z = rows[str(L0)], rows[str(Lmax)]
        common = min(len(a["n"]), len(z["n"]))
        within = a["n"][:common] < L0
        diff = np.abs(a["mean_first"][:common] - z["mean_first"][:common])[within]
        claims[f"{c}_curves_coincide_within_training"] = bool(
            np.nanmax(diff / (a["std_first"][:common][within] + 1e-9)) < 0.5)
    if "alibi" in cells:
        from pathlab.ops.positions import alibi_slopes

        rec = cells["alibi"]["record"]
        e = length_entry(rec, rec["lengths"][-1])
        edges = np.asarray(e["edges"])
        centers = 0.5 * (edges[:-1] + edges[1:] - 1)
        lme = np.asarray(e["bins"]["log_mean_exp"]["first"])  # [n_bins, H]
        cnt = np.asarray(e["bins"]["count"]["first"])
        H = lme.shape[-1]
        W0 = np.asarray(rec["widths"])[width_index(rec, width)][0]
        slopes = []
        for h in range(H):
            far = (edges[:-1] >= min(W0[h], rec["train_length"] / 4)) & (cnt[:, h] > 0) & np.isfinite(lme[:, h])
            slopes.append(float(np.polyfit(centers[far], lme[far, h], 1)[0]) if far.sum() >= 2 else math.nan)
        m = alibi_slopes(H).numpy()
        rel = np.abs(np.array(slopes) + m) / m
        data["alibi_log_mean_exp_slopes"] = {"fitted": slopes, "minus_m_h": (-m).tolist()}
        claims["alibi_log_mean_exp_slope_is_minus_m_h"] = bool(np.nanmedian(rel) < 0.25)
    return data, claims, checks


# ----------------------------------------------------------------------------------------------------------------
# M6: value-side incoherence


def coherence_summary(cells: dict, factor: float = 3.0, slope_range=(0.5, 2.0)) -> tuple[dict, dict, dict]:
    """M6: κ (the far background's coherence ratio, per-head width) against the incoherent prediction
    √(1 + 2W)/√M_eff, and ‖o_F‖/‖o_N‖ against L.

    Rotating values predicts κ ≈ √(1 + 2W)/√M_eff; Q/K-only models keep κ = 1 (values are not transported), so
    they are the negative control of every claim below: a claim is None unless the same criterion rejects every
    Q/K cell of the figure (and None without one), since a test the control also passes shows nothing.

    Claims, per value-rotating cell: ``<c>_kappa_matches_incoherent_prediction``: the median over sampled queries
    of κ / prediction lies within a ``factor`` of 1 at the longest length. ``<c>_kappa_falls_as_predicted``: the
    least-squares slope of log median κ on log median prediction, over the lengths with far keys (at least
    three), lies in ``slope_range`` (1 is the prediction's own scaling, κ ∝ 1/√M_eff; a κ that stops falling
    gives a slope near 0, as the Q/K control does). ``qkv_far_output_grows_slower``: ‖o_F‖/‖o_N‖ grows less from
    the first length with far keys to the last for the Q/K/V cells than for the Q/K cells (medians over each
    group). Check: ``<c>_kappa_is_one`` for every Q/K cell (κ = 1 by construction).
    """
    data, checks = {"cells": {}}, {}
    growth, at_longest, slope = {}, {}, {}
    for c, entry in cells.items():
        rec = entry["record"]
        rows = {"lengths": rec["lengths"], "far_near_ratio": [], "kappa_median": [], "predicted_median": []}
        for L in rec["lengths"]:
            e = length_entry(rec, L)
            s = e["sample"]
            pred = np.sqrt(1 + 2 * s["W"]) / np.sqrt(s["m_eff"])
            # M_eff = ρ²/Σ_F α² is infinite where the far weights underflow (a forget gate): no prediction there
            ok = (np.isfinite(s.get("kappa", np.full_like(pred, np.nan))) & np.isfinite(pred)
                  & np.isfinite(s["m_eff"]) & (s["m_eff"] > 0))
            rows["far_near_ratio"].append(float(_nanmedian(np.asarray(e["far_near_ratio_median"]))))
            rows["kappa_median"].append(float(np.median(s["kappa"][ok])) if ok.any() else math.nan)
            rows["predicted_median"].append(float(np.median(pred[ok])) if ok.any() else math.nan)
            if L == rec["lengths"][-1]:
                rows["kappa"], rows["predicted"] = (s["kappa"][ok], pred[ok]) if ok.any() else ([], [])
                at_longest[c] = float(np.median(s["kappa"][ok] / pred[ok])) if ok.any() else math.nan
                if not rotates_values(entry) and ok.any():
                    checks[f"{c}_kappa_is_one"] = bool(np.allclose(s["kappa"][ok], 1.0, atol=1e-4))
        r = np.asarray(rows["far_near_ratio"], np.float64)
        k, p = np.asarray(rows["kappa_median"]), np.asarray(rows["predicted_median"])
        use = np.isfinite(r) & (r > 0) & np.isfinite(k) & (k > 0) & np.isfinite(p) & (p > 0)
        slope[c] = (float(np.polyfit(np.log(p[use]), np.log(k[use]), 1)[0])
                    if use.sum() >= 3 and np.ptp(np.log(p[use])) > 0 else math.nan)
        rows["kappa_over_prediction_at_longest"], rows["kappa_slope"] = at_longest[c], slope[c]
        data["cells"][c] = rows
        first = np.nonzero(np.isfinite(r) & (r > 0))[0]
        growth[c] = r[-1] / r[first[0]] if first.size >= 1 and first[0] < len(r) - 1 else math.nan

    def passes(test, value):
        return None if not math.isfinite(value) else bool(test(value))

    tests = {"kappa_matches_incoherent_prediction": (at_longest, lambda v: 1 / factor <= v <= factor),
             "kappa_falls_as_predicted": (slope, lambda v: slope_range[0] <= v <= slope_range[1])}
    controls = [c for c in cells if not rotates_values(cells[c])]
    claims, data["controls_rejected"] = {}, {}
    for name, (values, test) in tests.items():
        verdicts = [passes(test, values[c]) for c in controls]
        rejected = bool(verdicts) and all(v is False for v in verdicts)
        data["controls_rejected"][name] = rejected
        for c in cells:
            if rotates_values(cells[c]):
                claims[f"{c}_{name}"] = passes(test, values[c]) if rejected else None
    qkv = [growth[c] for c in cells if rotates_values(cells[c]) and math.isfinite(growth[c])]
    qk = [growth[c] for c in controls if math.isfinite(growth[c])]
    data["far_output_growth"] = growth
    claims["qkv_far_output_grows_slower"] = bool(np.median(qkv) < np.median(qk)) if qkv and qk else None
    return data, claims, checks


# ----------------------------------------------------------------------------------------------------------------
# M2: learned windows and score decorrelation


def learned_summary(cells: dict, vanish: float = 0.1, width="128") -> tuple[dict, dict, dict]:
    """M2: per-block γ and windows (models with step angles), the per-head windows W_h, ρ_s(n) at every length
    (mean over layers of the median head) and, from the step angles, the predicted ρ̂_s(n) and coherence c_h(n).

    Claim, per cell: ``<c>_rho_s_vanishes_beyond_window``: the median |ρ_s| over the bins at distances ≥ W (the
    fixed width ``width``, the same for every cell), at the longest length, is below ``vanish``. Mixing predicts
    it. The cells that do not mix (RoPE) are the control: RoPE's ρ_s(n) = Σ_b w_b cos(n ω_b) is deterministic but
    can dephase across blocks too, so the claim of a mixing cell is None unless every control fails the same test
    (and None without a control), and the controls keep their own verdicts. ``<c>_rho_s_matches_prediction`` (cells
    with step angles): measured and predicted median-head ρ_s within 0.1 at the M2 lags ≤ the training length.
    ``<c>_rho_s_stationary_within_training``: ρ_s at n < L_train is the same (within 0.1) at the first and the
    last length (a necessary condition, expected of RoPE too).
    """
    data, claims, checks = {"cells": {}, "width": str(width)}, {}, {}
    vanishes = {}
    for c, entry in cells.items():
        rec = entry["record"]
        L0 = rec["train_length"]
        rows = {"W_heads": np.asarray(rec["widths"])[0], "W_m2": np.asarray(rec["m2"]["W_m2"]),
                "source": np.asarray(rec["width_source"]).astype(str).tolist(), "rho_s": {}}
        if "angles" in rec:
            a = rec["angles"]
            rows.update(gamma=a["gamma"], W_emp=a["W_emp"], W_pred=a["W_pred"],
                        finite_window_fraction=float(np.mean(np.isfinite(a["W_emp"]))))
        if "lags" in rec["m2"]:
            rows["m2_lags"] = rec["m2"]["lags"]
            rows["rho_s_pred"] = _nanmedian(_nanmean(np.asarray(rec["m2"]["rho_s_pred"]), axis=1), axis=-1)
            rows["coherence"] = _nanmedian(_nanmean(np.asarray(rec["m2"]["coherence"]), axis=1), axis=-1)
        for L in rec["lengths"]:
            e = length_entry(rec, L)
            if "rho_s" not in e["bins"]:
                continue
            keep = np.asarray(e["bins"]["count"]["heads_median"])[0] > 0
            rows["rho_s"][str(L)] = {"n": _centres(e["edges"])[keep],
                                     "rho_s": _nanmean(np.asarray(e["bins"]["rho_s"]["heads_median"]), axis=0)[keep]}
        data["cells"][c] = rows
        if not rows["rho_s"]:
            continue
        Lmax = rec["lengths"][-1]
        far = length_entry(rec, Lmax).get("rho_s_far_median")
        w = width_index(rec, width)
        vanishes[c] = (bool(np.asarray(far)[w] < vanish) if far is not None and np.isfinite(np.asarray(far)[w])
                       else None)
        if "rho_s_pred" in rows:
            m2L = str(rec["lengths"][0])
            meas = rows["rho_s"][m2L]
            sel = rows["m2_lags"] < L0
            if sel.any():
                measured = np.interp(rows["m2_lags"][sel], meas["n"], meas["rho_s"])
                diff = np.abs(measured - rows["rho_s_pred"][sel])
                claims[f"{c}_rho_s_matches_prediction"] = bool(np.nanmax(diff) < 0.1)
        first, last = rows["rho_s"].get(str(L0)), rows["rho_s"].get(str(Lmax))
        if first is not None and last is not None:
            common = min(len(first["n"]), len(last["n"]))
            within = first["n"][:common] < L0
            claims[f"{c}_rho_s_stationary_within_training"] = bool(
                np.nanmax(np.abs(first["rho_s"][:common] - last["rho_s"][:common])[within]) < 0.1)
    controls = [c for c in vanishes if not mixes(cells[c])]
    rejected = bool(controls) and all(vanishes[c] is False for c in controls)
    data["controls_rejected"] = {"rho_s_vanishes_beyond_window": rejected}
    for c, held in vanishes.items():
        claims[f"{c}_rho_s_vanishes_beyond_window"] = held if c in controls or rejected else None
    return data, claims, checks


# ----------------------------------------------------------------------------------------------------------------
# M7, M8: perplexity against length


def length_rows(ev: dict, scaling: str = "lengths") -> dict:
    """r(L) with its 95% interval, the losses and the per-position buckets at the longest L of one eval.json."""
    items = sorted(ev[scaling].items(), key=lambda t: int(t[0]))
    longest = items[-1][1]
    return {"lengths": [int(L) for L, _ in items], "ratio": [r["ratio"] for _, r in items],
            "ratio_lo": [r["ratio_ci95"][0] for _, r in items], "ratio_hi": [r["ratio_ci95"][1] for _, r in items],
            "loss": [r["loss"] for _, r in items], "loss_train_context": [r["loss_train_context"] for _, r in items],
            "n_windows": [r["n_windows"] for _, r in items], "train_length": ev["train_length"],
            "position": [0.5 * (b["start"] + b["stop"]) for b in longest["buckets"]],
            "position_loss": [b["loss"] for b in longest["buckets"]],
            "position_loss_train_context": [b["loss_train_context"] for b in longest["buckets"]]}


def _ratio_at(rows: dict, L: int):
    return rows["ratio"][rows["lengths"].index(L)] if L in rows["lengths"] else None


def extrapolation_summary(cells: dict, margins: dict | None = None) -> tuple[dict, dict, dict]:
    """M7: r(L) per cell with bootstrap intervals, the training-length loss, and the published ratios as a table.

    Claims: ``rope_degrades_beyond_training`` (r(8K) > 2); ``alibi_stays_flat`` (r at the longest L < 1.2);
    ``accumulated_rotations_beat_rope`` and ``qkv_flatter_than_qk`` (random rotations, at the longest L);
    ``path_flatter_than_rope``; ``path_fox_no_worse_than_path`` (False only when PaTH-FoX is decidedly worse).
    Each is decided by an interval, not by a point estimate (:mod:`pathlab.intervals`): a threshold by the
    cell's 95% bootstrap interval, a pair of cells by the paired interval of their ratio on the same windows;
    None while the interval leaves it open. With the study's spread between seeds (``margins``, length → m(L),
    :func:`pathlab.intervals.seed_margins`) the interval must also clear it: a threshold t by lying outside
    [t/m, t·m], a pair by lying outside [1/m, m]. ``data["paired_to_rope"]``: each other cell's r(L) / r_RoPE(L)
    at every length beyond the training length that both have, with its paired interval (None on other windows).
    """
    from pathlab.probes.published import PUBLISHED

    rows = {c: length_rows(e["eval"]) for c, e in cells.items()}
    data = {"cells": rows, "published": [{"model": m, "L": L, "L_train": Lt, "ratio": r} for m, L, Lt, r in PUBLISHED],
            "in_distribution_loss": {c: r["loss"][0] for c, r in rows.items()}}
    data["seed_margins"] = dict(margins or {})
    claims = {}
    if "rope" in rows and "8192" in cells["rope"]["eval"]["lengths"]:
        ci, m = cells["rope"]["eval"]["lengths"]["8192"]["ratio_ci95"], margin_at(margins, 8192)
        claims["rope_degrades_beyond_training"] = verdict([order((2.0 / m, 2.0 * m), ci)], -1)
    if "alibi" in rows:
        row = longest_row(cells["alibi"]["eval"])
        m = margin_at(margins, max(int(L) for L in cells["alibi"]["eval"]["lengths"]))
        claims["alibi_stays_flat"] = verdict([order(row["ratio_ci95"], (1.2 / m, 1.2 * m))], -1)
    claims.update(pair_claims(cells, margins=margins))
    if "rope" in rows:  # at each length beyond the training length that both have, seeded by L as the claims
        base = cells["rope"]["eval"]["lengths"]
        data["paired_to_rope"] = {
            c: [{"L": int(L), **paired_ratio(cells[c]["eval"]["lengths"][L], base[L], seed=int(L))}
                for L in sorted(set(cells[c]["eval"]["lengths"]) & set(base), key=int)[1:]]
            for c in rows if c != "rope"}
    return data, claims, {}


PAIR_CLAIMS = {"accumulated_rotations_beat_rope": ("rot_random_qk", "rope"),
               "qkv_flatter_than_qk": ("rot_random_qkv", "rot_random_qk"),
               "path_flatter_than_rope": ("path", "rope"), "path_fox_no_worse_than_path": ("path_fox", "path")}


def pair_claims(cells: dict, suffix: str = "", margins: dict | None = None) -> dict:
    """The claims of M7 that compare two cells (``PAIR_CLAIMS``: a is flatter than b), each decided at the longest
    length both were evaluated at by the paired interval of r_a / r_b on the same windows, beyond the seed margin
    there when ``margins`` are given (``no_worse`` claims are False only when a is decidedly worse). ``suffix`` is
    appended to each claim's name."""
    claims = {}
    for name, (a, b) in PAIR_CLAIMS.items():
        if a in cells and b in cells:
            one_budget({a: cells[a], b: cells[b]}, name)
            L = min(max(int(x) for x in cells[a]["eval"]["lengths"]), max(int(x) for x in cells[b]["eval"]["lengths"]))
            o = compare(cells[a]["eval"]["lengths"][str(L)], cells[b]["eval"]["lengths"][str(L)], seed=L,
                        margin=margin_at(margins, L))
            claims[name + suffix] = o != 1 if name.endswith("than_path") else verdict([o], -1)
    return claims


def longest_row(ev: dict, scaling: str = "lengths") -> dict:
    """The eval.json row of the longest evaluated length."""
    return ev[scaling][str(max(int(L) for L in ev[scaling]))]


def window_of(entry) -> float:
    """The mixing window a cell's rotations were given (``window=W``); RoPE is W = ∞; None for other cells."""
    kw = entry["cell"].get("attention_kwargs") or {}
    if "window" in kw:
        return float(kw["window"])
    return math.inf if entry["cell"]["attention"] == "rope" else None


def window_sweep_summary(cells: dict, lengths=(8192, 65536), margins: dict | None = None) -> tuple[dict, dict, dict]:
    """The theory's direct test: r(L) and the in-distribution loss against the mixing window W of the rotations
    (θ = ω_b + σ N(0, 1), every block mixing within W), for Q/K/V and Q/K, with RoPE as the Q/K group's W = ∞
    (σ → 0 leaves RoPE's angles; a Q/K/V rotation there would still rotate the values, which RoPE does not, so
    RoPE is no point of the Q/K/V group).

    Every claim compares r at the longest length by the paired interval of two cells' ratio on the same
    windows (:mod:`pathlab.intervals`), not by point estimates: a comparison is decided when the interval
    excludes 1 (and, with the study's spread between seeds ``margins``, lies outside [1/m, m] at that length:
    one training seed per sweep cell, so the intervals are over evaluation windows only, and the margin from the
    seeded headline cells stands in for the spread between trainings), and a claim is None when an undecided
    comparison leaves it open.
    Claims, per group (``qkv``, ``qk``): ``<g>_windows_below_training_length_extrapolate_better``: every cell
    with W < L_train has a lower r than every cell with W ≥ L_train (RoPE included), the prediction
    "extrapolation iff the window is below the training length". ``<g>_ratio_rises_with_window``: r at the
    largest W is above r at the smallest, and no step to a larger W lowers it. None when a group lacks cells on
    either side (at least three cells for the rise). ``qkv_flatter_than_qk_at_equal_window``: at every finite W
    that both groups have, Q/K/V's r is below Q/K's (value-side incoherence, SPEC M6/M7).
    Data: per group the points, and ``steps`` (r of each cell over the previous one's, with its paired interval);
    ``qkv_over_qk`` (r of Q/K/V over Q/K at each W both have, with its paired interval; None where the cells were
    scored on different windows); ``rope_over_widest`` (per group, RoPE's r over the widest finite window's, with
    its paired interval: a reference, in no claim).
    """
    data, claims = {"groups": {}, "lengths": list(lengths), "seed_margins": dict(margins or {})}, {}
    one_budget({c: e for c, e in cells.items() if window_of(e) is not None}, "the window sweep")
    rope = cells.get("rope")
    L_key = lengths[-1]

    def row(p):
        return cells[p["cell"]]["eval"]["lengths"][str(L_key)]

    def cmp(p, q):
        return compare(row(p), row(q), seed=L_key, margin=margin_at(margins, L_key))

    for group in ("qkv", "qk"):
        members = {c: e for c, e in cells.items() if window_of(e) is not None and rotates_values(e) == (group == "qkv")}
        pts = []
        for c, e in members.items():
            rows = length_rows(e["eval"])
            pts.append({"cell": c, "W": window_of(e), "loss_train_length": rows["loss"][0],
                        **{f"r{L}": _ratio_at(rows, L) for L in lengths},
                        **{f"r{L}_ci": ([rows["ratio_lo"][rows["lengths"].index(L)],
                                         rows["ratio_hi"][rows["lengths"].index(L)]] if L in rows["lengths"] else None)
                           for L in lengths}})
        pts.sort(key=lambda p: p["W"])
        if all(math.isinf(p["W"]) for p in pts):  # RoPE alone: this group has no sweep cell yet
            pts = []
        data["groups"][group] = pts
        L_train = (rope or next(iter(cells.values())))["eval"]["train_length"]
        data["train_length"] = L_train
        have = [p for p in pts if p[f"r{L_key}"] is not None]
        below = [p for p in have if p["W"] < L_train]
        above = [p for p in have if p["W"] >= L_train]
        claims[f"{group}_windows_below_training_length_extrapolate_better"] = (
            verdict([cmp(b, a) for b in below for a in above], -1) if below and above else None)
        data.setdefault("steps", {})[group] = [
            {"from": p["cell"], "to": q["cell"], **paired_ratio(row(q), row(p), seed=L_key)}
            for p, q in zip(have, have[1:])]
        if len(have) >= 3:
            falls = any(cmp(p, q) == 1 for p, q in zip(have, have[1:]))
            claims[f"{group}_ratio_rises_with_window"] = False if falls else verdict([cmp(have[0], have[-1])], -1)
        else:
            claims[f"{group}_ratio_rises_with_window"] = None
    at = {g: {p["W"]: p for p in pts if not math.isinf(p["W"]) and p[f"r{L_key}"] is not None}
          for g, pts in data["groups"].items()}
    rope_point = next(({"cell": c} for c, e in cells.items()
                       if window_of(e) == math.inf and str(L_key) in e["eval"]["lengths"]), None)
    data["rope_over_widest"] = {g: {"W": max(ws), **paired_ratio(row(rope_point), row(ws[max(ws)]), seed=L_key)}
                                for g, ws in at.items() if ws and rope_point}
    common = sorted(set(at["qkv"]) & set(at["qk"]))
    data["qkv_over_qk"] = [{"W": W, **paired_ratio(row(at["qkv"][W]), row(at["qk"][W]), seed=L_key)} for W in common]
    claims["qkv_flatter_than_qk_at_equal_window"] = (
        verdict([cmp(at["qkv"][W], at["qk"][W]) for W in common], -1) if common else None)
    return data, claims, {}


# M8 (b): (ungated cell, gated cell, claim on r at the longest length, claim on the far mass's growth)
GATE_PAIRS = (("path", "path_fox", "forget_gate_improves_extrapolation", "forget_gate_limits_far_mass_growth"),
              ("rot_random_qk", "rot_random_qk_fox", "gate_improves_rotations", "gate_limits_rotation_far_mass_growth"))


def ablation_summary(cells: dict, margins: dict | None = None) -> tuple[dict, dict, dict]:
    """M8: (a) the dispersion sweep τ (RoPE = τ 0), (b) far-mass control (PaTH vs PaTH-FoX, random rotations
    with and without a FoX gate), (c) NTK-scaled RoPE at evaluation.

    Claims: ``extrapolation_improves_with_dispersion`` (r at the longest L lower at the largest τ than at τ 0,
    and no step up in τ raising it; τ 0 is the RoPE cell of the sweep's training budget,
    ``data["dispersion_baseline"]``, and the claim is None without one); ``forget_gate_improves_extrapolation``
    (PaTH-FoX below PaTH); ``gate_improves_rotations`` (rot_random_qk_fox below rot_random_qk);
    ``forget_gate_limits_far_mass_growth`` and ``gate_limits_rotation_far_mass_growth`` (the gated cell's far
    mass, mean over layers at the per-head width, rises no more from the shortest to the longest length than its
    ungated twin's: PaTH-FoX against PaTH, rot_random_qk_fox against rot_random_qk); ``ntk_scaling_helps_rope``.
    The comparisons of r are decided by paired intervals (:mod:`pathlab.intervals`), beyond the study's spread
    between seeds at that length when ``margins`` are given, and None while undecided; every pair compared must
    share one training budget (:func:`one_budget`).
    """
    data, claims = {"seed_margins": dict(margins or {})}, {}

    def longer(a: dict, b: dict) -> int:
        """compare() of two cells' eval.json rows at the longest length, with the seed margin there."""
        L = max(int(x) for x in a["lengths"])
        return compare(longest_row(a), longest_row(b), margin=margin_at(margins, L))

    rows = {c: length_rows(e["eval"]) for c, e in cells.items()}
    taus = {}
    for c, e in cells.items():
        kw = e["cell"].get("attention_kwargs") or {}
        if kw.get("table") == "position" and "dispersion" in kw and "window" not in kw:
            taus[c] = float(kw["dispersion"])
    # τ = 0 is RoPE trained on the sweep's budget: a RoPE of another budget (the 100M-token headline cell beside
    # 50M-token sweep cells) differs from the sweep by its budget, not by its dispersion
    budget = one_budget({c: cells[c] for c in taus}, "the dispersion sweep")
    baseline = next((c for c, e in cells.items() if e["cell"]["attention"] == "rope" and tokens_of(e) == budget),
                    None) if taus else None
    data["dispersion_baseline"] = baseline
    sweep = []
    for c, tau in (({baseline: 0.0} if baseline else {}) | taus).items():
        e = cells[c]
        sweep.append({"tau": tau, "cell": c, "ratio_longest": rows[c]["ratio"][-1], "L": rows[c]["lengths"][-1],
                      "ratio_longest_ci95": [rows[c]["ratio_lo"][-1], rows[c]["ratio_hi"][-1]], "tokens": tokens_of(e),
                      "finite_window_fraction": (float(np.mean(np.isfinite(e["record"]["angles"]["W_emp"])))
                                                 if "angles" in e.get("record", {}) else None)})
    sweep.sort(key=lambda s: s["tau"])
    data["dispersion_sweep"] = sweep
    if taus:
        last = [cells[s["cell"]]["eval"] for s in sweep]
        steps = [longer(b, a) for a, b in zip(last, last[1:])]
        claims["extrapolation_improves_with_dispersion"] = (
            None if baseline is None else
            False if any(o == 1 for o in steps) else verdict([longer(last[-1], last[0])], -1))
    control, rho = {}, {}
    for a, b, ratio_claim, far_mass_claim in GATE_PAIRS:
        if not {a, b} <= set(cells):
            continue
        one_budget({a: cells[a], b: cells[b]}, ratio_claim)
        control[a], control[b] = rows[a], rows[b]
        claims[ratio_claim] = verdict([longer(cells[b]["eval"], cells[a]["eval"])], -1)
        if all("record" in cells[c] for c in (a, b)):
            fm, _, _ = far_mass_summary({c: cells[c] for c in (a, b)})
            rho |= {c: np.mean(np.asarray(fm["cells"][c]["measured"]), axis=1) for c in (a, b)}
            claims[far_mass_claim] = bool(rho[b][-1] - rho[b][0] <= rho[a][-1] - rho[a][0])
    data["far_mass_control"] = control
    if rho:
        data["far_mass_control_rho"] = rho
    if "rope" in cells and "ntk" in cells["rope"]["eval"]:
        data["ntk"] = {"rope": rows["rope"], "rope+ntk": length_rows(cells["rope"]["eval"], "ntk")}
        ev = cells["rope"]["eval"]
        # one trained model scored two ways: the spread between trainings is no margin for this comparison
        claims["ntk_scaling_helps_rope"] = verdict([compare(longest_row(ev, "ntk"), longest_row(ev))], -1)
    return data, claims, {}


def seeds_summary(cells: dict) -> tuple[dict, dict, dict]:
    """Each cell beside its second seed ``<cell>-seed2`` (initialisation, data order and random tables changed).

    ``data["pairs"][c]``: both seeds' r(L) and loss at the training length, and at every length the ratio
    r_seed1 / r_seed2 with its paired interval over windows. That interval holds the windows' spread only: where
    it excludes 1 at a length beyond the training length (``seeds_differ_beyond_windows``; None when the seeds
    were scored on other windows) the two trainings differ by more than the windows explain, and a comparison
    between cells is to be read against the spread between seeds as well.
    Claims: each pair claim of :func:`extrapolation_summary` made again on the second seeds alone
    (``<claim>_at_seed2``) where both cells have one, decided by the windows' paired interval alone: a claim that
    holds at one seed and fails at the other does not hold at this scale.
    """
    data = {"pairs": {}}
    twins = {}
    for c in cells:
        twin = f"{c}-seed2"
        if twin in cells:
            twins[c] = cells[twin]
            a, b = length_rows(cells[c]["eval"]), length_rows(cells[twin]["eval"])
            table = paired_table(cells[c]["eval"], cells[twin]["eval"])
            data["pairs"][c] = {"lengths": a["lengths"], "seed1": a["ratio"], "seed2": b["ratio"],
                                "loss_seed1": a["loss"][0], "loss_seed2": b["loss"][0],
                                "seed_ratio": [{"L": t["length"], "ratio": t["ratio"], "paired_ci95": t["paired_ci95"]}
                                               for t in table],
                                "seeds_differ_beyond_windows": _beyond_windows(table[1:])}
    # the replication itself: no margin here, since a second seed that ranks two cells the other way widens the
    # spread between seeds by at least as much as it moves the comparison
    return data, pair_claims(twins, "_at_seed2"), {}


def _beyond_windows(table: list[dict]) -> bool | None:
    """Whether any paired interval of these ``paired_table`` rows excludes 1; None when none has one (other
    windows)."""
    decided = [order(t["paired_ci95"], (1.0, 1.0)) for t in table if t["paired_ci95"] is not None]
    return any(o != 0 for o in decided) if decided else None


def extrapolation_markdown(data: dict) -> str:
    """Table N1: r(L) per cell and length (95% interval), and the published ratios in their own table."""
    cells = data["cells"]
    lengths = sorted({L for r in cells.values() for L in r["lengths"]})
    head = "| cell | " + " | ".join(f"r({L // 1024}K)" if L >= 1024 else f"r({L})" for L in lengths) + " |"
    lines = [head, "|---" * (len(lengths) + 1) + "|"]
    for c, r in cells.items():
        vals = {L: f"{x:.2f} [{lo:.2f}, {hi:.2f}]" for L, x, lo, hi in zip(r["lengths"], r["ratio"], r["ratio_lo"],
                                                                           r["ratio_hi"])}
        lines.append(f"| {c} | " + " | ".join(vals.get(L, "—") for L in lengths) + " |")
    lines += ["", "| published (L_train = 512) | L | r(L) |", "|---|---|---|"]
    lines += [f"| {p['model']} | {p['L']} | {p['ratio']} |" for p in data["published"]]
    return "\n".join(lines)


def fixed_widths(cells: dict) -> list[str]:
    """The fixed near-set widths every cell was measured with (labels, e.g. ["64", "128"])."""
    labels = [set(str(x) for x in np.atleast_1d(e["record"]["width_labels"])) - {"per-head"} for e in cells.values()]
    common = set.intersection(*labels) if labels else set()
    return sorted(common, key=float)
