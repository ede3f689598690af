"""How evenly the scan backward's persistent programs share the chunk pairs, dealt in one direction or in a snake.

    python benchmarks/schedule_balance.py --out benchmarks/results/schedule-balance.json

No GPU: the items (one per query chunk and query head, longest first, as ``_layout`` orders them) are dealt to
the programs as ``scan_backward_by_chunk._path_bwd_kernel`` deals them (``deal`` below mirrors its loop), and an item with
chunk index c counts c + 1 pairs (c key chunks and the diagonal block). Reported per case: the most loaded
program's pairs over the mean, for each way of dealing.
"""

from __future__ import annotations

import argparse
import json
import sys

# (label, sequences B, chunks per sequence, query heads in one launch, programs)
CASES = [
    ("16384x16x128, one kv head per launch (head groups)", 2, 256, 1, 132),
    ("16384x16x128, all heads", 2, 256, 16, 132),
    ("16384x12x64", 2, 256, 12, 264),
    ("4096x12x64", 8, 64, 12, 264),
    ("owt16: 512 tokens, B = 64, 12 heads", 64, 8, 12, 264),
]


def deal(n_items: int, programs: int, snake: bool) -> list[list[int]]:
    """The item slots each program takes: round by round, program p the p-th of the round, or, in a snake, the
    p-th from the end of odd rounds (of a last, partial round, among the programs it reaches)."""
    full_rounds = n_items // programs
    taken = [[] for _ in range(programs)]
    for pid in range(programs):
        for item in range(pid, n_items, programs):
            rnd = item // programs
            width = programs if rnd < full_rounds else n_items - full_rounds * programs
            taken[pid].append(rnd * programs + width - 1 - pid if snake and rnd % 2 == 1 else item)
    return taken


def most_loaded_over_mean(B: int, chunks: int, heads: int, programs: int, snake: bool) -> float:
    sizes = sorted((c + 1 for c in range(chunks) for _ in range(B * heads)), reverse=True)  # longest first
    loads = [sum(sizes[s] for s in slots) for slots in deal(len(sizes), programs, snake)]
    return max(loads) / (sum(loads) / programs)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    for label, B, chunks, heads, programs in CASES:
        row = dict(case=label, items=B * chunks * heads, programs=programs,
                   one_direction=round(most_loaded_over_mean(B, chunks, heads, programs, False), 4),
                   snake=round(most_loaded_over_mean(B, chunks, heads, programs, True), 4))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        from pathlab.results import write_benchmark_result

        write_benchmark_result(args.out, "benchmarks/schedule_balance.py", sys.argv[1:] if argv is None else argv,
                               rows=rows)


if __name__ == "__main__":
    main()
