"""Errors of the Triton PaTH op at large |q|·|k|, against the fp64 reference, split into what each gradient is.

q and k are scaled by ``--norms`` (PaTH-FoX, grouped heads, β ∈ [1.5, 2], the shapes of
``tests/test_kernels_gpu.py::test_bf16_large_query_and_key_norms``), rounded to ``--dtype``, and the op's output
and every gradient are compared with the fp64 reference on the same rounded inputs, for several input draws
(``--seeds``). Per tensor a row records the RMS of the op's value, of the true (fp64) value, of the true value at
norm 1 (the scale that test divides by) and of the error, and the share of the squared error held by its worst
row. That separates the op's error from the size of the true gradient: a saturated row (o_i = v_j*) has gradients
~0, but a row whose two largest logits differ by less than a few tens of nats does not saturate, and one whose gap
is near the logits' rounding (|q|·|k|/√D times the carried states' 2⁻¹¹ for 16-bit inputs) gets softmax weights,
and so gradients, of the wrong size. How many rows lie near such a gap, and how each route's rounding falls on
them, depends on the draw: at ×200 one row can hold all of a gradient's error, so routes are compared over several
draws.

``--factors`` measures one step earlier, where the UT routes differ: the factors q̃, k̃, M and the intra-chunk
logits S_d (reported over √D, in nats) of the fused Triton UT transform as it runs (``triton``: chunks of large
|q|·|k| take fp32-level products), of the same with 16-bit products everywhere (``triton_16bit``,
``KernelConfig(ut_split_logits=False)``) and of the PyTorch one (fp32 products), each against the fp64 transform of
the same rounded inputs.

    python benchmarks/large_norm_errors.py --dtype bf16 --out large-norm-errors-h200.json            # on a GPU
    TRITON_INTERPRET=1 python benchmarks/large_norm_errors.py --dtype fp16,fp32 --device cpu --out e.json
    TRITON_INTERPRET=1 python benchmarks/large_norm_errors.py --factors --dtype fp16 --norms 1,50,200 --device cpu
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from pathlab.kernels import KernelConfig, path_attention_triton
from pathlab.kernels.layout import build_layout, to_chunks
from pathlab.kernels.ut_backward import ut_factors_triton
from pathlab.kernels.ut_torch import ut_factors
from pathlab.reference import path_attention as reference
from pathlab.testing import grads_of, random_path_inputs

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NAMES = ("o", "dq", "dk", "dv", "dw", "dbeta", "dg")


def rms(t: torch.Tensor) -> float:
    return float(t.double().pow(2).mean().sqrt())


def worst_row_share(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest fraction of the squared error that one row holds: rows are (b, t, head) for ``[B, T, heads, D]``
    tensors, single elements for β and g. Near 1 when one near-tie row carries the error."""
    err = (got.double() - want).pow(2)
    err = err.sum(-1) if err.dim() == 4 else err
    total = float(err.sum())
    return float(err.max()) / total if total > 0 else 0.0


def draw_inputs(shape, device: str, seed: int):
    """(q, k, v, w, β, g, generator) at norm 1 in fp32 (PaTH-FoX, β ∈ [1.5, 2]); the generator draws dO next."""
    B, T, H, Hkv, D = shape
    gen = torch.Generator().manual_seed(seed)
    return *random_path_inputs(B, T, H, D, Hkv=Hkv, device=device, beta_range=(1.5, 2.0), gate=True,
                               generator=gen), gen


def measure(dtype, norm: float, ut: str, device: str, seed: int = 0, shape=(2, 128, 4, 2, 64)) -> dict:
    """One row: ``{tensor: {"op", "true", "unit", "error"}}`` RMS values, plus the case's settings."""
    B, T, H, Hkv, D = shape
    q, k, v, w, beta, g, gen = draw_inputs(shape, device, seed)
    do = torch.randn(B, T, H, D, generator=gen).to(device, dtype)
    unit = [q.to(dtype), k.to(dtype), v.to(dtype), w, beta, g]
    big = [(q * norm).to(dtype), (k * norm).to(dtype), v.to(dtype), w, beta, g]
    route = dict(ut="triton", config=KernelConfig(ut_split_logits=False)) if ut == "triton_16bit" else dict(ut=ut)
    got = grads_of(lambda *xs: path_attention_triton(*xs, **route), big, do)
    want = grads_of(reference, [x.double() for x in big], do.double())
    at_one = grads_of(reference, [x.double() for x in unit], do.double())
    tensors = {n: {"op": rms(a), "true": rms(b), "unit": rms(u), "error": rms(a.double() - b),
                   "worst_row_share": worst_row_share(a, b)}
               for n, a, b, u in zip(NAMES, got, want, at_one)}
    return {"dtype": str(dtype).removeprefix("torch."), "norm": norm, "ut": ut, "seed": seed, "shape": list(shape),
            "tensors": tensors}


def factor_errors(dtype, norm: float, device: str, seed: int = 0, shape=(2, 128, 4, 2, 64), chunk=64) -> dict:
    """One row: per UT factor, the RMS of its fp64 value and the RMS and largest error of each route (S_d over √D).
    The inputs are those of :func:`measure`, rounded to ``dtype``; the PyTorch route gets them in fp32."""
    B, T, H, Hkv, D = shape
    q, k, v, w, beta, g, _ = draw_inputs(shape, device, seed)
    q, k, w = (q * norm).to(dtype), (k * norm).to(dtype), w.to(dtype)
    layout = build_layout(B, T, chunk, device)

    def chunks(dt):
        return [to_chunks(x.to(dt), layout) for x in (q, k, F.normalize(w.to(dt), dim=-1), beta)]

    with torch.no_grad():
        routes = {"triton": ut_factors_triton(q, k, w, beta, layout),
                  "triton_16bit": ut_factors_triton(q, k, w, beta, layout, KernelConfig(ut_split_logits=False)),
                  "torch": ut_factors(*chunks(torch.float32))}
        want = ut_factors(*chunks(torch.float64))
    factors = {}
    for i, name in enumerate(("q_start", "k_end", "M", "S_d")):
        unit = D ** -0.5 if name == "S_d" else 1.0
        factors[name] = {"true": rms(want[i]) * unit} | {
            route: {"error": rms(got[i].double() - want[i]) * unit,
                    "max_error": float((got[i].double() - want[i]).abs().max()) * unit}
            for route, got in routes.items()}
    return {"dtype": str(dtype).removeprefix("torch."), "norm": norm, "seed": seed, "shape": list(shape),
            "chunk": chunk, "factors": factors}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bf16", help="comma-separated: bf16, fp16, fp32")
    p.add_argument("--norms", default="50,200")
    p.add_argument("--ut", default="torch,triton,triton_saved,triton_16bit",
                   help="comma-separated UT routes (triton_16bit: the fused one without fp32-level products)")
    p.add_argument("--seeds", default="0,1,2", help="input draws: whether rows saturate depends on the draw")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--factors", action="store_true", help="the UT factors of both routes instead of the op")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args()
    rows = []
    for name in args.dtype.split(","):
        for norm in (float(n) for n in args.norms.split(",")):
            for seed in (int(s) for s in args.seeds.split(",")):
                if args.factors:
                    rows.append(factor_errors(DTYPES[name], norm, args.device, seed=seed))
                    for f, t in rows[-1]["factors"].items():
                        routes = "  ".join(f"{r} error {t[r]['error']:.3g} (max {t[r]['max_error']:.3g})"
                                           for r in ("triton", "triton_16bit", "torch"))
                        print(f"{name} x{norm:g} seed {seed} {f:8s} true {t['true']:.3g}  {routes}", flush=True)
                    continue
                for ut in args.ut.split(","):
                    row = measure(DTYPES[name], norm, ut, args.device, seed=seed)
                    rows.append(row)
                    err = " ".join(f"{n} {t['error'] / max(t['unit'], t['true']):.2e}" for n, t in row["tensors"].items())
                    true = " ".join(f"{n} {t['true'] / t['unit']:.2g}" for n, t in row["tensors"].items() if n != "o")
                    worst = " ".join(f"{n} {t['worst_row_share']:.2f}" for n, t in row["tensors"].items())
                    print(f"{name} x{norm:g} seed {seed} ut={ut}: error/scale {err}\n"
                          f"    true gradient / its scale at norm 1: {true}\n"
                          f"    share of the squared error in the worst row: {worst}", flush=True)
    if args.out:
        device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (TRITON_INTERPRET=1)"
        with open(args.out, "w") as f:
            json.dump({"command": "python benchmarks/large_norm_errors.py " + " ".join(
                (f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')} {v}")
                for k, v in vars(args).items() if v not in (None, False) and k != "out"),
                "device": device, "torch": torch.__version__, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
