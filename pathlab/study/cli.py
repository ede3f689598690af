"""``pathlab study``: list the studies, show which cells have results, run cells, print or write the tables of the
results, and compare two cells with paired intervals.

    pathlab study list                               # the study configs under configs/studies/
    pathlab study status owt16-debian                # which cells have results
    pathlab study run owt16-debian --cells rope,path --budget-s 540
    pathlab study table owt16-debian --write         # the README's and the ledger's tables from the results
    pathlab study compare owt16-debian nope rope     # r(L) of one cell over another's, paired intervals
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pathlab import intervals
from pathlab.study import tables as study_tables
from pathlab.study.cells import check_one_corpus, load_cells, missing_cells, read_eval, seed_margins
from pathlab.study.config import available_studies, cell_names, load_study, results_dir
from pathlab.study.runner import cell_status, run_study
from pathlab.training.config import repo_root


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
    cells = cell_names(study, [a, b])
    missing = missing_cells(study, cells)
    if missing:
        raise ValueError(f"no results yet for {', '.join(missing)}")
    check_one_corpus(study, cells)
    evals = [read_eval(study, c) for c in cells]
    margins = seed_margins(study)
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
