"""PaTH's short convolution with SiLU alone: the op ``pathlab::short_conv_silu`` against the PyTorch expression
under ``torch.compile`` (what the model ran before the op), forward and forward+backward, side by side.

At the ``owt16`` shape by default (x ``[64, 512, 768]`` in bf16, as the w projection gives it under autocast;
taps ``[768, 3]`` fp32): the device time of a forward and of a forward+backward in ms, summed over the kernels
they launch (``pathlab.profiling.time_by_kernel``, 20 calls; the wall time of a call this short is the host's),
and the kernels, the two routes alternating ``--rounds`` times; also each route's relative error against the
fp64 expression on y, dx and d taps.

    python benchmarks/bench_short_conv.py --out short-conv.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch


def routes():
    """{name: f(x, taps) -> y}: the op, and the PyTorch expression compiled."""
    from pathlab.ops.short_conv import conv_silu_expression, short_conv_silu

    return {"op": short_conv_silu, "compiled_expression": torch.compile(conv_silu_expression, fullgraph=True)}


def tiled(tile):
    """The op's kernels with ``KernelConfig(short_conv_tile=tile)`` (``"steps,channels,warps"``), as f(x, taps)."""
    from pathlab.kernels import KernelConfig
    from pathlab.kernels.short_conv import short_conv_silu_backward_launch, short_conv_silu_launch

    config = KernelConfig(short_conv_tile=tuple(int(v) for v in tile.split(",")))

    class Tiled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, taps):
            ctx.save_for_backward(x, taps)
            return short_conv_silu_launch(x, taps.contiguous(), config)

        @staticmethod
        def backward(ctx, dy):
            x, taps = ctx.saved_tensors
            dx, dtaps = short_conv_silu_backward_launch(x, taps.contiguous(), dy.contiguous(), config)
            return dx, dtaps.to(taps.dtype)

    return Tiled.apply


def errors(fn, x, taps, dy):
    from pathlab.ops.short_conv import conv_silu_expression
    from pathlab.testing import rel_err

    x64, t64 = (t.detach().double().requires_grad_() for t in (x, taps))
    y64 = conv_silu_expression(x64, t64)
    want = [y64, *torch.autograd.grad(y64, (x64, t64), dy.double())]
    y = fn(x, taps)
    got = [y, *torch.autograd.grad(y, (x, taps), dy)]
    return {name: rel_err(a, b) for name, a, b in zip(("y", "dx", "dtaps"), got, want)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="64,512,768,3", help="B,T,C,K")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tiles", default="", help="also time the op's kernels with these tiles, "
                   "'steps,channels,warps;…' (KernelConfig.short_conv_tile)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from pathlab.profiling import time_by_kernel

    B, T, C, K = (int(s) for s in args.shape.split(","))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, T, C, device="cuda", generator=gen).to(dtype).requires_grad_()
    taps = (torch.randn(C, K, device="cuda", generator=gen) * K**-0.5).requires_grad_()
    dy = torch.randn(B, T, C, device="cuda", generator=gen).to(dtype)
    fns = routes()
    for tile in filter(None, args.tiles.split(";")):
        fns[f"op@{tile}"] = tiled(tile)
    result = {"command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "shape": [B, T, C, K],
              "dtype": args.dtype, "errors": {}, "rounds": []}
    for name, fn in fns.items():
        result["errors"][name] = errors(fn, x, taps, dy)
    for _ in range(args.rounds):
        row = {}
        for name, fn in fns.items():
            fwd = time_by_kernel(lambda: fn(x, taps), 20, "cuda", top=20)
            fwd_bwd = time_by_kernel(lambda: torch.autograd.grad(fn(x, taps), (x, taps), dy), 20, "cuda", top=20)
            row[name] = {"fwd_ms": fwd["ms_per_call"], "fwd_bwd_ms": fwd_bwd["ms_per_call"],
                         "fwd_bwd_kernels": fwd_bwd["kernels"]}
        result["rounds"].append(row)
        print(json.dumps({name: {k: round(v, 4) for k, v in r.items() if k.endswith("_ms")} for name, r in row.items()}))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
