"""``pathlab tasks``: train and evaluate small models on the state-tracking tasks.

    pathlab tasks run flipflop --attention path --preset cpu            # one run, JSON of the metrics
    pathlab tasks run a5 --attention rope length=12 n_layer=2           # key=value settings on top
    pathlab tasks sweep-a5 --preset cpu --attentions rope,path          # minimum layers per length
    pathlab tasks suite --preset h200 --workers 12 --out-dir results/tasks/h200
    pathlab tasks settings mqrar --preset h200                          # print the resolved settings
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from pathlab.tasks.specs import TASKS
from pathlab.tasks.suite import DEFAULT_ATTENTIONS, SuiteFailed


def _csv(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


def _ints(text: str) -> list[int]:
    try:
        return [int(t) for t in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.splitlines()[0]
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "\n".join(__doc__.splitlines()[2:])
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)  # of the parser's class

    run = sub.add_parser("run", help="train and evaluate one model on a task")
    run.add_argument("task", choices=sorted(TASKS))
    run.add_argument("--attention", required=True, help="attention variant (see `pathlab info`)")
    run.add_argument("--preset", default="cpu", help="preset of configs/tasks/TASK.yaml (tiny-cpu, cpu, h200)")
    run.add_argument("--out", default=None, help="result JSON (default runs/tasks/PRESET/TASK-ATTENTION.json)")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument("overrides", nargs="*", metavar="key=value", help="settings on top of the preset")

    sw = sub.add_parser("sweep-a5", help="minimum number of layers reaching >90%% accuracy, per A5 length")
    sw.add_argument("--preset", default="cpu")
    sw.add_argument("--attentions", type=_csv, default=list(DEFAULT_ATTENTIONS))
    sw.add_argument("--lengths", type=_ints, default=None, help="e.g. 4,8,12 (default: the preset's)")
    sw.add_argument("--layers", type=_ints, default=None, help="depths to try, e.g. 1,2,3,4 (default: preset's)")
    sw.add_argument("--workers", type=int, default=1, help="parallel worker processes")
    sw.add_argument("--out", default=None, help="JSON path (default runs/tasks/PRESET/a5_sweep.json)")
    sw.add_argument("overrides", nargs="*", metavar="key=value")

    su = sub.add_parser("suite", help="flip-flop, MQRAR-N and the A5 sweep for several variants")
    su.add_argument("--preset", default="cpu")
    su.add_argument("--attentions", type=_csv, default=list(DEFAULT_ATTENTIONS))
    su.add_argument("--tasks", type=_csv, default=["flipflop", "mqrar", "a5"])
    su.add_argument("--workers", type=int, default=1)
    su.add_argument("--out-dir", default=None, help="folder for the JSONs (default runs/tasks/PRESET)")
    su.add_argument("--set", action="append", default=[], metavar="TASK:key=value",
                    help="a setting for one task, e.g. a5:steps=100 (repeatable)")
    su.add_argument("--n-back", type=_ints, default=None, help="MQRAR-N values, e.g. 2,3 (default: preset's)")
    su.add_argument("--lengths", type=_ints, default=None, help="A5 lengths, e.g. 4,8 (default: preset's)")
    su.add_argument("--layers", type=_ints, default=None, help="A5 depths to try, e.g. 1,2,3 (default: preset's)")
    su.add_argument("--parallel-depths", action="store_true",
                    help="train each A5 depth as its own job instead of deepening until one solves the length")

    st = sub.add_parser("settings", help="print the resolved settings of a task and preset")
    st.add_argument("task", choices=sorted(TASKS))
    st.add_argument("--preset", default="cpu")
    st.add_argument("overrides", nargs="*", metavar="key=value")


def _command(argv=None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    return "pathlab " + " ".join(shlex.quote(a) for a in argv)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from pathlab.tasks.settings import parse_overrides, resolve_settings

    try:
        if args.action == "settings":
            s = resolve_settings(args.task, preset=args.preset, overrides=parse_overrides(args.overrides))
            print(json.dumps(s, indent=1))
            return 0
        if args.action == "run":
            from pathlab.tasks.runner import check_output_file, run_task

            out = args.out or Path("runs") / "tasks" / args.preset / f"{args.task}-{args.attention}.json"
            check_output_file(out, "--out")
            rec = run_task(args.task, args.attention, preset=args.preset,
                           overrides=parse_overrides(args.overrides), out=out, progress=not args.quiet,
                           command=_command())
            print(json.dumps({"summary": rec["summary"], "steps": rec["steps"], "stopped": rec["stopped"],
                              "train_seconds": rec["train_seconds"]}, indent=1))
            print(f"wrote {out}")
            return 0
        if args.action == "sweep-a5":
            from pathlab.tasks.runner import check_output_file
            from pathlab.tasks.suite import sweep_a5

            out = check_output_file(args.out or Path("runs") / "tasks" / args.preset / "a5_sweep.json", "--out")
            sweep_a5(preset=args.preset, attentions=args.attentions, lengths=args.lengths, layers=args.layers,
                     out=out, workers=args.workers, overrides=parse_overrides(args.overrides), command=_command(),
                     log=_log)
            print(json.dumps(min_layers_table(out), indent=1))
            print(f"wrote {out}")
            return 0
        if args.action == "suite":
            from pathlab.tasks.suite import run_suite

            per_task: dict[str, list[str]] = {}
            for item in args.set:
                task, sep, kv = item.partition(":")
                if not sep or task not in TASKS:
                    raise ValueError(f"--set must be TASK:key=value with TASK in {sorted(TASKS)}, got {item!r}")
                per_task.setdefault(task, []).append(kv)
            sweeps = {"mqrar": {"n_back": args.n_back} if args.n_back else {},
                      "a5": {key: val for key, val in (("lengths", args.lengths), ("layers", args.layers)) if val}}
            out_dir = args.out_dir or Path("runs") / "tasks" / args.preset
            paths = run_suite(preset=args.preset, attentions=args.attentions, tasks=args.tasks, out_dir=out_dir,
                              workers=args.workers, command=_command(), log=_log, sweeps=sweeps,
                              parallel_depths=args.parallel_depths,
                              overrides={t: parse_overrides(v) for t, v in per_task.items()})
            for p in paths.values():
                print(f"wrote {p}")
            return 0
    except ValueError as err:
        print(f"pathlab tasks: {err}", file=sys.stderr)
        return 2
    except SuiteFailed as err:  # the log above names each failure; the finished jobs are written
        print(f"pathlab tasks: {err}", file=sys.stderr)
        return 1
    return 2


def min_layers_table(path) -> dict[str, dict[int, int | None]]:
    """{attention: {length: minimum layers or None}} from a sweep JSON."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    table: dict[str, dict[int, int | None]] = {}
    for chain in doc["chains"]:
        table.setdefault(chain["attention"], {})[chain["length"]] = chain["min_layers"]
    return table
