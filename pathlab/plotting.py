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


def plot_learned(data):
    """M2: learned windows W_{h,b} (histogram), per-block γ, and ρ_s(n) at every evaluation length."""
    plt = setup()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    ax = axes[0]
    for i, (v, r) in enumerate(data["variants"].items()):
        if "W_emp" not in r:
            continue
        w = _arr(r["W_emp"]).ravel()
        finite = w[np.isfinite(w)]
        if finite.size:
            ax.hist(finite, bins=np.geomspace(1, max(finite.max(), 2) * 1.1, 25), histtype="step", color=f"C{i}",
                    label=f"{v}: {np.mean(np.isfinite(w)):.0%} of blocks mix")
        gamma = _arr(r["gamma"])
        axes[1].plot(np.median(gamma.reshape(-1, gamma.shape[-1]), axis=0), "o-", ms=3, color=f"C{i}", label=v)
    ax.set(xscale="log", xlabel=f"mixing window W(ε={data['eps']}) of a block", ylabel="blocks (layers × heads)",
           title="M2: learned mixing windows (training length)")
    ax.legend(fontsize=6)
    axes[1].set(xlabel="block b", ylabel="γ_b = |mean exp(iθ)| (median over layers, heads)", ylim=(0, 1.05),
                title="per-block spectral gap")
    axes[1].legend(fontsize=6)
    ax = axes[2]
    for i, (v, r) in enumerate(data["variants"].items()):
        for j, (L, c) in enumerate(sorted(r.get("rho_s", {}).items(), key=lambda t: int(t[0]))):
            ax.plot(np.maximum(_arr(c["n"]), 0.5), _arr(c["rho_s"]), color=f"C{i}",
                    ls=LENGTH_STYLES[j % len(LENGTH_STYLES)], label=f"{v}, L={L}")
    ax.axhline(0, color="k", lw=0.5)
    ax.set(xscale="log", xlabel="distance n = i − j", ylabel="ρ_s(n) = E[s s⁰] / E[s⁰²]",
           title="score-weighted decorrelation")
    ax.legend(fontsize=6, ncol=2)
    return fig


def plot_scores_model(data):
    """M3 on trained models: μ(n) ± σ(n) and log m(n) of the first layer, one panel per variant, all lengths."""
    plt = setup()
    variants = list(data["variants"])
    fig, axes = plt.subplots(2, len(variants), figsize=(3.2 * len(variants), 5.4), squeeze=False)
    for c, v in enumerate(variants):
        for j, (L, r) in enumerate(sorted(data["variants"][v].items(), key=lambda t: int(t[0]))):
            n = np.maximum(_arr(r["n"]), 0.5)
            mu, sd = _arr(r["mean_layer0"]), _arr(r["std_layer0"])
            ls = LENGTH_STYLES[j % len(LENGTH_STYLES)]
            axes[0, c].plot(n, mu, color=f"C{j}", ls=ls, label=f"L={L}")
            axes[0, c].fill_between(n, mu - sd, mu + sd, color=f"C{j}", alpha=0.12)
            axes[1, c].plot(n, _arr(r["log_mean_exp_layer0"]), color=f"C{j}", ls=ls, label=f"L={L}")
            if j == 0:
                for ax in axes[:, c]:
                    ax.axvline(r["W"][0], color="grey", lw=0.7, ls=":")
        axes[0, c].set(xscale="log", title=v, xlabel="distance n")
        axes[1, c].set(xscale="log", xlabel="distance n")
    axes[0, 0].set_ylabel("μ(n) ± σ(n), layer 0 (median head)")
    axes[1, 0].set_ylabel("log m(n) = log E exp(s)")
    axes[0, 0].legend(fontsize=6)
    fig.suptitle("M3: score statistics against distance (dotted: near-set width W)", fontsize=9)
    return fig


def plot_far_mass_model(data):
    """M4 on trained models: far mass against L (solid, mean over layers) and the prediction from Γ̂ (dashed)."""
    plt = setup()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for i, (v, r) in enumerate(data["variants"].items()):
        L = r["lengths"]
        ax.plot(L, np.mean(_arr(r["measured"]), axis=1), "o-", ms=3, color=f"C{i}", label=v)
        ax.plot(L, np.mean(_arr(r["predicted"]), axis=1), "--", color=f"C{i}", lw=0.9)
    ax.set(xscale="log", xlabel="evaluation length L", ylabel="far mass ρ_D (median head, mean layer)",
           ylim=(-0.02, 1.02), title="M4: far mass vs length (dashed: predicted from training-length Γ̂)")
    length_axis(ax, [L for r in data["variants"].values() for L in r["lengths"]])
    ax.legend(fontsize=6)
    return fig


def plot_bound_model(data):
    """M5 on trained models: measured ρ_D against the bound for every sampled query; all points above y = x."""
    plt = setup()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, (v, rows) in enumerate(data["variants"].items()):
        Lmax = max(rows, key=int)
        r = rows[Lmax]
        ax.scatter(_arr(r["bound"]), _arr(r["far_mass"]), s=4, alpha=0.5, color=f"C{i}", label=f"{v} (L={Lmax})")
        Ls = sorted(rows, key=int)
        ax2.plot([int(L) for L in Ls], [rows[L]["lam_median"] for L in Ls], "o-", ms=3, color=f"C{i}", label=v)
    ax.plot([0, 1], [0, 1], "k--", lw=0.8)
    ax.set(xlabel="bound M_L / (M_L + K·exp(2λ))", ylabel="measured far mass ρ_D", xlim=(-0.02, 1.02),
           ylim=(-0.02, 1.02), title="M5: every query lies above the diagonal")
    ax.legend(fontsize=6, markerscale=3)
    ax2.set(xscale="log", yscale="log", xlabel="evaluation length L", ylabel="median λ = max_j |s_ij|",
            title="bounded logits (rotations) vs unbounded (ALiBi, FoX gates)")
    length_axis(ax2, [int(L) for rows in data["variants"].values() for L in rows], log_y=True)
    ax2.legend(fontsize=6)
    return fig


def plot_coherence_model(data):
    """M6 on trained models: κ against 1/√M_eff per query (Q/K/V), κ = 1 for Q/K; ‖o_F‖/‖o_N‖ against L."""
    plt = setup()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, (v, r) in enumerate(data["variants"].items()):
        if "kappa" in r:
            ax.scatter(_arr(r["inv_sqrt_meff"]), _arr(r["kappa"]), s=5, alpha=0.5, color=f"C{i}", label=v)
        ax2.plot(r["lengths"], _arr(r["far_near_ratio"]), "o-", ms=3, color=f"C{i}", label=v)
    x = np.geomspace(1e-3, 1, 10)
    ax.plot(x, x, "k--", lw=0.8, label="κ = 1/√M_eff")
    ax.set(xscale="log", yscale="log", xlabel="1/√M_eff", ylabel="coherence ratio κ",
           title="M6: far background, Q/K vs Q/K/V (largest L)")
    ax.legend(fontsize=6, markerscale=3)
    ax2.set(xscale="log", yscale="log", xlabel="evaluation length L", ylabel="median ‖o_F‖ / ‖o_N‖",
            title="far-to-near output norm")
    length_axis(ax2, [L for r in data["variants"].values() for L in r["lengths"]], log_y=True)
    ax2.legend(fontsize=6)
    return fig


def plot_extrapolation(data):
    """M7: perplexity ratio r(L) against L / L_train (published ratios as crosses), and per-position loss."""
    plt = setup()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10.5, 3.8))
    names = list(data["variants"])
    for i, v in enumerate(names):
        r = data["variants"][v]
        mult = np.asarray(r["lengths"]) / r["train_length"]
        ax.plot(mult, _arr(r["ppl_ratio"]), "o-", ms=3, color=f"C{i}", label=v)
        if "position" in r:
            ax2.plot(_arr(r["position"]), _arr(r["position_loss"]), color=f"C{i}", label=v)
            ax2.axvline(r["train_length"], color="grey", ls=":", lw=0.8)
    for p in data["published"]:
        color = f"C{names.index(p['model'])}" if p["model"] in names else "k"
        ax.plot(p["length_multiple"], p["ratio"], "x", ms=8, mew=1.5, color=color)
    ax.plot([], [], "kx", label="published (paper, ×L_train)")
    ax.set(xscale="log", yscale="log", xlabel="L / L_train", ylabel="PPL(L) / PPL(L_train)",
           title="M7: length extrapolation")
    ax.legend(fontsize=6)
    ax2.set(xscale="log", xlabel="position t (dotted: training length)", ylabel="loss(t), bucket mean",
            title="per-position loss at the longest L")
    ax2.legend(fontsize=6)
    return fig


def plot_ablations(data):
    """M8: (a) dispersion sweep, (b) PaTH vs PaTH-FoX, (c) NTK-scaled RoPE."""
    plt = setup()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    sweep = data.get("dispersion_sweep", [])
    if sweep:
        axes[0].plot([s["tau"] for s in sweep], [s["ppl_ratio_max_L"] for s in sweep], "o-")
        for s in sweep:
            axes[0].annotate(s["variant"], (s["tau"], s["ppl_ratio_max_L"]), fontsize=6)
    axes[0].set(xlabel="angle dispersion τ (ξ ~ 1 + τ U[−1, 1], i.i.d.)",
                ylabel="r at the longest L", title="(a) more dispersion, more mixing")
    for key, ax, title in (("far_mass_control", axes[1], "(b) far-mass control: PaTH vs PaTH-FoX"),
                           ("ntk", axes[2], "(c) NTK-scaled RoPE")):
        for i, (v, r) in enumerate(data.get(key, {}).items()):
            ax.plot(r["lengths"], _arr(r["ppl_ratio"]), "o-", ms=3, color=f"C{i}", label=v)
        ax.set(xscale="log", yscale="log", xlabel="evaluation length L", ylabel="PPL(L) / PPL(L_train)", title=title)
        if data.get(key):
            length_axis(ax, [L for r in data[key].values() for L in r["lengths"]], log_y=True)
        ax.legend(fontsize=6)
    return fig
