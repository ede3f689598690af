"""Plotting helpers shared by the notebooks: one function per figure, each returning the matplotlib Figure.

The functions take the ``data`` dicts produced by :mod:`pathlab.probes.synthetic` and :mod:`pathlab.probes.model`
(the same numbers that go into the JSON sidecar), so a figure can be redrawn from its JSON alone.
"""

from __future__ import annotations

import math
import os

import numpy as np


def setup(style: str = "default"):
    """Deterministic, compact matplotlib defaults; returns pyplot."""
    import matplotlib

    if not os.environ.get("DISPLAY") and "ipykernel" not in os.environ.get("MPLBACKEND", "") and \
            matplotlib.get_backend().lower() not in ("module://matplotlib_inline.backend_inline", "inline"):
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.style.use(style)
    plt.rcParams.update({"figure.dpi": 110, "savefig.dpi": 150, "axes.grid": True, "grid.alpha": 0.3,
                         "font.size": 9, "legend.fontsize": 7, "axes.titlesize": 9, "svg.hashsalt": "pathlab",
                         "figure.constrained_layout.use": True})
    return plt


def length_axis(ax, lengths, log_y: bool = False):
    """x ticks at the evaluation lengths (no minor labels); plain numbers on a log y axis."""
    from matplotlib.ticker import NullFormatter

    lengths = sorted({int(L) for L in lengths})
    ax.set_xticks(lengths, [f"{L // 1024}K" if L >= 1024 and L % 1024 == 0 else str(L) for L in lengths])
    ax.xaxis.set_minor_formatter(NullFormatter())
    if log_y:
        lo, hi = ax.dataLim.y0, ax.dataLim.y1
        if lo > 0 and hi / lo < 10:  # less than a decade: a linear axis reads better
            ax.set_yscale("linear")


def _arr(x):
    return np.asarray([np.nan if v is None else v for v in x], dtype=float) if isinstance(x, list) else np.asarray(x)


# ---------------------------------------------------------------------------------------------------------------- M1


def plot_mixing(data):
    """Fig N1: c(n) on log axes for every ensemble (dashed: γ^n), and the per-block windows of RoPE-scaled angles."""
    plt = setup()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [1.6, 1]})
    for i, (label, cur) in enumerate(data["curves"].items()):
        color = f"C{i % 10}"
        w = cur["W_pred"]
        wtxt = "" if w is None or not math.isfinite(w) else (f", W={w:.0f}" if w < 1e5 else f", W≈{w:.0e}")
        ax.plot(cur["n"], _arr(cur["c"]), color=color, lw=1.3, label=f"{label}{wtxt}")
        ax.plot(cur["n"], _arr(cur["c_pred"]), color=color, lw=0.8, ls="--")
    ax.axhline(data["eps"], color="k", lw=0.8, ls=":", label=f"ε = {data['eps']}")
    ax.axhline(data["noise_floor"], color="grey", lw=0.8, ls="-.", label="noise floor (SO(2))")
    ax.set(xscale="log", yscale="log", ylim=(5e-3, 1.5), xlabel="path length n",
           ylabel="coherence c(n)", title="M1: accumulated products mix within a finite window (dashed: γⁿ)")
    ax.legend(loc="lower left", ncol=2, fontsize=6, framealpha=0.6)
    pb = data["per_block_rope_scaled"]
    ax2.plot(range(len(pb["W_pred"])), _arr(pb["W_pred"]), "o-", ms=3, label="W(0.05) predicted")
    emp = _arr(pb["W_emp"])
    ax2.plot(range(len(emp)), np.where(np.isfinite(emp), emp, np.nan), "x", label="W(0.05) simulated")
    ax2.set(yscale="log", xlabel="block b (ω_b = 10000^(−2b/d))", ylabel="mixing window",
            title="θ = ω_b ξ, ξ~U[0,2]: slow blocks barely mix")
    ax2.legend()
    return fig


# ---------------------------------------------------------------------------------------------------------------- M3


def plot_tails(data):
    """M3 synthetic: empirical far-score tails against the sphere, Lévy and Hoeffding bounds, per d."""
    plt = setup()
    dims = list(data["dims"])
    fig, axes = plt.subplots(1, len(dims), figsize=(3.4 * len(dims), 3.2), sharey=True)
    for ax, d in zip(np.atleast_1d(axes), dims):
        e = data["dims"][d]
        x = _arr(e["t_over_scale"]) * math.sqrt(int(d))
        ax.plot(x, _arr(e["tail_haar"]), "C0", label="Haar transport (empirical)")
        ax.plot(x, _arr(e["tail_block"]), "C1", label="block SO(2) (empirical)")
        ax.plot(x, _arr(e["bound_sphere"]), "C0--", lw=0.9, label="sphere exp(−d u²/2)")
        ax.plot(x, _arr(e["bound_levy"]), "C2:", lw=0.9, label="Lévy, c = 1/8")
        ax.plot(x, _arr(e["bound_hoeffding"]), "C1--", lw=0.9, label="Hoeffding")
        ax.set(yscale="log", ylim=(1e-5, 1.5), xlabel="t · √d / (‖q‖‖k‖)",
               title=f"d = {d}: Var/theory = {e['var_haar'] / e['var_theory']:.3f}")
    np.atleast_1d(axes)[0].set_ylabel("P(|qᵀPk| ≥ t)")
    np.atleast_1d(axes)[0].legend(loc="lower left")
    return fig


# ---------------------------------------------------------------------------------------------------------------- M4


def plot_toy_far_mass(data):
    """M4 toy model: simulated ρ_D vs the logistic M_L/(M_L + e^Γ), with the reference values."""
    plt = setup()
    fig, ax = plt.subplots(figsize=(5, 3.4))
    ax.plot(data["m_far"], _arr(data["formula"]), "k-", lw=1, label="M_L / (M_L + K·exp(a − σ²/2))")
    ax.plot(data["m_far"], _arr(data["simulated"]), "o", ms=4, label=f"simulated ({data['trials']} trials)")
    ax.plot(data["reference_m_far"], data["reference_far_mass"], "x", ms=8, color="C3", label="reference values")
    ax.axvline(math.exp(data["gap"]), color="grey", ls=":", lw=0.8, label="midpoint exp(Γ)")
    ax.set(xscale="log", xlabel="far tokens M_L", ylabel="far mass ρ_D",
           title=f"M4 toy model: K={data['K']} near keys at s={data['near_score']}, far s~N(0,{data['far_sigma']}²)")
    ax.legend()
    return fig


# ---------------------------------------------------------------------------------------------------------------- M5


def plot_bound(data):
    """M5: the bound M_L/(M_L + K e^{2λ}) against M_L, and simulated far mass of random bounded logits above it."""
    plt = setup()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    styles = {32: ":", 64: "-", 512: "--"}
    lams = sorted({float(k.split("λ=")[1]) for k in data["curves"]})
    for label, y in data["curves"].items():
        k = int(label.split(",")[0][2:])
        lam = float(label.split("λ=")[1])
        ax.plot(data["m_far"], _arr(y), styles[k], color=f"C{lams.index(lam)}", label=label)
    ax.set(xscale="log", xlabel="far tokens M_L", ylabel="lower bound on ρ_D", title="M5: far-mass lower bound")
    ax.legend(ncol=3, fontsize=6)
    for i, (dist, rows) in enumerate(data["simulations_K64_lambda3"].items()):
        m = [r["m_far"] for r in rows]
        ax2.plot(m, [r["min_far_mass"] for r in rows], "o-", ms=3, color=f"C{i}", label=f"min ρ_D, {dist}")
    rows = data["simulations_K64_lambda3"]["uniform"]
    ax2.plot([r["m_far"] for r in rows], [r["bound"] for r in rows], "k--", label="bound (K=64, λ=3)")
    ax2.set(xscale="log", xlabel="far tokens M_L", ylabel="far mass",
            title="random logits with |s| ≤ 3 never fall below the bound")
    ax2.legend()
    return fig


# ---------------------------------------------------------------------------------------------------------------- M6


def plot_incoherence(data):
    """M6 synthetic: κ vs M against 1/√M (fully mixed) and the closed form for Gaussian phase walks."""
    plt = setup()
    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    m = data["m"]
    ax.plot(m, _arr(data["qk"]), "s-", ms=4, color="C3", label="Q/K only: κ = 1 (coherent)")
    ax.plot(m, _arr(data["qkv_fully_mixed"]), "o", ms=5, color="C0", label="Q/K/V, fully mixed phases")
    ax.plot(m, _arr(data["one_over_sqrt_m"]), "C0--", lw=0.9, label="1/√M")
    for i, (sigma, w) in enumerate(data["walks"].items()):
        ax.plot(w["m"], _arr(w["qkv"]), "^", ms=4, color=f"C{i + 1}", label=f"Q/K/V, phase walk σ={sigma}")
        ax.plot(w["m"], _arr(w["predicted"]), "--", lw=0.9, color=f"C{i + 1}")
    ax.set(xscale="log", yscale="log", xlabel="far tokens M (equal weights)",
           ylabel="κ = ‖Σ α P b‖ / (ρ_D ‖b‖)", title="M6: rotated values combine incoherently")
    ax.legend(fontsize=6)
    return fig


# ---------------------------------------------------------------------------------------------------------------- trained models

LENGTH_STYLES = ["-", "--", ":", "-.", (0, (1, 1)), (0, (5, 1))]


def _note(fig, note):
    """The figure's line about the models it shows (study, toy scale, cells not yet run)."""
    if note:
        fig.suptitle(note, fontsize=7, color="0.35")


def _legend_below(ax, ncol=3):
    """A legend under the axes, so that it never covers data."""
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=ncol, fontsize=6, frameon=False)


def _plain_axes(ax):
    """No offset or scientific notation on linear axes: small differences must not look like large ones."""
    for axis in (ax.xaxis, ax.yaxis):
        fmt = axis.get_major_formatter()
        if hasattr(fmt, "set_useOffset"):
            fmt.set_useOffset(False)


def _positive(x):
    """Values for a log axis: non-positive values become NaN (a gap), never a cliff to the axis floor."""
    a = _arr(x).astype(float)
    return np.where(a > 0, a, np.nan)


def _length_label(L) -> str:
    L = int(L)
    return f"{L // 1024}K" if L >= 1024 and L % 1024 == 0 else str(L)


def plot_learned(data, note=""):
    """M2: learned windows W_{h,b} (histogram) and per-block γ of the cells with step angles (panels left out when
    none has them), and ρ_s(n) at the first and the longest length."""
    plt = setup()
    with_angles = [(i, c, r) for i, (c, r) in enumerate(data["cells"].items()) if "W_emp" in r]
    n_panels = 3 if with_angles else 1
    fig, axes = plt.subplots(1, n_panels, figsize=(4.2 * n_panels + 0.5, 4.0), squeeze=False)
    axes = axes[0]
    if with_angles:
        ax = axes[0]
        # cells that share an angle table (Q/K and Q/K/V of one window) draw the same curves: a line style each
        # keeps both visible
        for k, (i, c, r) in enumerate(with_angles):
            style = ("-", "--", "-.", ":")[k % 4]
            w = _arr(r["W_emp"]).ravel()
            finite = w[np.isfinite(w)]
            if finite.size:
                ax.hist(finite, bins=np.geomspace(1, max(finite.max(), 2) * 1.1, 25), histtype="step", ls=style,
                        color=f"C{i}", label=f"{c}: {np.mean(np.isfinite(w)):.0%} of blocks mix")
            gamma = _arr(r["gamma"])
            axes[1].plot(np.median(gamma.reshape(-1, gamma.shape[-1]), axis=0), marker="o", ls=style, ms=3,
                         color=f"C{i}", label=c)
        ax.set(xscale="log", xlabel=f"mixing window W(ε={data.get('eps', 0.05)}) of a block",
               ylabel="blocks (layers × heads)", title="M2: learned mixing windows")
        axes[1].set(xlabel="block b", ylabel="γ_b, median over layers and heads", ylim=(0, 1.05),
                    title="per-block spectral gap γ_b = |mean exp(iθ)|")
        _legend_below(ax, 1)
        _legend_below(axes[1], 2)
    ax = axes[-1]
    for i, (c, r) in enumerate(data["cells"].items()):
        Ls = sorted(r.get("rho_s", {}), key=int)
        for j, L in enumerate(Ls[:1] + Ls[-1:] if len(Ls) > 1 else Ls):
            cur = r["rho_s"][L]
            ax.plot(np.maximum(_arr(cur["n"]), 0.5), _arr(cur["rho_s"]), color=f"C{i}", ls=LENGTH_STYLES[j],
                    label=f"{c}, L={_length_label(L)}")
    ax.axhline(0, color="k", lw=0.5)
    ax.set(xscale="log", xlabel="distance n = i − j", ylabel="ρ_s(n) = E[s s⁰] / E[s⁰²]",
           title="score-weighted decorrelation (solid: training length)")
    _plain_axes(ax)
    _legend_below(ax, 2)
    _note(fig, note)
    return fig



def plot_windows(data, note=""):
    """M2 near sets: ρ_s at the training length against ρ̂_s from the step angles, and the width W_h of every
    (layer, head) (crosses: heads without a window, given the training length)."""
    plt = setup()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10.5, 4.0))
    cells = list(data["cells"])
    for i, c in enumerate(cells):
        r = data["cells"][c]
        Ls = sorted(r.get("rho_s", {}), key=int)
        if Ls:
            cur = r["rho_s"][Ls[0]]
            ax.plot(np.maximum(_arr(cur["n"]), 0.5), _arr(cur["rho_s"]), color=f"C{i}", label=f"{c}: measured")
        if "rho_s_pred" in r:
            ax.plot(_arr(r["m2_lags"]), _arr(r["rho_s_pred"]), "--", color=f"C{i}", label=f"{c}: from the angles")
        W = _arr(r["W_heads"]).ravel()
        fell = np.asarray(r["source"]).ravel() == "fallback"
        x = i + np.linspace(-0.3, 0.3, W.size)
        ax2.scatter(x[~fell], W[~fell], s=10, color=f"C{i}")
        ax2.scatter(x[fell], W[fell], s=14, marker="x", color=f"C{i}")
    ax.axhline(0, color="k", lw=0.5)
    ax.set(xscale="log", xlabel="distance n = i − j", ylabel="ρ_s(n), median head",
           title="ρ_s at the training length vs ρ̂_s from the angles")
    _plain_axes(ax)
    _legend_below(ax, 2)
    ax2.set(yscale="log", xticks=range(len(cells)), ylabel="near-set width W_h",
            title="per (layer, head) widths (×: no window, training length used)")
    ax2.set_xticklabels(cells, rotation=30, ha="right", fontsize=6)
    _note(fig, note)
    return fig


def plot_scores_model(data, note=""):
    """M3: μ(n) ± σ(n) and log m(n) of the first layer (median head) at the first and the longest length."""
    plt = setup()
    cells = list(data["cells"])
    fig, axes = plt.subplots(2, len(cells), figsize=(3.1 * len(cells) + 0.6, 5.6), squeeze=False)
    for col, c in enumerate(cells):
        rows = {L: r for L, r in data["cells"][c].items() if L.isdigit()}
        Ls = sorted(rows, key=int)
        for j, L in enumerate(Ls[:1] + Ls[-1:] if len(Ls) > 1 else Ls):
            r = rows[L]
            n = np.maximum(_arr(r["n"]), 0.5)
            mu, sd = _arr(r["mean_first"]), _arr(r["std_first"])
            axes[0, col].plot(n, mu, color=f"C{j}", ls=LENGTH_STYLES[j], label=f"L={_length_label(L)}")
            axes[0, col].fill_between(n, mu - sd, mu + sd, color=f"C{j}", alpha=0.12)
            axes[1, col].plot(n, _arr(r["log_mean_exp_first"]), color=f"C{j}", ls=LENGTH_STYLES[j],
                              label=f"L={_length_label(L)}")
        if Ls:
            for ax in axes[:, col]:
                ax.axvline(rows[Ls[0]]["W"], color="grey", lw=0.7, ls=":")
                ax.axvline(int(Ls[0]), color="k", lw=0.7, ls="--")
                _plain_axes(ax)
        axes[0, col].set(xscale="log", title=c, xlabel="distance n")
        axes[1, col].set(xscale="log", xlabel="distance n")
        axes[0, col].legend(fontsize=6, loc="best")
    axes[0, 0].set_ylabel("μ(n) ± σ(n), first layer (median head)")
    axes[1, 0].set_ylabel("log m(n) = log E exp(s)")
    _note(fig, (note + "; " if note else "") + "dotted: near-set width W, dashed: training length")
    return fig


def plot_far_mass_model(by_width: dict, note=""):
    """M4: far mass against L (solid, mean over layers of the median head) and the prediction from the
    training-length Γ̂ (dashed, where some head is predictable), one panel per near-set width."""
    plt = setup()
    fig, axes = plt.subplots(1, len(by_width), figsize=(5.2 * len(by_width), 4.2), squeeze=False)
    for ax, (label, data) in zip(axes[0], by_width.items()):
        for i, (c, r) in enumerate(data["cells"].items()):
            L = r["lengths"]
            ax.plot(L, np.mean(_arr(r["measured"]), axis=1), "o-", ms=3, color=f"C{i}",
                    label=f"{c} ({r['predictable_fraction']:.0%} predictable)")
            pred = _arr(r["predicted"])
            if np.isfinite(pred).any():
                with np.errstate(all="ignore"):
                    ax.plot(L, np.nanmean(np.where(np.isfinite(pred), pred, np.nan), axis=1), "--", color=f"C{i}",
                            lw=0.9)
        ax.set(xscale="log", xlabel="evaluation length L", ylabel="far mass ρ_D (median head, mean layer)",
               ylim=(-0.02, 1.02), title=f"M4, near set W = {label} (dashed: predicted from the training length)")
        length_axis(ax, [L for r in data["cells"].values() for L in r["lengths"]])
        _legend_below(ax, 2)
    _note(fig, note)
    return fig


def plot_bound_model(data, note=""):
    """M5: measured ρ_D against the bound for sampled queries at the longest length (all above y = x), and the
    median λ against L."""
    plt = setup()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10.5, 4.2))
    for i, (c, r) in enumerate(data["cells"].items()):
        rows = r["lengths"]
        Ls = sorted(rows, key=int)
        last = rows[Ls[-1]]
        if "bound" in last:
            ax.scatter(_arr(last["bound"]), _arr(last["far_mass"]), s=4, alpha=0.5, color=f"C{i}", label=c)
        ax2.plot([int(L) for L in Ls], [rows[L]["lam_median"] for L in Ls], "o-", ms=3, color=f"C{i}", label=c)
    ax.plot([0, 1], [0, 1], "k--", lw=0.8)
    ax.set(xlabel="bound M_L / (M_L + K·exp(2λ))", ylabel="measured far mass ρ_D", xlim=(-0.02, 1.02),
           ylim=(-0.02, 1.02), title=f"M5: {data['violations']} of {data['checked']} queries below the bound")
    _legend_below(ax, 3)
    ax2.set(xscale="log", yscale="log", xlabel="evaluation length L", ylabel="median λ = max_j |s_ij|",
            title="bounded logits (rotations) vs unbounded (ALiBi, gates)")
    length_axis(ax2, [int(L) for r in data["cells"].values() for L in r["lengths"]], log_y=True)
    _legend_below(ax2, 3)
    _note(fig, note)
    return fig


def plot_coherence_model(data, note=""):
    """M6: κ against the incoherent prediction √(1 + 2W)/√M_eff per sampled query (longest length), and
    ‖o_F‖/‖o_N‖ against L."""
    plt = setup()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10.5, 4.2))
    lo, hi = 1.0, 1.0
    for i, (c, r) in enumerate(data["cells"].items()):
        pred, kappa = _positive(r.get("predicted", [])), _positive(r.get("kappa", []))
        if np.isfinite(pred).any() and np.isfinite(kappa).any():
            ax.scatter(pred, kappa, s=5, alpha=0.5, color=f"C{i}", label=c)
            lo = min(lo, np.nanmin(pred), np.nanmin(kappa))
            hi = max(hi, np.nanmax(pred), np.nanmax(kappa))
        ax2.plot(r["lengths"], _positive(r["far_near_ratio"]), "o-", ms=3, color=f"C{i}", label=c)
    x = np.geomspace(lo, hi, 10)
    ax.plot(x, x, "k--", lw=0.8, label="κ = √(1+2W)/√M_eff")
    ax.axhline(1, color="grey", lw=0.6, ls=":")
    ax.set(xscale="log", yscale="log", xlabel="√(1 + 2W) / √M_eff (incoherent far background)",
           ylabel="coherence ratio κ", title="M6: Q/K keeps κ = 1, Q/K/V combines incoherently")
    _legend_below(ax, 2)
    ax2.set(xscale="log", yscale="log", xlabel="evaluation length L", ylabel="median ‖o_F‖ / ‖o_N‖",
            title="far-to-near output norm")
    length_axis(ax2, [L for r in data["cells"].values() for L in r["lengths"]], log_y=True)
    _legend_below(ax2, 2)
    _note(fig, note)
    return fig


def plot_extrapolation(data, note=""):
    """M7: r(L) against L with 95% bootstrap bands (dashed: a cell's second seed, where ``data["seeds"]`` has
    one), the per-position loss at the longest L (long context against the context cut at the training length),
    and the published ratios in a table of their own."""
    plt = setup()
    fig, (ax, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 4.2), gridspec_kw={"width_ratios": [1.2, 1.2, 0.8]})
    twins = data.get("seeds", {}).get("pairs", {})
    for i, (c, r) in enumerate(data["cells"].items()):
        L = np.asarray(r["lengths"])
        ax.plot(L, _positive(r["ratio"]), "o-", ms=3, color=f"C{i}", label=c)
        ax.fill_between(L, _positive(r["ratio_lo"]), _positive(r["ratio_hi"]), color=f"C{i}", alpha=0.15)
        if c in twins:
            ax.plot(twins[c]["lengths"], _positive(twins[c]["seed2"]), "--", lw=0.9, color=f"C{i}")
        pos = np.maximum(_arr(r["position"]), 0.5)
        ax2.plot(pos, _arr(r["position_loss"]), color=f"C{i}", label=c)
        ax2.plot(pos, _arr(r["position_loss_train_context"]), color=f"C{i}", lw=0.6, ls=":")
    ax.axhline(1, color="k", lw=0.5)
    ax.set(xscale="log", yscale="log", xlabel="evaluation length L", ylabel="r(L) = PPL(L) / PPL_train(L)",
           title="M7: perplexity ratio on the same tokens (bands: 95%)"
                 + ("; dashed: second seed" if twins else ""))
    if data["cells"]:
        length_axis(ax, [L for r in data["cells"].values() for L in r["lengths"]], log_y=True)
        ax2.axvline(next(iter(data["cells"].values()))["train_length"], color="grey", ls="--", lw=0.8)
    _legend_below(ax, 3)
    ax2.set(xscale="log", xlabel="position t (dashed: training length)", ylabel="loss(t), bucket mean",
            title="per-position loss at the longest L (dotted: context cut at L_train)")
    _plain_axes(ax2)
    ax3.axis("off")
    rows = [[p["model"], _length_label(p["L"]), f"{p['ratio']}×"] for p in data["published"]]
    table = ax3.table(cellText=rows, colLabels=["published (L_train 512)", "L", "r(L)"], loc="center",
                      cellLoc="left", colWidths=[0.74, 0.12, 0.14])
    table.auto_set_font_size(False)
    table.set_fontsize(6)
    table.scale(1, 1.3)
    _note(fig, note)
    return fig


def plot_window_sweep(data, note=""):
    """The theory's test: r at the evaluation lengths and the in-distribution loss against the mixing window W
    of the rotations, Q/K/V and Q/K (RoPE at W = ∞, the right edge, closes the Q/K curve), with the training
    length marked."""
    plt = setup()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10.5, 4.2))
    L_train = data.get("train_length")
    finite = sorted({p["W"] for pts in data["groups"].values() for p in pts if math.isfinite(p["W"])})
    inf_x = finite[-1] * 4 if finite else 1.0
    markers = {"qkv": "o", "qk": "s"}
    drawn = False
    for gi, (g, pts) in enumerate(data["groups"].items()):
        for j, L in enumerate(data["lengths"]):
            have = [p for p in pts if p.get(f"r{L}") is not None]
            if not have:
                continue
            drawn = True
            xs = [p["W"] if math.isfinite(p["W"]) else inf_x for p in have]
            ys = np.array([p[f"r{L}"] for p in have])
            ci = np.array([p[f"r{L}_ci"] for p in have], dtype=float)
            ax.errorbar(xs, ys, yerr=np.abs(ci.T - ys), fmt=markers[g], ls=LENGTH_STYLES[j], ms=4, capsize=2,
                        color=f"C{gi}", label=f"{g.upper()}, r({_length_label(L)})")
        if pts:
            xs = [p["W"] if math.isfinite(p["W"]) else inf_x for p in pts]
            ax2.plot(xs, [p["loss_train_length"] for p in pts], markers[g] + "-", ms=4, color=f"C{gi}",
                     label=g.upper())
    for a in (ax, ax2):
        if L_train:
            a.axvline(L_train, color="k", ls="--", lw=0.8)
        a.set_xscale("log")
        a.set_xticks(finite + [inf_x], [str(int(t)) for t in finite] + ["∞ (RoPE)"])
        a.minorticks_off()
    if not drawn:
        ax.text(0.5, 0.5, "no sweep cell has results yet", ha="center", va="center", transform=ax.transAxes)
    ax.set(yscale="log", xlabel="mixing window W (dashed: training length)", ylabel="r(L) = PPL(L) / PPL_train(L)",
           title="extrapolation against the mixing window")
    if drawn:
        _legend_below(ax, 2)
    ax2.set(xlabel="mixing window W", ylabel="loss at the training length", title="in-distribution cost")
    _plain_axes(ax2)
    if any(data["groups"].values()):
        _legend_below(ax2, 2)
    _note(fig, note)
    return fig


def plot_ablations(data, note=""):
    """M8: (a) the dispersion sweep, (b) far-mass control (forget gates), (c) NTK-scaled RoPE: one panel for each
    ablation whose cells have results (a sweep from two values of τ on)."""
    plt = setup()
    panels = [("dispersion_sweep", "(a) more dispersion, more mixing"),
              ("far_mass_control", "(b) far-mass control: forget gates"), ("ntk", "(c) NTK-scaled RoPE")]
    panels = [p for p in panels if len(data.get(p[0]) or ()) >= (2 if p[0] == "dispersion_sweep" else 1)]
    if not panels:
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.axis("off")
        ax.text(0.5, 0.5, "no ablation cell has results yet", ha="center", va="center")
        _note(fig, note)
        return fig
    fig, axes = plt.subplots(1, len(panels), figsize=(4.3 * len(panels) + 0.6, 4.0), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        if key == "dispersion_sweep":
            sweep = data[key]
            r = np.array([s["ratio_longest"] for s in sweep], dtype=float)
            ci = np.array([s.get("ratio_longest_ci95") or (np.nan, np.nan) for s in sweep], dtype=float)
            ax.errorbar([s["tau"] for s in sweep], r, yerr=[r - ci[:, 0], ci[:, 1] - r], fmt="o-", capsize=3,
                        label="95% interval over windows")
            for s in sweep:
                ax.annotate(s["cell"], (s["tau"], s["ratio_longest"]), fontsize=6)
            ax.set(xlabel="angle dispersion τ (ξ ~ 1 + τ U[−1, 1], i.i.d.)", ylabel="r at the longest L",
                   title=title)
            _plain_axes(ax)
            continue
        for i, (c, r) in enumerate(data[key].items()):
            ax.plot(r["lengths"], _positive(r["ratio"]), "o-", ms=3, color=f"C{i}", label=c)
        ax.set(xscale="log", yscale="log", xlabel="evaluation length L", ylabel="r(L)", title=title)
        length_axis(ax, [L for r in data[key].values() for L in r["lengths"]], log_y=True)
        _legend_below(ax, 2)
    _note(fig, note)
    return fig
