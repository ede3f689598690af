"""Studies: a grid of language models, each trained, evaluated to long lengths and probed, with compact results.

    pathlab study list                               # the study configs under configs/studies/
    pathlab study status owt16-debian                # which cells have results
    pathlab study run owt16-debian --cells rope,path --budget-s 540
    pathlab study run tiny-cpu                       # the small CPU study behind `make figures`

A study config (``configs/studies/<name>.yaml``) names a training config and the overrides every cell shares,
the evaluation protocol (:mod:`pathlab.training.evaluate`), the probe settings (:mod:`pathlab.probes.records`),
the cells (an attention variant, its options and per-cell overrides) and the cells each figure compares. A cell runs in
four stages, each resumable:

1. train into ``runs/<study>/<cell>/`` (a checkpoint every ``train.ckpt_interval`` iterations);
2. evaluate r(L) at every evaluation length (``eval.json``, ``eval.csv``, ``eval_positions.csv``);
3. probe the model at the probe lengths (M2–M6) and reduce the measurements to a compact record
   (``probes.npz``);
4. write ``train.csv`` (the training curve) and ``cell.json`` (resolved config, revision, seeds, tokens, times).

Results go to the study's results folder, ``results/<study>/<cell>/``; ``cell.json`` is written last, so a cell
has results exactly when it has a ``cell.json`` whose config matches the study's. A run that is cut off loses
at most the stage in progress; with ``--budget-s`` training stops at a checkpoint in time for the cell's
evaluation and probes, and the same command continues it. Checkpoints stay in ``runs/`` (hundreds of MB): only
the compact results are meant to be kept.

Several GPUs: run one process per GPU, each on its own cells
(``CUDA_VISIBLE_DEVICES=1 pathlab study run owt16-debian --cells alibi,fox``); cells share nothing but the
corpus, and each run directory is locked by its trainer.
"""

from __future__ import annotations

import argparse
import copy
import csv
import hashlib
import io
import json
import math
import sys
import time
import zipfile
from pathlib import Path

import yaml

from pathlab import intervals
from pathlab.atomic import atomic_write_bytes
from pathlab.figures import study_tables
from pathlab.training.config import repo_root, resolve_config

CELL_KEYS = {"attention", "attention_kwargs", "overrides", "tokens", "group", "note"}
STUDY_KEYS = {"name", "description", "train_config", "results_dir", "overrides", "eval", "probes", "cells",
              "figures", "fast", "reserve_s"}
EVAL_KEYS = {"lengths", "n_windows", "seed"}
PROBE_KEYS = {"lengths", "n_windows", "n_queries", "span", "near", "m2_length", "m2_windows", "angle_lag", "eps",
              "seed"}
STAGES = ("train", "eval", "probes")


class StudyPaused(RuntimeError):
    """The time budget ran out: training stopped at a checkpoint, and the same command continues the cell."""


# ----------------------------------------------------------------------------------------------------------------
# configs


def studies_dir() -> Path:
    return (repo_root() or Path.cwd()) / "configs" / "studies"


def available_studies() -> list[str]:
    return sorted(p.stem for p in studies_dir().glob("*.yaml"))


def _check_keys(section: dict, allowed: set, where: str) -> None:
    unknown = sorted(set(section) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; allowed: {sorted(allowed)}")


def load_study(study, *, fast: bool = False) -> dict:
    """A study config by name (``configs/studies/<name>.yaml``), path or dict, checked, with defaults filled.

    ``fast`` applies the study's ``fast`` section (a CI-sized version: its ``overrides``, ``eval`` and ``probes``
    replace the main ones key by key) and names the study ``<name>-fast``, with its own results folder.
    """
    if isinstance(study, dict):
        cfg = copy.deepcopy(study)
        where = f"study {cfg.get('name', '?')!r}"
    else:
        path = Path(study)
        if not path.suffix:
            path = studies_dir() / f"{study}.yaml"
            if not path.is_file():
                raise ValueError(f"study: no study named {study!r}; available: {', '.join(available_studies())}")
        if not path.is_file():
            raise ValueError(f"study: file {path} does not exist")
        try:
            cfg = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ValueError(f"study: {path} is not valid YAML: {err}") from None
        where = str(path)
        cfg.setdefault("name", path.stem)
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: a study config is a mapping")
    _check_keys(cfg, STUDY_KEYS, where)
    for key in ("train_config", "cells"):
        if key not in cfg:
            raise ValueError(f"{where}: missing key {key!r}")
    cfg.setdefault("overrides", {})
    cfg.setdefault("eval", {})
    cfg.setdefault("probes", {})
    cfg.setdefault("figures", {})
    cfg.setdefault("reserve_s", 120)
    _check_keys(cfg["eval"], EVAL_KEYS, f"{where}: eval")
    _check_keys(cfg["probes"], PROBE_KEYS, f"{where}: probes")
    if fast:
        extra = cfg.get("fast")
        if not extra:
            raise ValueError(f"{where}: this study has no 'fast' section, so it has no CI-sized version")
        cfg["overrides"] = {**cfg["overrides"], **extra.get("overrides", {})}
        cfg["eval"] = {**cfg["eval"], **extra.get("eval", {})}
        cfg["probes"] = {**cfg["probes"], **extra.get("probes", {})}
        if "cells" in extra:
            missing = [c for c in extra["cells"] if c not in cfg["cells"]]
            if missing:
                raise ValueError(f"{where}: fast.cells names unknown cells {missing}")
            cfg["cells"] = {c: cfg["cells"][c] for c in extra["cells"]}
        cfg["name"] = f"{cfg['name']}-fast"
        cfg["results_dir"] = str(Path(cfg.get("results_dir", f"build/results/{cfg['name']}")).parent / cfg["name"])
    cfg.pop("fast", None)
    cfg.setdefault("results_dir", f"results/{cfg['name']}")
    if not isinstance(cfg["cells"], dict) or not cfg["cells"]:
        raise ValueError(f"{where}: cells must be a non-empty mapping of cell name -> settings")
    for name, cell in cfg["cells"].items():
        if not isinstance(cell, dict) or "attention" not in cell:
            raise ValueError(f"{where}: cell {name!r} needs at least an 'attention' entry")
        _check_keys(cell, CELL_KEYS, f"{where}: cell {name!r}")
    for figure, cells in cfg["figures"].items():
        unknown = [c for c in cells if c not in cfg["cells"]]
        if unknown and not fast:
            raise ValueError(f"{where}: figure {figure!r} names unknown cells {unknown}")
    return cfg


def results_dir(study: dict) -> Path:
    path = Path(study["results_dir"])
    return path if path.is_absolute() else (repo_root() or Path.cwd()) / path


def cell_results_dir(study: dict, cell: str) -> Path:
    return results_dir(study) / cell


def run_dir(study: dict, cell: str) -> Path:
    from pathlab.training.trainer import runs_root

    return runs_root() / study["name"] / cell


def cell_config(study: dict, cell: str) -> dict:
    """The resolved training config of a cell: the study's training config <- study overrides <- cell's."""
    if cell not in study["cells"]:
        raise ValueError(f"cell: unknown cell {cell!r} of study {study['name']!r}; cells: {', '.join(study['cells'])}")
    spec = study["cells"][cell]
    overrides = {**study["overrides"], **spec.get("overrides", {}), "model.attention": spec["attention"],
                 "name": f"{study['name']}-{cell}"}
    if spec.get("attention_kwargs"):
        overrides["model.attention_kwargs"] = dict(spec["attention_kwargs"])
    cfg = resolve_config(study["train_config"], overrides)
    if "tokens" in spec:
        per_iter = cfg["train"]["batch_size"] * cfg["train"]["grad_accum"] * cfg["data"]["block_size"]
        cfg["train"]["max_iters"] = math.ceil(float(spec["tokens"]) / per_iter)
    for key in ("lengths", "n_windows", "seed"):
        if key in study["eval"]:
            cfg["eval"][key] = study["eval"][key]
    return cfg


def cell_fingerprint(study: dict, cell: str) -> str:
    """What a cell's results depend on: its training config, the evaluation protocol and the probe settings."""
    payload = {"train": cell_config(study, cell), "eval": study["eval"], "probes": study["probes"]}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cell_status(study: dict, cell: str) -> str:
    """"done" (results match the config), "stale" (results from another config), "trained" (a finished run
    without results), "partial" (a checkpoint) or "missing"."""
    marker = cell_results_dir(study, cell) / "cell.json"
    if marker.is_file():
        try:
            recorded = json.loads(marker.read_text()).get("fingerprint")
        except ValueError:
            recorded = None
        return "done" if recorded == cell_fingerprint(study, cell) else "stale"
    run = run_dir(study, cell)
    if (run / "summary.json").is_file() and (run / "ckpt.pt").is_file():
        return "trained"
    return "partial" if (run / "ckpt.pt").is_file() else "missing"


# ----------------------------------------------------------------------------------------------------------------
# running


def _train_curve(run: Path) -> str:
    """``train.csv``: step, loss, lr, grad_norm, tokens_per_s every iteration, val_loss where evaluated."""
    rows = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        rows.setdefault(record["step"], {}).update(record)
    out = io.StringIO()
    w = csv.writer(out)
    fields = ["step", "loss", "lr", "grad_norm", "tokens_per_s", "val_loss"]
    w.writerow(fields)
    for step in sorted(rows):
        r = rows[step]
        w.writerow([step] + [("" if r.get(k) is None else f"{r[k]:.6g}") for k in fields[1:]])
    return out.getvalue()


def run_cell(study: dict, cell: str, *, deadline: float | None = None, device: str | None = None,
             progress: bool = True) -> str:
    """Train, evaluate and probe one cell (each stage skipped when already done); returns the cell's status.

    ``deadline``: a ``time.monotonic()`` instant; training stops at a checkpoint once less than the study's
    ``reserve_s`` is left before it (raises :class:`StudyPaused`).
    """
    import torch

    from pathlab.training import trainer as training
    from pathlab.training.evaluate import evaluate
    from pathlab.probes import records
    from pathlab.results import git_revision, library_versions, to_jsonable

    status = cell_status(study, cell)
    if status == "done":
        return status
    if status == "stale":
        raise ValueError(f"cell {cell!r}: {cell_results_dir(study, cell)} holds results of another config; delete "
                         "that folder to run the cell again, or give the changed cell a new name")
    cfg = cell_config(study, cell)
    run = run_dir(study, cell)
    out = cell_results_dir(study, cell)
    times, started = {}, time.time()
    if progress:
        print(f"[{study['name']}/{cell}] {status}: {cfg['model']['attention']} "
              f"{cfg['model'].get('attention_kwargs') or ''}, {cfg['train']['max_iters']} iterations", flush=True)
    t0 = time.monotonic()
    if status != "trained":
        train_deadline = None if deadline is None else deadline - float(study["reserve_s"])
        try:
            training.train(cfg, run_dir=run, resume=(run / "ckpt.pt").is_file(), progress=progress,
                           deadline=train_deadline)
        except training.TrainingPaused:
            raise StudyPaused(f"cell {cell!r}: the time budget ran out during training; its checkpoint in {run} "
                              "is kept and the same command continues it") from None
    times["train_s"] = time.monotonic() - t0
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    t0 = time.monotonic()
    ev = study["eval"]
    evaluate(run, ev.get("lengths", cfg["eval"]["lengths"]), n_windows=ev.get("n_windows"), seed=ev.get("seed"),
             device=device, out=out, progress=progress)
    times["eval_s"] = time.monotonic() - t0

    t0 = time.monotonic()
    model, run_cfg = training.load_run(run, device=device or ("cuda" if torch.cuda.is_available() else "cpu"))
    record, raw = records.measure_cell(model, run_cfg, study["probes"], progress=progress)
    records.save_record(out / "probes.npz", record)
    raw_dir = (repo_root() or Path.cwd()) / "build" / "study-raw" / study["name"] / cell
    records.save_raw(raw_dir, raw)
    del model
    times["probes_s"] = time.monotonic() - t0

    summary = json.loads((run / "summary.json").read_text())
    env = json.loads((run / "env.json").read_text())
    atomic_write_bytes(out / "train.csv", _train_curve(run).encode())
    marker = {
        "study": study["name"], "cell": cell, "fingerprint": cell_fingerprint(study, cell),
        "group": study["cells"][cell].get("group"), "note": study["cells"][cell].get("note"),
        "attention": cfg["model"]["attention"], "attention_kwargs": cfg["model"].get("attention_kwargs", {}),
        "tokens": summary["tokens"], "iterations": summary["iterations"], "train_loss": summary["train_loss"],
        "val_loss": summary["val_loss"], "tokens_per_s": summary["tokens_per_s"],
        "parameters": summary["parameters"], "seed": cfg["train"]["seed"], "eval": study["eval"],
        "probes": study["probes"], "config": cfg, "git_revision": git_revision(), "environment": env,
        "versions": library_versions(), "seconds": times, "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                      time.gmtime()),
        "wall_s": time.time() - started,
    }
    atomic_write_bytes(out / "cell.json", json.dumps(to_jsonable(marker), indent=1).encode())
    if progress:
        print(f"[{study['name']}/{cell}] done in {marker['wall_s']:.0f} s ({', '.join(f'{k} {v:.0f}' for k, v in times.items())})"
              f" -> {out}", flush=True)
    return "done"


def run_study(study, cells=None, *, budget_s: float | None = None, device: str | None = None,
              progress: bool = True, fast: bool = False) -> dict:
    """Run every cell without results (or those in ``cells``), in order; returns ``{cell: status}``.

    With ``budget_s``, no stage starts that cannot finish before the budget's end: training pauses at a
    checkpoint (the cell reports "paused") and later cells are left for the next call ("not started").
    A failing cell is reported and the next one runs.
    """
    study = study if isinstance(study, dict) else load_study(study, fast=fast)
    names = list(study["cells"]) if cells is None else _cell_list(study, cells)
    deadline = None if budget_s is None else time.monotonic() + float(budget_s)
    out = {}
    for name in names:
        if deadline is not None and deadline - time.monotonic() < float(study["reserve_s"]):
            out[name] = "not started"
            continue
        try:
            out[name] = run_cell(study, name, deadline=deadline, device=device, progress=progress)
        except StudyPaused as err:
            print(f"pathlab study: {err}", file=sys.stderr, flush=True)
            out[name] = "paused"
        except Exception as err:  # noqa: BLE001  one broken cell must not cost the others their turn
            import traceback

            traceback.print_exc()
            print(f"pathlab study: cell {name!r} failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            out[name] = "failed"
    return out


def _cell_list(study: dict, cells) -> list[str]:
    names = [c.strip() for c in cells.split(",") if c.strip()] if isinstance(cells, str) else list(cells)
    unknown = [c for c in names if c not in study["cells"]]
    if unknown:
        raise ValueError(f"cells: unknown {unknown}; the study {study['name']!r} has {', '.join(study['cells'])}")
    return names


# ----------------------------------------------------------------------------------------------------------------
# reading results (the notebooks)


def figure_cells(study: dict, figure: str, only=None) -> list[str]:
    """The cells a figure compares (the study's ``figures`` section), optionally restricted to ``only``."""
    if figure not in study["figures"]:
        raise ValueError(f"study {study['name']!r} lists no cells for figure {figure!r}; it has "
                         f"{', '.join(study['figures'])}")
    chosen = [c for c in study["figures"][figure] if c in study["cells"]]
    if only is not None:
        wanted = [c.strip() for c in only.split(",")] if isinstance(only, str) else list(only)
        unknown = [c for c in wanted if c not in study["cells"]]
        if unknown:
            raise ValueError(f"variants: unknown {unknown}; the study {study['name']!r} has "
                             f"{', '.join(study['cells'])}")
        chosen = [c for c in chosen if c in wanted]
    return chosen


def load_cells(study: dict, cells) -> dict:
    """``{cell: {"cell": cell.json, "eval": eval.json, "record": probe record}}`` for the cells with results;
    cells without results are left out (:func:`missing_cells` names them)."""
    from pathlab.probes import records

    out = {}
    for c in cells:
        if not (cell_results_dir(study, c) / "cell.json").is_file():
            continue
        out[c] = {"cell": read_cell_file(study, c, "cell.json"), "eval": read_cell_file(study, c, "eval.json"),
                  "record": read_cell_file(study, c, "probes.npz", records.load_record)}
    return out


def seed_margins(profile: str, *, fast: bool = False) -> dict[int, float]:
    """The study's spread between seeds at each evaluation length (:func:`pathlab.intervals.seed_margins`), from
    the cells of its ``seeds`` figure that have results, each paired with ``<cell>-seed2``: the margin every
    figure's comparisons between cells must clear. ``{}`` for a study without second seeds."""
    return _seed_margins(load_study(profile, fast=fast))


def _seed_margins(study: dict) -> dict[int, float]:
    names = [c for c in study["figures"].get("seeds", []) if f"{c}-seed2" in study["figures"]["seeds"]]
    done = [c for c in names if not missing_cells(study, [c, f"{c}-seed2"])]
    return intervals.seed_margins([(read_cell_file(study, c, "eval.json"),
                                    read_cell_file(study, f"{c}-seed2", "eval.json")) for c in done])


def read_cell_file(study: dict, cell: str, name: str, reader=None):
    """One result file of a cell (JSON unless ``reader`` is given), or a ValueError that names the file and how to
    get it back: a truncated or corrupt file must stop a figure, never feed it."""
    path = cell_results_dir(study, cell) / name
    try:
        return reader(path) if reader else json.loads(path.read_text())
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
        raise ValueError(f"study {study['name']!r}, cell {cell!r}: {path} cannot be read ({type(err).__name__}: "
                         f"{err}); restore it from git or run the cell again (`pathlab study run {study['name']} "
                         f"--cells {cell}` after removing its folder)") from err


def missing_cells(study: dict, cells) -> list[str]:
    return [c for c in cells if not (cell_results_dir(study, c) / "cell.json").is_file()]


# ----------------------------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    sub.add_parser("list", help="list the study configs")
    status = sub.add_parser("status", help="which cells have results")
    status.add_argument("study")
    status.add_argument("--fast", action="store_true", help="the study's CI-sized version")
    go = sub.add_parser("run", help="train, evaluate and probe the cells without results")
    go.add_argument("study")
    go.add_argument("--cells", default=None, help="comma-separated cells, in this order (default: all)")
    go.add_argument("--budget-s", type=float, default=None,
                    help="start no stage that cannot finish within this many seconds; training pauses at a "
                         "checkpoint and the same command continues it")
    go.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: the training config's)")
    go.add_argument("--fast", action="store_true", help="the study's CI-sized version")
    go.add_argument("--no-progress", action="store_true")
    table = sub.add_parser("table", help="print the markdown tables of the results (--write: into the docs)")
    table.add_argument("study")
    table.add_argument("tables", nargs="*", default=None,
                       help="cells and/or cell groups (default: cells and every group)")
    table.add_argument("--write", action="store_true",
                       help="replace the marked tables in README.md and in the study's results README")
    table.set_defaults(fast=False)
    compare = sub.add_parser("compare", help="r(L) of one cell over another's at each length, with the paired "
                                             "95%% interval (the same windows resampled together)")
    compare.add_argument("study")
    compare.add_argument("cell_a")
    compare.add_argument("cell_b")
    compare.set_defaults(fast=False)


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "list":
            for name in available_studies():
                s = load_study(name)
                print(f"{name:<20} {len(s['cells']):>3} cells  {s.get('description', '')}")
            return 0
        study = load_study(args.study, fast=args.fast)
        if args.action == "status":
            for c in study["cells"]:
                print(f"{c:<28} {cell_status(study, c)}")
            return 0
        if args.action == "table":
            return _table(study, args.tables, args.write)
        if args.action == "compare":
            return _compare(study, args.cell_a, args.cell_b)
        statuses = run_study(study, args.cells, budget_s=args.budget_s, device=args.device,
                             progress=not args.no_progress)
    except ValueError as err:
        print(f"pathlab study: {err}", file=sys.stderr)
        return 2
    print("\ncell                         status")
    for c, s in statuses.items():
        print(f"{c:<28} {s}")
    return 0 if all(s in ("done",) for s in statuses.values()) else 1


def _compare(study: dict, a: str, b: str) -> int:
    cells = _cell_list(study, [a, b])
    missing = missing_cells(study, cells)
    if missing:
        raise ValueError(f"no results yet for {', '.join(missing)}")
    evals = [read_cell_file(study, c, "eval.json") for c in cells]
    margins = _seed_margins(study)
    print(f"{a} over {b} (study {study['name']}; paired 95% intervals, the same windows resampled together)\n")
    header = f"| L | r({a}) | r({b}) | r({a}) / r({b}) [95%] |"
    if margins:  # the spread between seeds a claim's interval must clear (pathlab.intervals.seed_margins)
        header += " seed margin m(L) | interval beyond [1/m, m] |"
    print(header + "\n" + "|---" * (header.count("|") - 1) + "|")
    for row in intervals.paired_table(*evals):
        ci = row["paired_ci95"]
        interval = f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "(scored on other windows)"
        line = f"| {row['length']} | {row['r_a']:.3f} | {row['r_b']:.3f} | {row['ratio']:.3f} {interval} |"
        if margins:
            m = intervals.margin_at(margins, row["length"])
            side = {-1: "below", 1: "above", 0: "no"}[intervals.order(ci, (1 / m, m))] if ci else "—"
            line += f" {m:.3f} | {side} |"
        print(line)
    return 0


def _table(study: dict, tables, write: bool) -> int:
    results = load_cells(study, study["cells"])
    if write:
        root = repo_root() or Path.cwd()
        for path in study_tables.write_tables(study, results, [root / "README.md", results_dir(study) / "README.md"]):
            print(f"updated {path}")
        return 0
    groups = list(dict.fromkeys(spec.get("group") for spec in study["cells"].values() if spec.get("group")))
    for name in tables or ["cells", *groups]:
        print(f"{name}:\n{study_tables.render(study, name, results)}\n")
    return 0


def runs_here(study: dict) -> bool:
    """Whether a missing cell may be trained on the spot: studies whose training config runs on the CPU."""
    return resolve_config(study["train_config"])["train"]["device"] == "cpu"


def figure_inputs(profile: str, figure: str, *, fast: bool = False, only=None, progress: bool = False):
    """The loaded cells of a figure and a note on what is missing: ``(cells, info)``.

    For a study that runs on the CPU (``tiny-cpu``) missing cells are trained, evaluated and probed first (about
    a minute each); for the others (GPU studies) the figure shows the cells that have committed results and
    ``info["missing"]`` lists the rest.
    """
    study = load_study(profile, fast=fast)
    names = figure_cells(study, figure, only)
    if runs_here(study):
        statuses = run_study(study, missing_cells(study, names), progress=progress)
        failed = {c: s for c, s in statuses.items() if s != "done"}
        if failed:
            raise RuntimeError(f"study {study['name']!r}: cells {failed} did not finish")
    cells = load_cells(study, names)
    info = {"study": study["name"], "description": study.get("description", ""), "cells": names,
            "missing": missing_cells(study, names), "results_dir": str(study["results_dir"]),
            "toy_scale": study["name"].startswith("tiny-cpu"),
            "runs": {c: {k: e["cell"].get(k) for k in ("tokens", "iterations", "train_loss", "val_loss",
                                                      "git_revision", "seed")} for c, e in cells.items()}}
    return cells, info
