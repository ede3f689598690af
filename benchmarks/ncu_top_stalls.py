"""The instructions where a kernel's warps stall most, from Nsight Compute's source page as CSV.

    ncu --section SourceCounters --section WarpStateStats -k regex:_path_bwd_kernel -c 1 -o bwd \\
        python benchmarks/one_step.py 4096x12x64 path
    ncu -i bwd.ncu-rep --page source --csv --print-source sass > bwd-sass.csv
    python benchmarks/ncu_top_stalls.py bwd-sass.csv --top 25

Each line: the instruction's share of all stall samples, its main stall reasons, the SASS instruction and the one
before it (a wait instruction names what it waits for only through its neighbour, e.g. a TMA barrier's TRYWAIT).
"""

from __future__ import annotations

import argparse
import csv


def top_stalls(path, top=25):
    rows = list(csv.reader(open(path, newline="")))
    start = next(i for i, r in enumerate(rows) if "Address" in r and "Source" in r)
    header, data = rows[start], rows[start + 1:]
    samples = header.index("Warp Stall Sampling (All Samples)")
    reasons = [i for i, h in enumerate(header) if h.startswith("stall_") and "Not Issued" not in h]

    def count(row, i):
        return int(row[i]) if row[i].isdigit() else 0

    total = sum(count(r, samples) for r in data) or 1
    order = sorted(range(len(data)), key=lambda i: -count(data[i], samples))[:top]
    lines = [f"{len(data)} instructions, {total} stall samples"]
    for i in order:
        row = data[i]
        main = sorted(((count(row, j), header[j][6:]) for j in reasons), reverse=True)[:2]
        why = ", ".join(f"{name} {n / max(count(row, samples), 1):.0%}" for n, name in main if n)
        before = data[i - 1][1].strip() if i else ""
        lines.append(f"{count(row, samples) / total:6.1%}  [{why}]  {row[1].strip()}   (after: {before})")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    print("\n".join(top_stalls(args.csv, args.top)))


if __name__ == "__main__":
    main()
