"""Where the memory of one PaTH forward+backward peaks: the peak inside each step of the Triton route.

    python benchmarks/memory_phases.py 16384x16x128 path --out memory-phases.json

Each step (the UT forward, the scan forward and backward, the UT backward) is wrapped so that the CUDA peak is
reset on entry and read on exit. Reported in MiB above the memory held before the forward (the inputs): at entry,
the peak inside, at exit. The whole forward+backward is measured as ``bench_kernels`` does (same inputs, the
output gradient drawn after the forward), so the largest step peak is that benchmark's ``peak_mib``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_kernels import _leaves, build_method, make_inputs, method_env, parse_method  # noqa: E402

MIB = 2**20


def _phase_wrapper(name, fn, base, rows):
    def wrapped(*args, **kwargs):
        torch.cuda.synchronize()
        entry = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        rows.append(dict(step=name, entry_mib=(entry - base) / MIB,
                         peak_mib=(torch.cuda.max_memory_allocated() - base) / MIB,
                         exit_mib=(torch.cuda.memory_allocated() - base) / MIB))
        return out

    return wrapped


@contextlib.contextmanager
def phases_recorded(base, rows):
    """Wrap the steps of the Triton route (module attributes, restored on exit)."""
    from pathlab.kernels import _recompute, path

    patches = [(_recompute, "ut_forward"), (_recompute, "ut_backward"), (path, "_scan_fwd_impl"),
               (path, "_scan_bwd_impl"), (path, "_ut_factors_torch")]
    saved = [(mod, name, getattr(mod, name)) for mod, name in patches]
    try:
        for mod, name, fn in saved:
            setattr(mod, name, _phase_wrapper(name.strip("_"), fn, base, rows))
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def measure(case, method, tokens):
    T, H, D = (int(x) for x in case.split("x"))
    name, env = parse_method(method)
    inputs = [x.requires_grad_() for x in make_inputs(max(1, tokens // T), T, H, D, device="cuda")]
    rows = []
    with method_env(env):
        fn = build_method(name, *inputs)
        leaves = _leaves(fn, name, *inputs)  # the inputs the method differentiates, as bench_kernels takes them
        fn()  # compile and warm up outside the measurement
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with phases_recorded(base, rows):
            o = fn()
            grads = torch.autograd.grad(o, leaves, torch.randn_like(o))
        torch.cuda.synchronize()
        del grads, o
    return dict(case=case, method=method, steps=rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", help="TxHxD")
    ap.add_argument("methods", help="comma list of bench_kernels methods (path, path_ut_torch, ...)")
    ap.add_argument("--tokens", type=int, default=32768, help="B·T")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    results = []
    for method in args.methods.split(","):
        result = measure(args.case, method, args.tokens)
        results.append(result)
        for row in result["steps"]:
            print(f"{method:24s} {row['step']:16s} entry {row['entry_mib']:8.0f}  peak {row['peak_mib']:8.0f}  "
                  f"exit {row['exit_mib']:8.0f} MiB", flush=True)
    if args.out:
        from pathlab.atomic import atomic_write_text

        given = sys.argv[1:] if argv is None else argv
        atomic_write_text(args.out, json.dumps(dict(command="python benchmarks/memory_phases.py " + " ".join(given),
                                                    results=results), indent=1))


if __name__ == "__main__":
    main()
