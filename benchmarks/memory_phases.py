"""Where the memory of one PaTH forward+backward peaks: the peak inside each step of the Triton route.

    python benchmarks/memory_phases.py 16384x16x128 path --out memory-phases.json
    python benchmarks/memory_phases.py 2048x4x128 path_ut_triton --tokens 2048 --out memory-phases-cpu.json

Each step (the UT forward, the scan forward and backward, the UT backward) is wrapped so that the peak is reset on
entry and read on exit. Reported in MiB above the memory held before the forward (the inputs): at entry, the peak
inside, at exit. The whole forward+backward is measured as ``bench_kernels`` does (same inputs, the output
gradient drawn after the forward), so the largest step peak is that benchmark's ``peak_mib``.

On a GPU the counters are CUDA's (``memory_allocated``, ``max_memory_allocated``). Without one the kernels run
under Triton's interpreter in fp16 and the bytes are counted op by op (``pathlab.profiling.LiveTensorBytes``,
with the kernels' custom ops opened up so that their own buffers count): the same allocations as on the GPU, less
the allocator's rounding, at a size the interpreter can run. There ``path`` takes the PyTorch UT route (what
``ut="auto"`` picks on a CPU): name the fused routes (``path_ut_triton``, the default at D = 128 on a GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import pathlib
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of the kernels

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_kernels import _leaves, build_method, make_inputs, method_config, parse_method  # noqa: E402

MIB = 2**20


class CudaMeter:
    """CUDA's own counters."""

    def allocated(self):
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    def reset_peak(self):
        torch.cuda.reset_peak_memory_stats()

    def peak(self):
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    @contextlib.contextmanager
    def counting(self):
        yield


class LiveMeter:
    """Tensor bytes alive, op by op (any device); the PaTH custom ops run op by op too."""

    def __init__(self):
        from pathlab.kernels import fused, scan, ut_backward
        from pathlab.profiling import LiveTensorBytes

        def late(mod, name):  # looked up at the call, so that the phase wrappers below are the ones run
            return lambda *args, **kwargs: getattr(mod, name)(*args, **kwargs)

        self.mode = LiveTensorBytes(collect=True, inside={
            "pathlab::path_recompute_fwd": late(fused, "_fwd_impl"),
            "pathlab::path_recompute_bwd": late(fused, "_bwd_impl"),
            "pathlab::path_saved_fwd": late(fused, "_saved_fwd_impl"),
            "pathlab::path_saved_bwd": late(fused, "_saved_bwd_impl"),
            "pathlab::path_scan_fwd": late(scan, "_scan_fwd_impl"),
            "pathlab::path_scan_bwd": late(scan, "_scan_bwd_impl"),
            "pathlab::path_ut_fwd": late(ut_backward, "_ut_fwd_impl"),
            "pathlab::path_ut_bwd": late(ut_backward, "_ut_bwd_impl"),
        })

    def allocated(self):
        gc.collect()
        return self.mode.live

    def reset_peak(self):
        self.mode.reset_peak()

    def peak(self):
        return self.mode.peak

    def counting(self):
        return self.mode


def _phase_wrapper(name, fn, base, rows, meter):
    def wrapped(*args, **kwargs):
        entry = meter.allocated()
        meter.reset_peak()
        out = fn(*args, **kwargs)
        rows.append(dict(step=name, entry_mib=(entry - base) / MIB, peak_mib=(meter.peak() - base) / MIB,
                         exit_mib=(meter.allocated() - base) / MIB))
        return out

    return wrapped


@contextlib.contextmanager
def phases_recorded(base, rows, meter=None):
    """Wrap the steps of the Triton route (module attributes, restored on exit)."""
    from pathlab.kernels import fused, path, scan

    meter = meter or CudaMeter()
    # the fused routes call the steps through ``fused``'s names, the PyTorch route's scan ops through ``scan``'s
    patches = [(fused, "ut_forward"), (fused, "ut_backward"), (fused, "_scan_fwd_impl"), (fused, "_scan_bwd_impl"),
               (scan, "_scan_fwd_impl"), (scan, "_scan_bwd_impl"), (path, "_ut_factors_torch")]
    saved = [(mod, name, getattr(mod, name)) for mod, name in patches]
    try:
        for mod, name, fn in saved:
            setattr(mod, name, _phase_wrapper(name.strip("_"), fn, base, rows, meter))
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def measure(case, method, tokens):
    T, H, D = (int(x) for x in case.split("x"))
    name, settings = parse_method(method)
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float16)
    inputs = [x.requires_grad_() for x in make_inputs(max(1, tokens // T), T, H, D, device=device, dtype=dtype)]
    rows = []
    fn = build_method(name, *inputs, config=method_config(settings))
    leaves = _leaves(fn, name, *inputs)  # the inputs the method differentiates, as bench_kernels takes them
    if cuda:
        fn()  # compile and warm up outside the measurement
    meter = CudaMeter() if cuda else LiveMeter()
    with meter.counting():
        base = meter.allocated()
        meter.reset_peak()
        with phases_recorded(base, rows, meter):
            o = fn()
            grads = torch.autograd.grad(o, leaves, torch.randn_like(o))
        del grads, o
    return dict(case=case, method=method, device=device, steps=rows)


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
        from pathlab.results import write_benchmark_result

        write_benchmark_result(args.out, "benchmarks/memory_phases.py", sys.argv[1:] if argv is None else argv,
                               results=results)


if __name__ == "__main__":
    main()
