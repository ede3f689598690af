"""The committed results of a study's cells (``results/<study>/<cell>/``), as the notebooks, the tables and
``pathlab study compare`` read them.

A file that cannot feed a figure stops the reader with its name and the way back, never feeds it: a truncated or
corrupt file, one of another format, one whose cell is not the folder's (a copy from another cell), an
evaluation of another checkpoint than the cell's, and results of another config than the study's (a *stale* cell:
its recorded fingerprint differs from the one the study config gives, :func:`pathlab.study.config.cell_fingerprint`).
"""

from __future__ import annotations

import json
import zipfile
import zlib

from pathlab import intervals
from pathlab.data.tokens import file_sha256
from pathlab.study.config import cell_fingerprint, cell_results_dir, figure_cells, load_study, runs_here
from pathlab.study.runner import run_study


def load_cells(study: dict, cells) -> dict:
    """``{cell: {"cell": cell.json, "eval": eval.json, "record": probe record}}`` for the cells with results;
    cells without results are left out (:func:`missing_cells` names them)."""
    out = {}
    for c in cells:
        if not (cell_results_dir(study, c) / "cell.json").is_file():
            continue
        out[c] = {"cell": read_cell_file(study, c, "cell.json"), "eval": read_eval(study, c),
                  "record": read_record(study, c)}
    check_one_corpus(study, list(out))
    return out


def check_one_corpus(study: dict, cells) -> None:
    """A ValueError unless ``cells`` were trained and scored on one build of the corpus (the identity each
    ``cell.json`` records, package versions aside). Cells are compared on the same windows, which are positions in
    the validation split: two builds (other package versions) put other text at those positions."""
    identities = {}
    for c in cells:
        recorded = (read_cell_file(study, c, "cell.json").get("environment") or {}).get("corpus_identity") or {}
        identities[c] = {k: v for k, v in recorded.items() if k != "packages"}
    if len({json.dumps(v, sort_keys=True) for v in identities.values()}) > 1:
        listed = ", ".join(f"{c} {str(v.get('val_sha256'))[:12]}" for c, v in identities.items())
        raise ValueError(f"study {study['name']!r}: the cells were scored on different builds of the corpus "
                         f"(validation split sha256: {listed}), so their windows hold other text and no comparison "
                         "between them holds; prepare the corpus with one cell's package versions (`pathlab data "
                         "prepare NAME --pin FILE`) and run the others again")


def read_eval(study: dict, cell: str) -> dict:
    """A cell's ``eval.json``, checked against its ``cell.json``: the same attention, and the evaluated checkpoint is
    the one the cell trained (its last iteration)."""
    marker = read_cell_file(study, cell, "cell.json")
    ev = read_cell_file(study, cell, "eval.json")
    for key, recorded in (("attention", marker["attention"]), ("checkpoint_step", marker["iterations"])):
        if ev.get(key) != recorded:
            _refuse(study, cell, "eval.json", f"it evaluated {key} {ev.get(key)!r}, the cell's cell.json records "
                                              f"{recorded!r}")
    return ev


def seed_margins(study, *, fast: bool = False) -> dict[int, float]:
    """The study's spread between seeds at each evaluation length (:func:`pathlab.intervals.seed_margins`), from
    the cells of its ``seeds`` figure that have results, each paired with ``<cell>-seed2``: the margin every
    figure's comparisons between cells must clear. ``{}`` for a study without second seeds."""
    study = study if isinstance(study, dict) else load_study(study, fast=fast)
    names = [c for c in study["figures"].get("seeds", []) if f"{c}-seed2" in study["figures"]["seeds"]]
    done = [c for c in names if not missing_cells(study, [c, f"{c}-seed2"])]
    check_one_corpus(study, [x for c in done for x in (c, f"{c}-seed2")])
    return intervals.seed_margins([(read_eval(study, c), read_eval(study, f"{c}-seed2")) for c in done])


def read_record(study: dict, cell: str) -> dict:
    """A cell's probe record (``probes.npz``), checked against its ``cell.json``: the record names no cell itself,
    so ``cell.json`` records its sha256 (cells written before it did are vouched for by git alone)."""
    from pathlab.probes import records

    recorded = read_cell_file(study, cell, "cell.json").get("probes_sha256")
    record = read_cell_file(study, cell, "probes.npz", records.load_record)
    if recorded is not None and file_sha256(cell_results_dir(study, cell) / "probes.npz") != recorded:
        _refuse(study, cell, "probes.npz", f"its contents are not the record its cell.json names (sha256 "
                                           f"{recorded[:12]}…; copied from another cell, or changed since?)")
    return record


# what each JSON result file must hold: its cell's name under ``name_key``, and these keys
JSON_FILES = {"cell.json": ("cell", ("fingerprint", "attention", "iterations", "tokens", "val_loss")),
              "eval.json": ("run", ("attention", "checkpoint_step", "lengths"))}


def read_cell_file(study: dict, cell: str, name: str, reader=None):
    """One result file of a cell (JSON unless ``reader`` is given), or a ValueError that names the file and how to
    get it back. A JSON file must be a mapping with the keys of :data:`JSON_FILES` and name this cell, and
    ``cell.json`` must carry the fingerprint of the cell's config in the study as it is now."""
    path = cell_results_dir(study, cell) / name
    try:
        data = reader(path) if reader else json.loads(path.read_text())
    except (OSError, EOFError, ValueError, KeyError, TypeError, zipfile.BadZipFile, zlib.error) as err:
        _refuse(study, cell, name, f"it cannot be read ({type(err).__name__}: {err})")
    if name in JSON_FILES:
        name_key, keys = JSON_FILES[name]
        if not isinstance(data, dict) or any(k not in data for k in (name_key, *keys)):
            found = sorted(data) if isinstance(data, dict) else type(data).__name__
            _refuse(study, cell, name, f"it is not a result file of pathlab's (it needs {[name_key, *keys]}; "
                                       f"found {found})")
        if data[name_key] != cell:
            _refuse(study, cell, name, f"it belongs to cell {data[name_key]!r}, not to {cell!r} (copied from "
                                       "another cell?)")
    if name == "cell.json" and data["fingerprint"] != cell_fingerprint(study, cell):
        raise ValueError(f"study {study['name']!r}, cell {cell!r}: its results are stale: {path} records the config "
                         f"{data['fingerprint']}, the study config gives {cell_fingerprint(study, cell)} (the cell's "
                         "config, the study's overrides, evaluation or probe settings changed since it ran); restore "
                         f"the config from git, or run the cell again (`pathlab study run {study['name']} --cells "
                         f"{cell}` after removing its folder)")
    return data


def _refuse(study: dict, cell: str, name: str, why: str):
    path = cell_results_dir(study, cell) / name
    raise ValueError(f"study {study['name']!r}, cell {cell!r}: {path} is refused: {why}; restore it from git "
                     f"or run the cell again (`pathlab study run {study['name']} --cells {cell}` after removing "
                     "its folder)")


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
