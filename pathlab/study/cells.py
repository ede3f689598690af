"""The committed results of a study's cells (``results/<study>/<cell>/``), as the notebooks, the tables and
``pathlab study compare`` read them: a truncated or corrupt file stops the reader with the file's name, never
feeds a figure."""

from __future__ import annotations

import json
import zipfile

from pathlab import intervals
from pathlab.study.config import cell_results_dir, figure_cells, load_study, runs_here
from pathlab.study.runner import run_study


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


def seed_margins(study, *, fast: bool = False) -> dict[int, float]:
    """The study's spread between seeds at each evaluation length (:func:`pathlab.intervals.seed_margins`), from
    the cells of its ``seeds`` figure that have results, each paired with ``<cell>-seed2``: the margin every
    figure's comparisons between cells must clear. ``{}`` for a study without second seeds."""
    study = study if isinstance(study, dict) else load_study(study, fast=fast)
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
