"""A few forward+backward passes of one attention method at one shape, for a profiler to attach to.

    ncu --clock-control none -k regex:_path_bwd_kernel -c 1 python benchmarks/one_step.py 4096x12x64 path

The inputs are those of ``bench_kernels`` (bf16, B·T = ``--tokens``); methods take the ``name@VAR=value``
settings of ``bench_kernels`` too.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_kernels import build_method, make_inputs, method_config, parse_method  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", help="TxHxD")
    ap.add_argument("method", help="a bench_kernels method, e.g. path or path@bwd_launch=8,1,1")
    ap.add_argument("--tokens", type=int, default=32768, help="B·T")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args(argv)
    T, H, D = (int(x) for x in args.case.split("x"))
    name, settings = parse_method(args.method)
    leaves = [x.requires_grad_() for x in make_inputs(max(1, args.tokens // T), T, H, D, device="cuda")]
    fn = build_method(name, *leaves, config=method_config(settings))
    if fn is None:
        raise SystemExit(f"method {args.method!r} is not available here")
    for _ in range(args.steps):
        fn().float().square().mean().backward()
    torch.cuda.synchronize()
    print(f"{args.method} {args.case}: {args.steps} steps done")


if __name__ == "__main__":
    main()
