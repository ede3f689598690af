"""Kernel-performance figure: the benchmark result files (``benchmarks/results/*.json``) against the H200 anchors.

The result files are written by ``benchmarks/bench_kernels.py`` on a GPU machine (bf16, causal, B·T = 32,768
tokens, ``triton.testing.do_bench`` medians). When none is present the figure says so and names the command.
Reference anchors (measured on one H200, public fla-core 0.6.0 kernels, torch 2.11, triton 3.6): ms for fwd and
fwd+bwd, peak MiB.
"""

from __future__ import annotations

import json
from pathlib import Path


BENCH_COMMAND = "python benchmarks/bench_kernels.py --out benchmarks/results/kernels-h200.json"

# (method, T, H, D) -> (fwd_ms, fwd_bwd_ms, peak_mib)
ANCHORS = {
    ("sdpa", 4096, 12, 64): (0.50, 2.00, 291), ("fla_path", 4096, 12, 64): (4.16, 11.99, 1606),
    ("fla_path_fox", 4096, 12, 64): (4.73, 14.38, 1609), ("fla_fox", 4096, 12, 64): (0.98, 6.39, 248),
    ("flex_alibi", 4096, 12, 64): (0.75, 2.88, 195),
    ("sdpa", 16384, 12, 64): (1.87, 6.73, 291), ("fla_path", 16384, 12, 64): (14.24, 38.99, 2758),
    ("fla_path_fox", 16384, 12, 64): (15.90, 48.09, 2761), ("fla_fox", 16384, 12, 64): (3.46, 21.73, 248),
    ("flex_alibi", 16384, 12, 64): (2.77, 10.16, 195),
    ("sdpa", 16384, 16, 128): (3.77, 14.57, 772), ("fla_path", 16384, 16, 128): (11.72, 48.53, 7269),
    ("fla_fox", 16384, 16, 128): (6.06, 37.78, 650), ("flex_alibi", 16384, 16, 128): (5.66, 20.40, 516),
}
# bf16, β ∈ [1.5, 2]: the public implementation passes at these relative RMS errors
TOLERANCES = {"o": 5e-3, "dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dw": 1.5e-2, "dbeta": 2e-2, "dg": 2e-2}


def load_benchmarks(folder) -> tuple[list[dict], list[str]]:
    """Every readable kernel result file in ``folder`` (with its file name), and notes on the ones skipped.

    Other benchmarks' JSON files share the folder (throughput, memory); a file without ``cases`` is noted only
    when its name says it is a kernel result (``kernels-*.json``). An unreadable JSON file is always noted.
    """
    folder = Path(folder)
    found, notes = [], []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            with open(path, encoding="utf-8") as f:
                result = json.load(f)
        except (OSError, ValueError) as err:
            notes.append(f"{path.name}: unreadable ({err}); rerun the benchmark")
            continue
        if not isinstance(result, dict) or not isinstance(result.get("cases"), list):
            if path.name.startswith("kernels-"):
                notes.append(f"{path.name}: not a bench_kernels.py result (no 'cases'); regenerate with "
                             f"{BENCH_COMMAND}")
            continue
        result["file"] = path.name
        found.append(result)
    if not found:
        notes.append(f"no benchmark results in {folder}; produce them on a GPU with {BENCH_COMMAND}")
    return found, notes


def kernel_summary(results: list[dict], notes: list[str]) -> tuple[dict, dict]:
    """Rows (method, T, H, D, times, ratio to SDPA, anchors), correctness errors and the claims.

    When several result files measure the same case, the most recent run (its ``started`` time) wins. Methods
    run with kernel settings (``bench_kernels.py``'s ``path@FIELD=value``, a ``KernelConfig`` field; older files
    name the environment switches of their day) are side-by-side experiments, not the kernel as shipped: they are
    left out of the rows and the claims.
    """
    rows, correctness = [], {}
    results = sorted(results, key=lambda r: (str(r.get("started", "")), r["file"]), reverse=True)
    seen, seen_checks = set(), set()
    for res in results:
        cases = [c for c in res["cases"] if "fwd_bwd_ms" in c and c.get("fwd_bwd_ms") is not None]
        sdpa = {(c["T"], c["H"], c["D"]): c["fwd_bwd_ms"] for c in cases if c["method"] == "sdpa"}
        for c in cases:
            key = (c["method"], c["T"], c["H"], c["D"])
            if key in seen or "@" in c["method"]:
                continue
            seen.add(key)
            anchor = ANCHORS.get(key) or (ANCHORS.get(("fla_" + c["method"], c["T"], c["H"], c["D"]))
                                          if c["method"] in ("path", "path_fox") else None)
            base = sdpa.get((c["T"], c["H"], c["D"]))
            rows.append({"file": res["file"], "device": res.get("device"), "method": c["method"], "T": c["T"],
                         "H": c["H"], "D": c["D"], "fwd_ms": c["fwd_ms"], "fwd_bwd_ms": c["fwd_bwd_ms"],
                         "peak_mib": c.get("peak_mib"), "ratio_to_sdpa": c["fwd_bwd_ms"] / base if base else None,
                         "anchor_public_fwd_bwd_ms": anchor[1] if anchor else None})
        for name, errs in res.get("correctness", {}).items():
            if name not in seen_checks and "@" not in name:
                seen_checks.add(name)
                correctness[f"{res['file']}:{name}"] = errs
    rows.sort(key=lambda r: (r["H"], r["D"], r["T"], r["method"]))
    data = {"files": [r["file"] for r in results], "rows": rows, "correctness": correctness, "notes": notes, "tolerances": TOLERANCES,
            "anchors": [{"method": k[0], "T": k[1], "H": k[2], "D": k[3], "fwd_ms": v[0], "fwd_bwd_ms": v[1],
                         "peak_mib": v[2]} for k, v in ANCHORS.items()]}
    claims = {"benchmark_results_present": bool(rows)}
    ours = [r for r in rows if r["method"] in ("path", "path_fox") and r["anchor_public_fwd_bwd_ms"]]
    if ours:
        claims["path_faster_than_public_kernel"] = all(r["fwd_bwd_ms"] < r["anchor_public_fwd_bwd_ms"] for r in ours)
    checked = {k: v for k, v in correctness.items() if isinstance(v, dict) and "error" not in v
               and k.split(":")[1].startswith("path")}
    if checked:
        claims["path_gradients_within_public_tolerances"] = all(
            v.get(name, 0.0) <= tol for v in checked.values() for name, tol in TOLERANCES.items())
    return data, claims


def plot_kernels(data):
    """fwd+bwd time against T per method and head shape (circles: measured, crosses: public-kernel anchors)."""
    from pathlab.figures.plotting import setup

    plt = setup()
    shapes = sorted({(r["H"], r["D"]) for r in data["rows"]}) or sorted({(a["H"], a["D"]) for a in data["anchors"]})
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4.2), squeeze=False)
    methods = sorted({r["method"] for r in data["rows"]} | {a["method"] for a in data["anchors"]})
    colours = plt.get_cmap("tab20")  # more methods than the default ten-colour cycle
    for ax, (H, D) in zip(axes[0], shapes):
        for i, m in enumerate(methods):
            colour = colours(i % 20)
            mine = sorted((r["T"], r["fwd_bwd_ms"]) for r in data["rows"] if r["method"] == m and (r["H"], r["D"]) == (H, D))
            if mine:
                ax.plot(*zip(*mine), "o-", ms=4, color=colour, label=f"{m} (measured)")
            anchors = sorted((a["T"], a["fwd_bwd_ms"]) for a in data["anchors"]
                             if a["method"] == m and (a["H"], a["D"]) == (H, D))
            if anchors:
                ax.plot(*zip(*anchors), "x", ms=7, color=colour, label=f"{m} (reference anchor)")
        ax.set(xscale="log", yscale="log", xlabel="sequence length T (batch B = max(1, 32,768 / T))", ylabel="fwd+bwd ms (bf16)",
               title=f"H×D = {H}×{D}")
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="outside right upper", fontsize=6)
    title = "Kernel performance on one H200"
    if not data["rows"]:
        title += " — only the public-kernel anchors are shown:\n" + "\n".join(data["notes"])
    fig.suptitle(title, fontsize=8)
    return fig


def kernel_table_markdown(data) -> str:
    """The measured rows as a markdown table (for the notebook)."""
    if not data["rows"]:
        return "\n".join(f"* {n}" for n in data["notes"])
    lines = ["| method | T | H×D | fwd ms | fwd+bwd ms | ÷ SDPA | public kernel fwd+bwd ms | peak MiB |",
             "|---|---|---|---|---|---|---|---|"]
    fmt = lambda x, f="{:.2f}": "—" if x is None else f.format(x)  # noqa: E731
    for r in data["rows"]:
        lines.append(f"| {r['method']} | {r['T']} | {r['H']}×{r['D']} | {fmt(r['fwd_ms'])} | {fmt(r['fwd_bwd_ms'])} "
                     f"| {fmt(r['ratio_to_sdpa'])} | {fmt(r['anchor_public_fwd_bwd_ms'])} | {fmt(r['peak_mib'], '{:.0f}')} |")
    return "\n".join(lines)
