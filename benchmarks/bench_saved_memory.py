"""Bytes that autograd keeps for the backward of one attention call, per method, as multiples of one q tensor.

The count (``pathlab.profiling.saved_for_backward``: every tensor an op saves, once per storage, inputs left out)
depends on shapes and dtypes only, so it is the same on a GPU and on a CPU, where the Triton kernels run under
the interpreter. It is the part of a forward+backward's peak memory that the forward decides; the backward adds
its gradient buffers and scratch on top. Methods: the Triton PaTH kernel with the UT transform as PyTorch ops
(``path``) or fused and recomputed in the backward (``path_ut_triton``) or fused and kept (``path_ut_triton_saved``),
the same with a forget gate, and SDPA.

    python benchmarks/bench_saved_memory.py --out benchmarks/results/saved-memory-cpu.json

fp16 stands for bf16 (the same sizes and code paths; the interpreter's bf16 products are not exact, and only
sizes are counted here).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of the kernels

from pathlab.atomic import atomic_write_text  # noqa: E402
from pathlab.profiling import saved_for_backward  # noqa: E402

METHODS = ("path", "path_ut_triton", "path_ut_triton_saved", "path_fox", "path_fox_ut_triton", "sdpa")


def inputs(B, T, H, D, device, dtype=torch.float16):
    gen = torch.Generator(device=device).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    q, k, v = (r(B, T, H, D).to(dtype).requires_grad_() for _ in range(3))
    w = torch.nn.functional.normalize(r(B, T, H, D), dim=-1).requires_grad_()
    beta = (2 * torch.rand(B, T, H, device=device, generator=gen)).requires_grad_()
    g = torch.nn.functional.logsigmoid(2.0 + r(B, T, H)).requires_grad_()
    return q, k, v, w, beta, g


def measure(method, B, T, H, D, device):
    from pathlab.kernels import path_attention_triton

    q, k, v, w, beta, g = inputs(B, T, H, D, device)
    if method == "sdpa":
        qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        fn = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)  # noqa: E731
        leaves = (qt, kt, vt)
    else:
        gate = g if "fox" in method else None
        ut = method.split("_ut_", 1)[1] if "_ut_" in method else "torch"
        fn = lambda: path_attention_triton(q, k, v, w, beta, gate, ut=ut)  # noqa: E731
        leaves = (q, k, v, w, beta, g)
    saved, out = saved_for_backward(fn, exclude=leaves)
    assert torch.isfinite(out.float()).all() or device.type == "cpu"  # values are not the point on the CPU
    one_q = q.numel() * q.element_size()
    return dict(method=method, B=B, T=T, H=H, D=D, saved_bytes=saved["bytes"], storages=saved["storages"],
                by_dtype=saved["by_dtype"], per_token_bytes=saved["bytes"] / (B * T),
                times_one_q=saved["bytes"] / one_q)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="12x64,16x128", help="comma list of HxD")
    ap.add_argument("--T", type=int, default=512, help="sequence length (the count is linear in B·T)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", default=None, help="JSON result file (written atomically)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = dict(command=" ".join([os.path.basename(sys.executable)] + sys.argv), device=str(device),
                  torch=torch.__version__, python=platform.python_version(),
                  started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), rows=[])
    for shape in args.shapes.split(","):
        H, D = (int(x) for x in shape.split("x"))
        for method in args.methods.split(","):
            if method not in METHODS:
                raise SystemExit(f"unknown method {method!r}; known: {METHODS}")
            row = measure(method, 1, args.T, H, D, device)
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
    if args.out:
        atomic_write_text(args.out, json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
