"""``pathlab data``: prepare, describe and verify token corpora.

    pathlab data prepare debian [--out DIR]        # offline corpus from Debian packages
    pathlab data prepare debian --pin FILE         # ... from exactly the package versions FILE names
    pathlab data prepare openwebtext [--shards N]  # needs network (Hugging Face hub)
    pathlab data info debian
    pathlab data verify debian                     # recompute every SHA-256
"""

from __future__ import annotations

import argparse
import sys

from .corpus import CORPORA, corpus_dir, corpus_meta, describe, prepare
from .tokens import CorpusError, check_files


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = sub.add_parser("prepare", help="build a corpus (no-op when it is already there and intact)")
    p.add_argument("name", choices=sorted(CORPORA))
    p.add_argument("--out", default=None, help="output folder (default: $PATHLAB_DATA/NAME or data_cache/NAME)")
    p.add_argument("--debs", default=None, help="debian: folder holding/receiving the .deb files")
    p.add_argument("--pin", default=None, metavar="FILE",
                   help="debian: use exactly the package versions in FILE (a corpus's meta.json, a run's env.json, "
                        "or lines package=version)")
    p.add_argument("--raw", default=None, help="openwebtext: folder holding/receiving the raw shards")
    p.add_argument("--shards", type=int, default=None, help="openwebtext: use only the first N of the 21 shards")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    for action, help_text in (("info", "summarise a prepared corpus"), ("verify", "check sizes and SHA-256")):
        q = sub.add_parser(action, help=help_text)
        q.add_argument("name", help="corpus name or folder")


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "prepare":
            options = {k: v for k, v in (("debs", args.debs), ("raw", args.raw), ("n_shards", args.shards),
                                         ("pin", args.pin)) if v}
            prepare(args.name, args.out, progress=not args.no_progress, **options)
            return 0
        if args.action == "info":
            return 1 if describe(args.name) else 0
        problems = check_files(corpus_dir(args.name), corpus_meta(args.name), hashes=True)
        for p in problems:
            print(p, file=sys.stderr)
        print("ok" if not problems else f"{len(problems)} problem(s): prepare the corpus again")
        return 1 if problems else 0
    except (CorpusError, ValueError, RuntimeError) as err:
        print(f"pathlab data {args.action}: {err}", file=sys.stderr)
        return 1
