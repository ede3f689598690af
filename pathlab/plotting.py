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
        ax.plot(x, _arr(e["bound_sphere"]), "C0--", lw=0.9, label="sphere e^{−d u²/2}")
        ax.plot(x, _arr(e["bound_levy"]), "C2:", lw=0.9, label="Lévy, c = 1/8")
        ax.plot(x, _arr(e["bound_hoeffding"]), "C1--", lw=0.9, label="Hoeffding")
        ax.set(yscale="log", ylim=(1e-5, 1.5), xlabel="t · √d / (‖q‖‖k‖)",
               title=f"d = {d}: Var/theory = {e['var_haar'] / e['var_theory']:.3f}")
    np.atleast_1d(axes)[0].set_ylabel("P(|qᵀPk| ≥ t)")
    np.atleast_1d(axes)[0].legend(loc="lower left")
    return fig


# ---------------------------------------------------------------------------------------------------------------- M4


def plot_toy_far_mass(data):
    """M4 toy model: simulated ρ_D vs the logistic M_L/(M_L + e^Γ), with SPEC's values."""
    plt = setup()
    fig, ax = plt.subplots(figsize=(5, 3.4))
    ax.plot(data["m_far"], _arr(data["formula"]), "k-", lw=1, label="M_L / (M_L + K e^{a−σ²/2})")
    ax.plot(data["m_far"], _arr(data["simulated"]), "o", ms=4, label=f"simulated ({data['trials']} trials)")
    ax.plot(data["spec_m_far"], data["spec_far_mass"], "x", ms=8, color="C3", label="SPEC [SIM]")
    ax.axvline(math.exp(data["gap"]), color="grey", ls=":", lw=0.8, label="midpoint e^Γ")
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
