"""Tables, claims and the figure of the state-tracking notebook, computed from the suite's JSON files.

The suite (:func:`pathlab.tasks.suite.run_suite`) writes ``flipflop.json``, ``mqrar.json`` and ``a5_sweep.json``
into one folder; committed results live in ``results/tasks/<preset>/`` (``h200``: the paper-sized models on one
H200; ``cpu``: the CPU-sized settings). :func:`state_tracking_data` turns such a folder into the plotted numbers
and :func:`state_tracking_claims` checks the issue's targets against them. A folder holds one preset's results
(files that disagree are refused), and the runs a suite planned but did not finish are reported (``missing``):
a claim that needs one is undecided, never decided on the runs that happen to be there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

from pathlab.tasks import records

FILES = records.FILES

# PaTH Table 1 (1 layer, 2 heads, width 64): read error in percent, (in distribution, sparse, dense)
PAPER_FLIPFLOP_PERCENT = {
    "rope": (6.9, 40.3, 0.01),
    "sba": (9.6, 38.9, 0.0),
    "fox": (8.3, 36.3, 0.0),
    "path": (0.0, 0.0001, 0.0),
}
SPLITS = ("in_dist", "sparse", "dense")
ORDER = ("rope", "fox", "path", "path_fox")
LABELS = {"rope": "RoPE", "fox": "FoX", "path": "PaTH", "path_fox": "PaTH-FoX", "nope": "NoPE", "alibi": "ALiBi",
          "sba": "SBA"}


# MQRAR-N's reference levels (mqrar_baselines): guessing, and the two predictors that ignore the asked key
BLIND_LABELS = {"chance": "chance", "frequent_value": "most frequent value", "key_blind": "best key-blind guess"}
BLIND_STYLES = {"chance": ":", "frequent_value": "-.", "key_blind": "--"}

COLORS = {"rope": "C0", "fox": "C1", "path": "C2", "path_fox": "C3", "nope": "C4", "alibi": "C5"}


def _color(name: str) -> str:
    return COLORS.get(name, "C7")


def _label(name: str) -> str:
    return LABELS.get(name, name)


def _sorted_attentions(names) -> list[str]:
    names = list(dict.fromkeys(names))
    return sorted(names, key=lambda a: (ORDER.index(a) if a in ORDER else len(ORDER), a))


def find_results(root: str | Path, prefer=("h200", "cpu")) -> Path | None:
    """The first folder ``root/<p>`` (p in ``prefer``) that holds all three suite files, or None. Its files are
    loaded (:func:`load_suite`): one that cannot be read, or files of different presets, are refused."""
    for name in prefer:
        folder = Path(root) / name
        if all((folder / f).is_file() for f in FILES.values()):
            load_suite(folder)
            return folder
    return None


def load_suite(folder: str | Path) -> dict[str, dict]:
    """{"flipflop": ..., "mqrar": ..., "a5": ...} from a suite folder (missing files are left out); an unreadable
    file is refused with its path, never skipped, and so are files of different presets."""
    out = {}
    for task, name in FILES.items():
        path = Path(folder) / name
        if path.is_file():
            try:
                with open(path, encoding="utf-8") as f:
                    out[task] = json.load(f)
            except (OSError, ValueError) as err:
                raise ValueError(f"{path} cannot be read ({type(err).__name__}: {err}); restore it from git or run "
                                 f"the task suite again") from err
    _check_presets(folder, out)
    return out


def _check_presets(folder: str | Path, suite: Mapping[str, Mapping]) -> None:
    """The files of a folder (and every run in them) come from one preset: a file copied in from another would
    be compared and plotted as if it were this suite's."""
    found = {FILES[task]: {doc.get("preset")} | {run.get("preset") for r in records.records(task, doc)
                                                 for run in records.runs_of(task, r)}
             for task, doc in suite.items()}
    if len(set().union(*found.values())) > 1:
        detail = "; ".join(f"{name}: {', '.join(sorted(map(repr, presets)))}" for name, presets in found.items())
        raise ValueError(f"{folder} mixes the results of several presets ({detail}); a folder holds one suite: move "
                         f"the odd file to a folder of its own, or run its task's suite again with the folder's "
                         f"preset")


def suite_status(suite: Mapping[str, Mapping]) -> tuple[dict[str, bool], dict[str, list[dict]]]:
    """({task: complete}, {task: planned jobs without a finished record}) of a loaded suite folder. A file without
    the suite's plan (written before it was recorded) is complete as written; an absent file is not complete."""
    complete = {task: task in suite and bool(suite[task].get("complete", True)) for task in FILES}
    missing = {task: records.missing_jobs(task, doc) for task, doc in suite.items()}
    for task, jobs in missing.items():
        complete[task] = complete[task] and not jobs
    return complete, {task: jobs for task, jobs in missing.items() if jobs}


def describe_job(task: str, job: Mapping) -> str:
    """A job in the words of the tables: "PaTH N=3", "RoPE k=8", "FoX"."""
    extra = f" N={job['n_back']}" if "n_back" in job else f" k={job['length']}" if "length" in job else ""
    return _label(job["attention"]) + extra


def obtain_results(profile: str, fast: bool, *, root: str | Path = ".", retrain: bool = False,
                   attentions=ORDER, log=print) -> tuple[Path, str]:
    """The suite folder the notebook plots, and where it came from.

    Committed results (``results/tasks/h200``, then ``results/tasks/cpu`` for the tiny-cpu figure profile) are used
    when present, unless ``retrain``. Otherwise the suite is trained now: the ``tiny-cpu`` task preset in fast
    mode (about a minute on a CPU, a pipeline check rather than a result), else the ``cpu`` task preset (for the
    tiny-cpu figure profile) or ``h200`` (for the GPU studies), into ``runs/tasks/<preset>/``.
    """
    from pathlab.tasks.suite import run_suite

    root = Path(root)
    if not retrain:
        prefer = ("h200", "cpu") if profile == "tiny-cpu" else ("h200",)
        folder = find_results(root / "results" / "tasks", prefer)
        if folder is not None:
            return folder, f"committed results in {folder.relative_to(root)}"
    preset = "tiny-cpu" if fast else ("cpu" if profile == "tiny-cpu" else "h200")
    folder = root / ("build" if fast else "runs") / "tasks" / preset
    run_suite(preset=preset, attentions=attentions, out_dir=folder, log=log,
              command=f"pathlab tasks suite --preset {preset} --out-dir {folder.relative_to(root)}")
    return folder, f"trained now with the {preset} task preset into {folder.relative_to(root)}"


# ------------------------------------------------------------------------------------------------- tables


def flipflop_table(doc: Mapping) -> list[dict]:
    """One row per attention: our read errors and the paper's, in percent, with the number of reads scored."""
    rows = []
    order = _sorted_attentions(r["attention"] for r in doc["runs"])
    for run in sorted(doc["runs"], key=lambda r: order.index(r["attention"])):
        err, n = run["summary"]["read_error"], run["summary"]["n_reads"]
        paper = PAPER_FLIPFLOP_PERCENT.get(run["attention"])
        rows.append({
            "attention": run["attention"],
            **{f"{s}_percent": 100.0 * err[s] for s in SPLITS},
            **{f"{s}_reads": n[s] for s in SPLITS},
            **{f"paper_{s}_percent": (paper[i] if paper else None) for i, s in enumerate(SPLITS)},
            "steps": run["steps"], "train_seconds": run["train_seconds"],
        })
    return rows


def format_flipflop_table(rows: list[dict]) -> str:
    """Markdown table: ours vs the paper, read errors in percent."""
    head = "| model | in-dist (ours / paper) | sparse (ours / paper) | dense (ours / paper) | steps |\n" \
           "|---|---|---|---|---|\n"

    def cell(row, s):
        paper = row[f"paper_{s}_percent"]
        return f"{row[f'{s}_percent']:.3g}% / " + ("—" if paper is None else f"{paper:g}%")

    lines = [f"| {_label(r['attention'])} | {cell(r, 'in_dist')} | {cell(r, 'sparse')} | {cell(r, 'dense')} | "
             f"{r['steps']} |" for r in rows]
    return head + "\n".join(lines)


def a5_min_layers(doc: Mapping) -> dict[str, dict[int, int | None]]:
    """{attention: {length: minimum layers with sequence accuracy > solved_at, or None}}."""
    table: dict[str, dict[int, int | None]] = {}
    for chain in doc["chains"]:
        table.setdefault(chain["attention"], {})[int(chain["length"])] = chain["min_layers"]
    return {a: dict(sorted(table[a].items())) for a in _sorted_attentions(table)}


def a5_accuracy(doc: Mapping) -> dict[str, dict[int, dict[int, float]]]:
    """{attention: {length: {layers: sequence accuracy}}} for every depth tried."""
    out: dict[str, dict[int, dict[int, float]]] = {}
    for chain in doc["chains"]:
        for run in chain["runs"]:
            out.setdefault(chain["attention"], {}).setdefault(int(chain["length"]), {})[
                int(run["settings"]["n_layer"])] = run["summary"]["sequence_accuracy"]
    return {a: out[a] for a in _sorted_attentions(out)}


def mqrar_accuracy(doc: Mapping) -> dict[str, dict[int, float]]:
    """{attention: {N: answer accuracy}}."""
    table: dict[str, dict[int, float]] = {}
    for run in doc["runs"]:
        table.setdefault(run["attention"], {})[int(run["settings"]["n_back"])] = run["summary"]["accuracy"]
    return {a: dict(sorted(table[a].items())) for a in _sorted_attentions(table)}


def mqrar_baselines(doc: Mapping, n_sequences: int = 256, seed: int = 12345) -> dict[int, dict[str, float]]:
    """{N: {"chance", "frequent_value", "key_blind"}}: the answer accuracy of guessing (2/V over the V/2 values)
    and of the two predictors of :func:`pathlab.tasks.mqrar.blind_baselines` that never bind a value to the asked
    key, on fresh sequences with the settings of the runs at that N. A model above ``key_blind`` recalls."""
    from pathlab.tasks.mqrar import P_QUERY, blind_baselines, generate_mqrar

    out: dict[int, dict[str, float]] = {}
    for run in doc["runs"]:
        s = run["settings"]
        n = int(s["n_back"])
        if n not in out:
            x, y = generate_mqrar(n_sequences, n, n_pairs=s["n_pairs"], length=s["length"],
                                  vocab_size=s["vocab_size"], p_query=s.get("p_query", P_QUERY), seed=seed)
            out[n] = {"chance": 2 / s["vocab_size"], **blind_baselines(x, y, n)}
    return dict(sorted(out.items()))


def state_tracking_data(folder: str | Path) -> dict:
    """The numbers the notebook plots, from one suite folder."""
    suite = load_suite(folder)
    data: dict = {"source": str(folder)}
    data["complete"], data["missing"] = suite_status(suite)
    if "flipflop" in suite:
        data["flipflop"] = flipflop_table(suite["flipflop"])
        data["flipflop_command"] = suite["flipflop"].get("command")
    if "a5" in suite:
        data["a5_min_layers"] = a5_min_layers(suite["a5"])
        data["a5_accuracy"] = a5_accuracy(suite["a5"])
        data["a5_layers_tried"] = suite["a5"].get("layers")
        data["a5_solved_at"] = suite["a5"].get("solved_at")
        data["a5_command"] = suite["a5"].get("command")
    if "mqrar" in suite:
        data["mqrar_accuracy"] = mqrar_accuracy(suite["mqrar"])
        data["mqrar_baselines"] = mqrar_baselines(suite["mqrar"])
        data["mqrar_command"] = suite["mqrar"].get("command")
    return data


def a5_depth_bounds(min_layers: int | None, tried) -> tuple[int, int]:
    """Bounds (lo, hi) on the minimum depth that solves a length, from a chain over the depths ``tried``.

    A chain that solved at its shallowest depth d0 > 1 says only that the minimum is at most d0 (depths below d0
    were not tried): (1, d0). A chain that solved at a deeper depth d: (d, d). One that solved at no depth tried:
    (max + 1, max + 1), "more than the deepest tried", compared as one value.
    """
    lowest, never = min(tried), max(tried) + 1
    if min_layers is None:
        return never, never
    return (1 if min_layers == lowest else min_layers), min_layers


def a5_depth_label(min_layers: int | None, tried) -> str:
    """The table entry for one chain: "2", "≤2" (solved at the shallowest depth tried, above 1) or "—"."""
    if min_layers is None:
        return "—"
    lo, hi = a5_depth_bounds(min_layers, tried)
    return str(hi) if lo == hi else f"≤{hi}"


# ------------------------------------------------------------------------------------------------- claims


CLAIMS = ("flipflop_path_in_dist_error_at_most_0.1pct", "flipflop_path_sparse_error_at_most_0.1pct",
          "flipflop_rope_sparse_error_clearly_above_path",
          "mqrar_path_recalls_beyond_the_key_blind_guess_for_n_2_and_3", "mqrar_path_above_rope_and_fox_for_n_2_and_3",
          "a5_path_needs_no_more_layers_than_rope", "a5_path_needs_fewer_layers_than_rope_at_some_length")


def state_tracking_claims(data: Mapping) -> dict[str, bool | None]:
    """The issue's targets (``CLAIMS``, every one of them), each True/False on these numbers; None when undecided
    or when a run it needs is missing: not run, or planned and not finished (``data["missing"]``)."""
    claims: dict[str, bool | None] = dict.fromkeys(CLAIMS)
    missing = {task: {job["attention"] for job in jobs} for task, jobs in data.get("missing", {}).items()}
    ff = {r["attention"]: r for r in data.get("flipflop", [])}
    if "path" in ff:
        claims["flipflop_path_in_dist_error_at_most_0.1pct"] = ff["path"]["in_dist_percent"] <= 0.1
        claims["flipflop_path_sparse_error_at_most_0.1pct"] = ff["path"]["sparse_percent"] <= 0.1
        if "rope" in ff:  # "clearly higher": at least one percentage point and ten times PaTH's
            r, p = ff["rope"]["sparse_percent"], ff["path"]["sparse_percent"]
            claims["flipflop_rope_sparse_error_clearly_above_path"] = r >= p + 1.0 and r >= 10 * p
    mq = {a: {int(n): v for n, v in t.items()} for a, t in data.get("mqrar_accuracy", {}).items()}
    blind = {int(n): b["key_blind"] for n, b in data.get("mqrar_baselines", {}).items()}
    if all(n in mq.get("path", {}) and n in blind for n in (2, 3)):
        learned = all(mq["path"][n] > blind[n] for n in (2, 3))
        claims["mqrar_path_recalls_beyond_the_key_blind_guess_for_n_2_and_3"] = learned
        # the paper's comparison means something only once PaTH recalls at all: between models that all sit at
        # the blind guess, which is ahead is noise, and the claim stays undecided
        if learned and all(n in mq.get(a, {}) for a in ("rope", "fox") for n in (2, 3)):
            claims["mqrar_path_above_rope_and_fox_for_n_2_and_3"] = all(
                mq["path"][n] > mq[a][n] for n in (2, 3) for a in ("rope", "fox"))
    a5 = {a: {int(k): v for k, v in t.items()} for a, t in data.get("a5_min_layers", {}).items()}
    common = sorted(set(a5.get("path", {})) & set(a5.get("rope", {})))
    # a chain that did not finish can read a depth too deep: no claim on an unfinished suite's PaTH or RoPE
    if common and not missing.get("a5", set()) & {"path", "rope"}:
        tried = data.get("a5_layers_tried") or [1]
        path = [a5_depth_bounds(a5["path"][k], tried) for k in common]
        rope = [a5_depth_bounds(a5["rope"][k], tried) for k in common]
        pairs = list(zip(path, rope))
        # (lo, hi) bounds on each minimum depth: a claim is decided only where the bounds decide it
        claims["a5_path_needs_no_more_layers_than_rope"] = (
            True if all(p[1] <= r[0] for p, r in pairs) else
            False if any(p[0] > r[1] for p, r in pairs) else None)
        claims["a5_path_needs_fewer_layers_than_rope_at_some_length"] = (
            True if any(p[1] < r[0] for p, r in pairs) else
            False if all(p[0] >= r[1] for p, r in pairs) else None)
    return claims


# ------------------------------------------------------------------------------------------------- figure


def plot_state_tracking(data: Mapping):
    """Four panels: flip-flop read errors (ours as bars, the paper's as black ticks), A5 minimum layers per
    length, the best A5 sequence accuracy reached per length, MQRAR-N accuracy per N. Returns the Figure."""
    from pathlab.figures.plotting import setup

    plt = setup()
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    floor = 1e-4  # percent; zero errors are drawn at the floor

    ax = axes[0]
    rows = data.get("flipflop", [])
    width = 0.8 / max(len(SPLITS), 1)
    for j, split in enumerate(SPLITS):
        xs = [i + (j - 1) * width for i in range(len(rows))]
        ours = [max(r[f"{split}_percent"], floor) for r in rows]
        ax.bar(xs, ours, width=width * 0.95, label=split.replace("_", "-"), color=f"C{j}")
        for x, r in zip(xs, rows):
            paper = r[f"paper_{split}_percent"]
            if paper is not None:
                ax.plot([x - width / 2, x + width / 2], [max(paper, floor)] * 2, color="k", lw=1.5)
    ax.set_yscale("log")
    ax.set_ylim(floor / 2, 100)
    ax.set_xticks(range(len(rows)), [_label(r["attention"]) for r in rows])
    ax.set_ylabel("read error (%)")
    ax.set_title("flip-flop (bars: ours; black ticks: PaTH paper)")
    ax.legend(loc="upper right")

    ax = axes[1]
    table = data.get("a5_min_layers", {})
    tried = data.get("a5_layers_tried") or [1]
    never = max(tried) + 1
    for i, (att, by_len) in enumerate(table.items()):
        ks = sorted(int(k) for k in by_len)
        ys = [by_len[k] if by_len.get(k) is not None else never for k in ks]
        ax.plot(ks, [y + 0.04 * (i - 1.5) for y in ys], marker="o", label=_label(att), color=_color(att))
    ax.axhline(never - 0.5, color="grey", lw=0.8, ls=":")
    lowest = min(tried)  # a chain solved at its shallowest depth above 1 is drawn there, labelled "≤"
    ax.set_yticks(list(range(lowest, never + 1)),
                  [f"≤{n}" if n == lowest > 1 else str(n) for n in range(lowest, never)] + [f">{never - 1}"])
    ax.set_xticks(sorted({int(k) for t in table.values() for k in t}))
    ax.set_xlabel("sequence length k")
    ax.set_ylabel(f"min layers (seq. acc. > {data.get('a5_solved_at', 0.9):.0%})")
    ax.set_title("A5 word problem")
    _legend(ax)

    ax = axes[2]
    for att, by_len in data.get("a5_accuracy", {}).items():
        ks = sorted(int(k) for k in by_len)
        # the deepest depth tried at each length (the chain stops at the first depth that solves it)
        best = [max(by_len[k].values()) for k in ks]
        ax.plot(ks, [100 * b for b in best], marker="o", label=_label(att), color=_color(att))
    ax.axhline(100 * (data.get("a5_solved_at") or 0.9), color="grey", lw=0.8, ls=":")
    ax.set_xticks(sorted({int(k) for t in data.get("a5_accuracy", {}).values() for k in t}))
    ax.set_xlabel("sequence length k")
    ax.set_ylabel("best sequence accuracy over depths (%)")
    ax.set_ylim(0, 101)
    ax.set_title("A5: accuracy reached")
    _legend(ax)

    ax = axes[3]
    for att, by_n in data.get("mqrar_accuracy", {}).items():
        ns = sorted(int(n) for n in by_n)
        ax.plot(ns, [100 * by_n[n] for n in ns], marker="o", label=_label(att), color=_color(att))
    baselines = {int(n): b for n, b in data.get("mqrar_baselines", {}).items()}
    ns = sorted(baselines)
    for name, style in BLIND_STYLES.items():
        if ns:
            ax.plot(ns, [100 * baselines[n][name] for n in ns], color="grey", lw=1, ls=style,
                    label=BLIND_LABELS[name])
    ax.set_xlabel("N (N-th most recent assignment)")
    ax.set_ylabel("answer accuracy (%, log)")
    ax.set_yscale("log")
    ax.set_ylim(0.3, 101)
    ax.set_xticks([1, 2, 3, 4])
    ax.set_title("MQRAR-N")
    _legend(ax)
    return fig


def _legend(ax) -> None:
    """The panel's legend, or a note in the panel when the folder holds none of its results."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no results in this folder", transform=ax.transAxes, ha="center", va="center",
                color="grey")


def summary_markdown(folder: str | Path) -> str:
    """A Markdown digest of one suite folder: the flip-flop table, A5 minimum layers, MQRAR-N accuracy, claims."""
    data = state_tracking_data(folder)
    parts = []
    if "flipflop" in data:
        parts += ["**Flip-flop read error (ours / PaTH Table 1)**", "", format_flipflop_table(data["flipflop"]), ""]
    if "a5_min_layers" in data:
        lengths = sorted({k for t in data["a5_min_layers"].values() for k in t})
        tried = data.get("a5_layers_tried") or [1]
        below = f"; ≤{min(tried)} = solved at {min(tried)}, shallower depths not tried" if min(tried) > 1 else ""
        parts += ["**A5: minimum layers with sequence accuracy > 90%** (— = none of "
                  f"{tried}{below}; n/a = not run)", "",
                  "| model | " + " | ".join(f"k={k}" for k in lengths) + " |",
                  "|---|" + "---|" * len(lengths)]
        for att, t in data["a5_min_layers"].items():
            parts.append(f"| {_label(att)} | " + " | ".join(
                "n/a" if k not in t else a5_depth_label(t[k], tried) for k in lengths) + " |")
        parts.append("")
    if "mqrar_accuracy" in data:
        ns = sorted({n for t in data["mqrar_accuracy"].values() for n in t})
        parts += ["**MQRAR-N answer accuracy**", "", "| model | " + " | ".join(f"N={n}" for n in ns) + " |",
                  "|---|" + "---|" * len(ns)]
        for att, t in data["mqrar_accuracy"].items():
            parts.append(f"| {_label(att)} | " + " | ".join(
                f"{100 * t[n]:.1f}%" if n in t else "—" for n in ns) + " |")
        baselines = {int(n): b for n, b in data.get("mqrar_baselines", {}).items()}
        for name, label in BLIND_LABELS.items():
            parts.append(f"| *{label}* | " + " | ".join(
                f"{100 * baselines[n][name]:.1f}%" if n in baselines else "—" for n in ns) + " |")
        parts.append("")
    parts += _unfinished_markdown(data)
    claims = state_tracking_claims(data)
    verdict = {True: "held", False: "NOT held", None: "undecided"}
    parts += ["**Claims**", ""] + [f"- `{k}`: {verdict[v]}" for k, v in claims.items()]
    return "\n".join(parts) + "\n"


def _unfinished_markdown(data: Mapping) -> list[str]:
    """The digest's lines on what the folder lacks: absent files, planned runs without a result, a suite that did
    not finish every job (none when the folder is complete)."""
    lines = []
    for task, name in FILES.items():
        if data.get("complete", {}).get(task, True):
            continue
        jobs = data.get("missing", {}).get(task, [])
        if {"flipflop": "flipflop", "mqrar": "mqrar_accuracy", "a5": "a5_min_layers"}[task] not in data:
            lines.append(f"- `{name}`: not in the folder")
        elif jobs:
            lines.append(f"- `{name}`: " + ", ".join(describe_job(task, job) for job in jobs))
        else:
            lines.append(f"- `{name}`: every planned result is in, but the suite did not finish all its jobs")
    if not lines:
        return []
    return ["**Missing results** (the claims that need them are undecided)", ""] + lines + [""]
