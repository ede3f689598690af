"""The ``pathlab`` command line: one subcommand per job, each living beside the code it drives.

Each subcommand module provides ``add_arguments(parser)`` and ``run(args) -> int``. Modules are imported only
when their subcommand is used, so ``pathlab --help`` stays fast and one broken extra never breaks the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "data": ("pathlab.data.cli", "prepare and inspect token corpora"),
    "train": ("pathlab.training.trainer", "train a language model from a config"),
    "eval": ("pathlab.training.evaluate", "length-extrapolation evaluation of a trained run"),
    "study": ("pathlab.study.cli", "train, evaluate and probe the cells of a study (configs/studies/)"),
    "figures": ("pathlab.figures.pipeline", "run every notebook through papermill and regenerate figures/"),
    "tasks": ("pathlab.tasks.cli", "state-tracking tasks: flip-flop, A5 word problems, MQRAR-N"),
    "info": ("pathlab.info", "list the attention variants and their parameter counts"),
}


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser (and its own subcommands'): ``key=value`` overrides are accepted after the options
    too (``pathlab train --no-progress train.max_iters=100``); argparse fills a ``nargs="*"`` positional only from
    the first block of positionals and would reject the later ones as unrecognised arguments."""

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        settings = [e for e in extras if "=" in e and not e.startswith("-")]
        if settings and hasattr(ns, "overrides"):
            ns.overrides = list(ns.overrides or []) + settings
            extras = [e for e in extras if e not in settings]
        return ns, extras


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pathlab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        parser = build_parser()
        if argv and argv[0] not in ("-h", "--help"):
            parser.print_usage(sys.stderr)
            print(f"pathlab: unknown command {argv[0]!r}; choose one of {', '.join(SUBCOMMANDS)}", file=sys.stderr)
            return 2
        parser.print_help()
        return 0
    name, rest = argv[0], argv[1:]
    module = importlib.import_module(SUBCOMMANDS[name][0])
    parser = CommandParser(prog=f"pathlab {name}", description=SUBCOMMANDS[name][1])
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print(f"pathlab {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
