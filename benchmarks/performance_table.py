"""The table of current numbers in ``docs/performance.md``, generated from the result files it cites.

Each row names its file in ``benchmarks/results/`` and how the number is read from it; a row whose file or entry
is missing says so instead of a number. Rerun after a new measurement, with the new file named in ``ROWS``:

    python benchmarks/performance_table.py            # prints the markdown table
    python benchmarks/performance_table.py --write    # replaces the table in docs/performance.md
"""

from __future__ import annotations

import argparse
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "performance.md"
BEGIN, END = "<!-- table: benchmarks/performance_table.py -->", "<!-- end of table -->"

# the default route's method in each file: "path" unless the default then needed a setting (PaTH-FoX's backward by
# sequence became the default after the run that measured it as a side-by-side variant)
FOX_BY_SEQUENCE = "path_fox@PATHLAB_PATH_BWD_BY_SEQUENCE=1"


def _load(name):
    with open(RESULTS / name) as f:
        return json.load(f)


def _case(name, method, T, H, D):
    for c in _load(name).get("cases", []):
        if (c["method"], c["T"], c["H"], c["D"]) == (method, T, H, D) and c.get("fwd_bwd_ms") is not None:
            return c
    raise KeyError(f"{method} {T}x{H}x{D}")


def fwd_bwd(name, T, H, D, method="path"):
    """fwd / fwd+bwd ms (do_bench medians), peak MiB and fwd+bwd ÷ SDPA's in the same file."""
    c, sdpa = _case(name, method, T, H, D), _case(name, "sdpa", T, H, D)
    ratio = c["fwd_bwd_ms"] / sdpa["fwd_bwd_ms"]
    return (f"{c['fwd_ms']:.2f} / {c['fwd_bwd_ms']:.2f} ms, {c['peak_mib']:.0f} MiB; "
            f"{ratio:.1f}× SDPA's {sdpa['fwd_bwd_ms']:.2f} ms")


def profile(name, method):
    """Device time of one forward+backward (the sum over its kernels), ms."""
    for p in _load(name).get("profile", []):
        if p["method"] == method:
            return f"{p['ms_per_call']:.2f} ms (scan {p['scan_ms']:.2f}, UT {p['ut_ms']:.2f}, rest {p['other_ms']:.2f})"
    raise KeyError(method)


def decode(name, cache_len):
    for r in _load(name).get("decode", []):
        if r.get("cache_len") == cache_len and "path_step_graph_ms" in r:
            return (f"{r['path_step_graph_ms']:.3f} ms graphed against plain decoding's {r['plain_step_graph_ms']:.3f} "
                    f"({r['ratio_graph']:.2f}×); eager {r['path_step_ms']:.3f} against {r['plain_step_ms']:.3f}")
    raise KeyError(cache_len)


def throughput(name, variant, rope=None):
    t = _load(name)["throughput"][variant]["tokens_per_s"]
    text = f"{t / 1e3:.0f}K tokens/s"
    if rope:
        text += f" ({t / _load(rope)['throughput']['rope']['tokens_per_s']:.3f}× RoPE)"
    return text


def saved(name, method, H, D):
    for r in _load(name)["rows"]:
        if (r["method"], r["H"], r["D"]) == (method, H, D):
            return f"{r['times_one_q']:.2f}× one 16-bit q"
    raise KeyError(method)


ROPE = "throughput-h200-rope-scratch16.json"
ROWS = [
    # (measure, shape, how, file)
    ("PaTH op, device time of fwd+bwd", "one `owt16` layer: T = 512, B = 64, 12×64, bf16 w",
     lambda f: profile(f, "path"), "kernels-h200-keys-as-rows-ee8d08e.json"),
    ("PaTH-FoX op, device time of fwd+bwd", "one `owt16` layer", lambda f: profile(f, FOX_BY_SEQUENCE),
     "kernels-h200-keys-as-rows-ee8d08e.json"),
    ("PaTH fwd / fwd+bwd", "T = 512, 12×64, B·T = 32768, bf16 w", lambda f: fwd_bwd(f, 512, 12, 64),
     "kernels-h200-gate-dots-1-7c2d90b.json"),
    ("PaTH fwd / fwd+bwd", "T = 4096, 12×64, bf16 w", lambda f: fwd_bwd(f, 4096, 12, 64),
     "kernels-h200-fwd-states-0bde922.json"),
    ("PaTH-FoX fwd / fwd+bwd", "T = 4096, 12×64, bf16 w", lambda f: fwd_bwd(f, 4096, 12, 64, "path_fox"),
     "kernels-h200-fwd-states-0bde922.json"),
    ("PaTH fwd / fwd+bwd", "T = 16384, 12×64, fp32 w", lambda f: fwd_bwd(f, 16384, 12, 64),
     "kernels-h200-inverse-w-fp32-b693891.json"),
    ("PaTH-FoX fwd / fwd+bwd", "T = 16384, 12×64, fp32 w", lambda f: fwd_bwd(f, 16384, 12, 64, "path_fox"),
     "kernels-h200-inverse-w-fp32-b693891.json"),
    ("PaTH fwd / fwd+bwd", "T = 16384, 16×128, fp32 w", lambda f: fwd_bwd(f, 16384, 16, 128),
     "kernels-h200-inverse-w-fp32-b693891.json"),
    ("PaTH-FoX fwd / fwd+bwd", "T = 16384, 16×128, fp32 w", lambda f: fwd_bwd(f, 16384, 16, 128, "path_fox"),
     "kernels-h200-inverse-w-fp32-b693891.json"),
    ("PaTH fwd / fwd+bwd", "T = 65536, B = 1, 16×128", lambda f: fwd_bwd(f, 65536, 16, 128),
     "kernels-h200-65536-head-groups.json"),
    ("memory kept for the backward", "T = 512, 12×64, `ut=\"triton_saved\"` (CUDA default at D ≤ 64)",
     lambda f: saved(f, "path_ut_triton_saved", 12, 64), "saved-memory-cpu.json"),
    ("memory kept for the backward", "T = 512, 16×128, `ut=\"triton\"` (CUDA default at D = 128)",
     lambda f: saved(f, "path_ut_triton", 16, 128), "saved-memory-cpu.json"),
    ("decode step, deferred (R = 32), CUDA graph", "64K cached tokens, B = 1, 12×64",
     lambda f: decode(f, 65536), "kernels-h200-decode-graph-native-64k.json"),
    ("training throughput, RoPE", "`owt16`: 16 layers × 768, batch 64 × 512, one H200",
     lambda f: throughput(f, "rope"), ROPE),
    ("training throughput, PaTH", "`owt16`", lambda f: throughput(f, "path", ROPE),
     "throughput-h200-path-scratch16.json"),
    ("training throughput, PaTH-FoX", "`owt16`", lambda f: throughput(f, "path_fox", ROPE),
     "throughput-h200-path-fox-gate-products.json"),
]


def table() -> str:
    lines = ["| measure | case | value | file (`benchmarks/results/`) |", "|---|---|---|---|"]
    for measure, case, how, name in ROWS:
        try:
            value = how(name)
        except (OSError, KeyError, ValueError) as err:
            value = f"missing ({type(err).__name__}: {err})"
        lines.append(f"| {measure} | {case} | {value} | `{name}` |")
    return "\n".join(lines)


def cited_files() -> list[str]:
    return sorted({name for *_, name in ROWS})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"replace the table in {DOC.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    text = table()
    if not args.write:
        print(text)
        return
    doc = DOC.read_text()
    start, stop = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    DOC.write_text(doc[:start] + "\n" + text + "\n" + doc[stop:])


if __name__ == "__main__":
    main()
