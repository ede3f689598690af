"""``pathlab figures``: run every notebook through papermill and regenerate the figures of a study.

    pathlab figures                              # the tiny-cpu study (trained here), all notebooks, into figures/
    pathlab figures --profile owt16-debian       # from the committed 16-layer results, into figures/owt16-debian/
    pathlab figures --only far_mass --fast       # one notebook, CI-sized, into build/figures-fast/tiny-cpu/

A profile is a study (``configs/studies/<name>.yaml``, :mod:`pathlab.study`): the model-based figures read its
cells' compact results. For a study that trains on the CPU (``tiny-cpu``), the cells the notebooks need are
trained, evaluated and probed first (about a minute each on 2 cores); for a GPU study the figures use the cells
with committed results and name the missing ones.

Each notebook gets the parameters ``profile``, ``fast`` and ``out_dir`` (its cell tagged ``parameters``) and runs
in the repository root; its executed copy goes to ``build/notebooks/<profile>/`` (git-ignored). A notebook writes
into a staging folder, and only when it finishes are its declared figures (its metadata ``pathlab.writes``)
moved into the figure folder, so a failing notebook changes nothing there. A notebook run on its own (JupyterLab,
papermill) writes to ``build/figures/<profile>/`` unless given ``out_dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

# ----------------------------------------------------------------------------------------------------------------
# helpers the notebooks call


def find_project_root(start: str | os.PathLike | None = None) -> Path:
    """The nearest folder at or above ``start`` (default: cwd) holding both ``pyproject.toml`` and
    ``notebooks/``; the cwd itself when there is none (an installed package used elsewhere)."""
    here = Path(start or os.getcwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "pyproject.toml").is_file() and (folder / "notebooks").is_dir():
            return folder
    return here


def project_path(path: str | os.PathLike) -> Path:
    """Resolve a relative path against the project root, so a notebook opened in JupyterLab (cwd = notebooks/)
    and one run by ``pathlab figures`` (cwd = repository root) write to the same place."""
    path = Path(path)
    return path if path.is_absolute() else find_project_root() / path


def profiles() -> list[str]:
    """The profiles: the study configs under ``configs/studies/``."""
    from pathlab.study import available_studies

    return available_studies()


def check_parameters(*, profile, fast, out_dir, seed=0, variants=None, near_width=None) -> None:
    """Validate the notebook parameters before anything is drawn (a bad one found later would leave figures of
    two runs side by side); a ValueError names the parameter and what was expected."""
    known = profiles()
    if not isinstance(profile, str) or profile not in known:
        raise ValueError(f"profile must be one of {', '.join(known)}, got {profile!r}")
    if not isinstance(fast, bool):
        raise ValueError(f"fast must be True or False, got {fast!r} ({type(fast).__name__}); "
                         "pass -p fast True to papermill, or --fast to `pathlab figures`")
    if out_dir is not None and (not isinstance(out_dir, (str, os.PathLike)) or not str(out_dir)):
        raise ValueError(f"out_dir must be a folder path or None (build/figures/<profile>/), got {out_dir!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if variants is None and near_width is None:
        return
    from pathlab.probes.records import DEFAULTS
    from pathlab.study import cell_names, load_study

    study = load_study(profile, fast=fast)
    if variants is not None:
        cell_names(study, variants, "variants")
    widths = ["per-head", *(str(w) for w in study["probes"].get("near", DEFAULTS["near"]))]
    if near_width is not None and (isinstance(near_width, bool) or str(near_width) not in widths):
        raise ValueError(f"near_width must be None or one of the study's near-set widths {widths}, got {near_width!r}")


def notebook_out_dir(profile: str, fast: bool, out_dir=None) -> Path:
    """Where a notebook writes: ``out_dir`` if given, else ``build/figures/<profile>[-fast]/`` (never the
    committed figures unless asked)."""
    if out_dir is None:
        out_dir = f"build/figures/{profile}{'-fast' if fast else ''}"
    return project_path(out_dir)


def default_out_dir(profile: str, fast: bool) -> str:
    """``pathlab figures``' folder: figures/ for tiny-cpu, figures/<profile>/ for the others;
    build/figures-fast/<profile>/ for fast runs."""
    if fast:
        return f"build/figures-fast/{profile}"
    return "figures" if profile == "tiny-cpu" else f"figures/{profile}"


def scale_note(info: dict) -> str:
    """The line a model-based figure carries about the models it shows (toy scale: a pipeline check)."""
    note = f"study {info['study']}"
    if info.get("description"):
        note += f" ({info['description']})"
    if info.get("toy_scale"):
        note += ": toy-scale models, a pipeline check, not evidence"
    if info.get("missing"):
        note += f"; not yet run: {', '.join(info['missing'])}"
    return note


# ----------------------------------------------------------------------------------------------------------------
# notebooks


def list_notebooks(notebook_dir: Path) -> list[Path]:
    return sorted(p for p in Path(notebook_dir).glob("*.ipynb") if not p.name.startswith("."))


def notebook_meta(path: Path) -> dict:
    """The notebook's ``pathlab`` metadata: ``study_figures`` (the study figure lists it reads) and ``writes``
    (the figure stems it writes)."""
    with open(path, encoding="utf-8") as f:
        meta = json.load(f).get("metadata", {}).get("pathlab", {})
    return {"study_figures": list(meta.get("study_figures", [])), "writes": list(meta.get("writes", []))}


def run_notebook(path: Path, output: Path, parameters: dict, cwd: Path) -> tuple[bool, str]:
    """Execute one notebook with papermill; returns (ok, error message)."""
    import papermill

    output.parent.mkdir(parents=True, exist_ok=True)
    try:
        papermill.execute_notebook(str(path), str(output), parameters=parameters, cwd=str(cwd),
                                   progress_bar=False, log_output=False, kernel_name="python3")
        return True, ""
    except papermill.PapermillExecutionError as err:
        return False, f"{err.ename}: {err.evalue}".strip()
    except Exception as err:  # kernel died, missing kernel, bad notebook: report and go on with the others
        return False, f"{type(err).__name__}: {err}".strip()


def collect_outputs(staging: Path, stems: list[str]) -> tuple[list[dict], list[str]]:
    """The declared outputs of one notebook in its staging folder: per stem its claims and checks, and the
    names of the declared stems that it did not write."""
    found, absent = [], []
    for stem in stems:
        p = staging / f"{stem}.json"
        if not p.is_file():
            absent.append(stem)
            continue
        with open(p, encoding="utf-8") as f:
            record = json.load(f)
        found.append({"stem": stem, "claims": dict(record.get("claims", {})),
                      "checks": dict(record.get("checks", {})), "figure": (staging / f"{stem}.png").is_file()})
    return found, absent


def publish(staging: Path, out_dir: Path) -> None:
    """Move every file of a finished notebook's staging folder into ``out_dir`` (each an atomic rename)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for p in sorted(staging.iterdir()):
        os.replace(p, out_dir / p.name)
    staging.rmdir()


def _claim_text(res: dict) -> str:
    held = [k for k, v in res["claims"].items() if v is True]
    failed = [k for k, v in res["claims"].items() if v is False]
    undefined = [k for k, v in res["claims"].items() if v is None]
    broken = [k for k, v in res["checks"].items() if not v]
    parts = []
    if res["claims"]:
        parts.append(f"{len(held)}/{len(res['claims'])} claims held")
    if failed:
        parts.append(f"NOT held: {', '.join(failed)}")
    if undefined:
        parts.append(f"undefined: {', '.join(undefined)}")
    if res["checks"]:
        parts.append(f"{len(res['checks']) - len(broken)}/{len(res['checks'])} checks passed")
    if broken:
        parts.append(f"CHECKS FAILED: {', '.join(broken)}")
    return f"{res['stem']}{'' if res['figure'] else ' (json only)'}: " + ("; ".join(parts) or "no claims")


def _print_summary(rows: list[dict], stream=None) -> None:
    stream = stream or sys.stdout
    print("\nnotebook                 status   seconds  figure / claims", file=stream)
    print("-" * 100, file=stream)
    for row in rows:
        print(f"{row['name']:<24} {row['status']:<8} {row['seconds']:>7.1f}", file=stream, end="")
        if row["status"] != "ok":
            print(f"  {row['error'][:300]}", file=stream)
            continue
        if not row["results"]:
            print("  (no figure written)", file=stream)
            continue
        for i, res in enumerate(row["results"]):
            print(("  " if i == 0 else " " * 43) + _claim_text(res), file=stream)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="tiny-cpu",
                        help="the study whose results the model-based figures use (default: tiny-cpu)")
    parser.add_argument("--only", action="append", metavar="NAME",
                        help="run only this notebook (its file name without .ipynb); repeatable")
    parser.add_argument("--fast", action="store_true", help="CI-sized run (the study's fast version)")
    parser.add_argument("--out-dir", default=None,
                        help="where figures go (default: figures/ for tiny-cpu, figures/<profile>/ otherwise, "
                             "build/figures-fast/<profile>/ with --fast)")
    parser.add_argument("--notebooks", default="notebooks", help="folder of notebooks (default: notebooks)")
    parser.add_argument("--build-dir", default="build/notebooks", help="executed copies (default: build/notebooks)")
    parser.add_argument("--variants", default=None, metavar="A,B,...",
                        help="restrict the model-based figures to these cells of the study (default: all they use)")
    parser.add_argument("--list", action="store_true", help="list the notebooks and the cells they need, then exit")


def _needed_cells(study: dict, notebooks, wanted) -> list[str]:
    from pathlab.study.config import figure_cells

    names = []
    for p in notebooks:
        for figure in notebook_meta(p)["study_figures"]:
            if figure in study["figures"]:
                names += figure_cells(study, figure, wanted)
    return list(dict.fromkeys(names))


def run(args: argparse.Namespace) -> int:
    from pathlab import study as studies

    root = find_project_root()
    nb_dir = Path(args.notebooks) if Path(args.notebooks).is_absolute() else root / args.notebooks
    if not nb_dir.is_dir():
        print(f"pathlab figures: no notebook folder at {nb_dir}; run from the repository root or pass --notebooks",
              file=sys.stderr)
        return 2
    try:
        study = studies.load_study(args.profile, fast=args.fast)
    except ValueError as err:
        print(f"pathlab figures: --profile: {err}", file=sys.stderr)
        return 2
    notebooks = list_notebooks(nb_dir)
    if args.only:
        known = {p.stem: p for p in notebooks}
        unknown = [n for n in args.only if n.removesuffix(".ipynb") not in known]
        if unknown:
            print(f"pathlab figures: unknown notebook {', '.join(unknown)}; choose from {', '.join(known)}",
                  file=sys.stderr)
            return 2
        notebooks = [known[n.removesuffix(".ipynb")] for n in args.only]
    wanted = None
    if args.variants:
        try:
            wanted = studies.cell_names(study, args.variants, "--variants")
        except ValueError as err:
            print(f"pathlab figures: {err}", file=sys.stderr)
            return 2
    if args.list:
        for p in notebooks:
            cells = _needed_cells(study, [p], wanted)
            print(f"{p.stem:<24} {'needs cells: ' + ', '.join(cells) if cells else 'synthetic'}")
        return 0

    out_dir = Path(args.out_dir or default_out_dir(args.profile, args.fast))
    out_dir = out_dir if out_dir.is_absolute() else root / out_dir
    build_dir = Path(args.build_dir) if Path(args.build_dir).is_absolute() else root / args.build_dir
    build_dir = build_dir / study["name"]
    staging_root = root / "build" / "figures-staging" / study["name"]
    print(f"pathlab figures: {len(notebooks)} notebook(s), profile {study['name']}, figures -> {out_dir}, "
          f"executed notebooks -> {build_dir}")
    needed = _needed_cells(study, notebooks, wanted)
    if needed and studies.runs_here(study):
        statuses = studies.run_study(study, studies.missing_cells(study, needed), progress=True)
        failed = [c for c, s in statuses.items() if s != "done"]
        if failed:
            print(f"pathlab figures: cells {', '.join(failed)} did not finish; the notebooks that need them will "
                  "fail", file=sys.stderr)
    elif needed:
        missing = studies.missing_cells(study, needed)
        if missing:
            print(f"pathlab figures: study {study['name']} has no results yet for {', '.join(missing)} "
                  f"(`pathlab study run {args.profile} --cells {','.join(missing)}` on a GPU machine); the figures "
                  "show the cells that have them", file=sys.stderr)
    rows = []
    for n, path in enumerate(notebooks, 1):
        print(f"[{n}/{len(notebooks)}] {path.stem} ...", flush=True)
        start = time.time()
        staging = staging_root / path.stem
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        params = {"profile": args.profile, "fast": bool(args.fast), "out_dir": str(staging)}
        if args.variants and notebook_meta(path)["study_figures"]:
            params["variants"] = args.variants
        ok, error = run_notebook(path, build_dir / path.name, params, root)
        results = []
        if ok:
            results, absent = collect_outputs(staging, notebook_meta(path)["writes"])
            if absent:
                ok, error = False, f"the notebook did not write its declared outputs {absent}"
        if ok:
            publish(staging, out_dir)
        else:
            shutil.rmtree(staging, ignore_errors=True)
        seconds = time.time() - start
        rows.append({"name": path.stem, "status": "ok" if ok else "FAILED", "seconds": seconds, "error": error,
                     "results": results})
        print(f"[{n}/{len(notebooks)}] {path.stem}: {'ok' if ok else 'FAILED'} ({seconds:.1f} s)"
              + ("" if ok else f"\n    {error[:500]}\n    executed copy: {build_dir / path.name}"), flush=True)
    _print_summary(rows)
    failed = [r["name"] for r in rows if r["status"] != "ok"]
    if failed:
        print(f"\n{len(failed)} notebook(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
