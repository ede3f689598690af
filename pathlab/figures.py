"""``pathlab figures``: run every notebook through papermill and regenerate the figures.

    pathlab figures                          # tiny-cpu profile, all notebooks, into figures/
    pathlab figures --only far_mass --fast   # one notebook, CI-sized, into build/figures-fast/tiny-cpu/
    pathlab figures --profile h200-mini      # figures from the h200-mini runs, into figures/h200-mini/

Each notebook gets the parameters ``profile``, ``fast`` and ``out_dir`` (its cell tagged ``parameters``), runs in
the repository root, and its executed copy goes to ``build/notebooks/<profile>/`` (git-ignored). Figures and their
JSON sidecars are written atomically by the notebooks (:mod:`pathlab.results`); a notebook that fails is reported
and the others still run. Notebooks that need trained models list the variants in their metadata
(``"pathlab": {"variants": [...]}``); for ``tiny-cpu`` the missing runs are trained first, for the other profiles
the command says how to produce them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

PROFILES = {
    "tiny-cpu": "tiny models trained on the CPU in about a minute per variant (the committed figures)",
    "h200-mini": "small models trained on one H200",
    "owt16": "the paper setting: 16 layers x 768 on OpenWebText, context 512",
}


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


def check_parameters(*, profile, fast, out_dir, seed=0) -> None:
    """Validate the notebook parameters; a ValueError names the parameter and what was expected."""
    if not isinstance(profile, str) or profile not in PROFILES:
        raise ValueError(f"profile must be one of {', '.join(PROFILES)}, got {profile!r}")
    if not isinstance(fast, bool):
        raise ValueError(f"fast must be True or False, got {fast!r} ({type(fast).__name__}); "
                         "pass -p fast True to papermill, or --fast to `pathlab figures`")
    if not isinstance(out_dir, (str, os.PathLike)) or not str(out_dir):
        raise ValueError(f"out_dir must be a folder path, got {out_dir!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")


def default_out_dir(profile: str, fast: bool) -> str:
    """figures/ for tiny-cpu, figures/<profile>/ for the others; build/figures-fast/<profile>/ for fast runs."""
    if fast:
        return f"build/figures-fast/{profile}"
    return "figures" if profile == "tiny-cpu" else f"figures/{profile}"


# ----------------------------------------------------------------------------------------------------------------
# notebooks


def list_notebooks(notebook_dir: Path) -> list[Path]:
    return sorted(p for p in Path(notebook_dir).glob("*.ipynb") if not p.name.startswith("."))


def notebook_variants(path: Path) -> list[str]:
    """Attention variants whose trained runs the notebook needs (its metadata ``pathlab.variants``)."""
    with open(path, encoding="utf-8") as f:
        meta = json.load(f).get("metadata", {})
    return list(meta.get("pathlab", {}).get("variants", []))


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


def collect_results(out_dir: Path, since: float) -> list[dict]:
    """The results JSONs written into out_dir at or after ``since`` (one notebook's run)."""
    found = []
    for p in sorted(Path(out_dir).glob("*.json")):
        if p.stat().st_mtime >= since - 1.0:
            try:
                with open(p, encoding="utf-8") as f:
                    record = json.load(f)
                found.append({"stem": p.stem, "claims": dict(record.get("claims", {})),
                              "figure": p.with_suffix(".png").exists()})
            except (OSError, ValueError) as err:
                found.append({"stem": p.stem, "claims": {}, "figure": False, "error": str(err)})
    return found


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
            held = [k for k, v in res["claims"].items() if v]
            failed = [k for k, v in res["claims"].items() if not v]
            text = f"{res['stem']}{'' if res['figure'] else ' (json only)'}: {len(held)}/{len(res['claims'])} held"
            if failed:
                text += f"; NOT held: {', '.join(failed)}"
            print(("  " if i == 0 else " " * 43) + text, file=stream)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="tiny-cpu", choices=list(PROFILES),
                        help="which trained runs the model-based figures use (default: tiny-cpu)")
    parser.add_argument("--only", action="append", metavar="NAME",
                        help="run only this notebook (its file name without .ipynb); repeatable")
    parser.add_argument("--fast", action="store_true", help="CI-sized run (fewer trials, few training steps)")
    parser.add_argument("--out-dir", default=None,
                        help="where figures go (default: figures/ for tiny-cpu, figures/<profile>/ otherwise, "
                             "build/figures-fast/<profile>/ with --fast)")
    parser.add_argument("--notebooks", default="notebooks", help="folder of notebooks (default: notebooks)")
    parser.add_argument("--build-dir", default="build/notebooks", help="executed copies (default: build/notebooks)")
    parser.add_argument("--variants", default=None, metavar="A,B,...",
                        help="restrict the model-based figures to these trained variants (default: all they use)")
    parser.add_argument("--list", action="store_true", help="list the notebooks and the runs they need, then exit")


def run(args: argparse.Namespace) -> int:
    root = find_project_root()
    nb_dir = Path(args.notebooks) if Path(args.notebooks).is_absolute() else root / args.notebooks
    if not nb_dir.is_dir():
        print(f"pathlab figures: no notebook folder at {nb_dir}; run from the repository root or pass --notebooks",
              file=sys.stderr)
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
    if args.list:
        for p in notebooks:
            variants = notebook_variants(p)
            print(f"{p.stem:<24} {'needs runs: ' + ', '.join(variants) if variants else 'synthetic'}")
        return 0

    wanted = None
    if args.variants:
        from pathlab.probes.runs import VARIANTS

        wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown = [v for v in wanted if v not in VARIANTS]
        if unknown:
            print(f"pathlab figures: unknown variants {unknown}; known: {', '.join(VARIANTS)}", file=sys.stderr)
            return 2

    out_dir = Path(args.out_dir or default_out_dir(args.profile, args.fast))
    out_dir = out_dir if out_dir.is_absolute() else root / out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    build_dir = Path(args.build_dir) if Path(args.build_dir).is_absolute() else root / args.build_dir
    build_dir = build_dir / (args.profile + ("-fast" if args.fast else ""))
    print(f"pathlab figures: {len(notebooks)} notebook(s), profile {args.profile}{' (fast)' if args.fast else ''}, "
          f"figures -> {out_dir}, executed notebooks -> {build_dir}")

    needed = sorted({v for p in notebooks for v in notebook_variants(p)})
    if needed:
        from pathlab.probes import runs

        if args.fast:
            needed = [v for v in needed if v in runs.FAST_VARIANTS]
        if args.variants:
            needed = [v for v in needed if v in wanted]

        try:
            runs.ensure_runs(args.profile, needed, fast=args.fast, progress=True)
        except (FileNotFoundError, ValueError, RuntimeError) as err:
            print(f"pathlab figures: trained runs are missing or unusable:\n{err}\n"
                  "The notebooks that need them will fail; the others still run.", file=sys.stderr)

    previous = os.environ.get("PATHLAB_NO_PROGRESS")
    os.environ["PATHLAB_NO_PROGRESS"] = "1"  # the kernels inherit it: no progress bars inside executed notebooks
    try:
        rows = _run_all(notebooks, args, out_dir, build_dir, root)
    finally:
        if previous is None:
            os.environ.pop("PATHLAB_NO_PROGRESS", None)
        else:
            os.environ["PATHLAB_NO_PROGRESS"] = previous
    _print_summary(rows)
    failed = [r["name"] for r in rows if r["status"] != "ok"]
    if failed:
        print(f"\n{len(failed)} notebook(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _run_all(notebooks, args, out_dir, build_dir, root) -> list[dict]:
    rows = []
    for n, path in enumerate(notebooks, 1):
        print(f"[{n}/{len(notebooks)}] {path.stem} ...", flush=True)
        start = time.time()
        params = {"profile": args.profile, "fast": bool(args.fast), "out_dir": str(out_dir)}
        if args.variants and notebook_variants(path):
            params["variants"] = args.variants
        ok, error = run_notebook(path, build_dir / path.name, params, root)
        seconds = time.time() - start
        rows.append({"name": path.stem, "status": "ok" if ok else "FAILED", "seconds": seconds, "error": error,
                     "results": collect_results(out_dir, start) if ok else []})
        print(f"[{n}/{len(notebooks)}] {path.stem}: {'ok' if ok else 'FAILED'} ({seconds:.1f} s)"
              + ("" if ok else f"\n    {error[:500]}\n    executed copy: {build_dir / path.name}"), flush=True)
    return rows
