"""Errors of the Triton PaTH op at large |q|·|k|, against the fp64 reference, split into what each gradient is.

q and k are scaled by ``--norms`` (PaTH-FoX, grouped heads, β ∈ [1.5, 2], the shapes of
``tests/test_kernels_gpu.py::test_bf16_large_query_and_key_norms``), rounded to ``--dtype``, and the op's output
and every gradient are compared with the fp64 reference on the same rounded inputs, for several input draws
(``--seeds``). Per tensor a row records the RMS of the op's value, of the true (fp64) value, of the true value at
norm 1 (the scale that test divides by) and of the error. That separates the op's error from the size of the true
gradient: a saturated row (o_i = v_j*) has gradients ~0, but a row whose two largest logits differ by less than a
few tens of nats does not saturate, and one whose gap is near the logits' rounding (|q|·|k|/√D times the carried
states' 2⁻¹¹ for 16-bit inputs) gets softmax weights, and so gradients, of the wrong size. How many rows lie near
such a gap depends on the draw.

    python benchmarks/large_norm_errors.py --dtype bf16 --out large-norm-errors-h200.json            # on a GPU
    TRITON_INTERPRET=1 python benchmarks/large_norm_errors.py --dtype fp16,fp32 --device cpu --out e.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pathlab.kernels import path_attention_triton
from pathlab.reference import path_attention as reference
from pathlab.testing import grads_of, random_path_inputs

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NAMES = ("o", "dq", "dk", "dv", "dw", "dbeta", "dg")


def rms(t: torch.Tensor) -> float:
    return float(t.double().pow(2).mean().sqrt())


def measure(dtype, norm: float, ut: str, device: str, seed: int = 0, shape=(2, 128, 4, 2, 64)) -> dict:
    """One row: ``{tensor: {"op", "true", "unit", "error"}}`` RMS values, plus the case's settings."""
    B, T, H, Hkv, D = shape
    gen = torch.Generator().manual_seed(seed)
    q, k, v, w, beta, g = random_path_inputs(B, T, H, D, Hkv=Hkv, device=device, beta_range=(1.5, 2.0), gate=True,
                                             generator=gen)
    do = torch.randn(B, T, H, D, generator=gen).to(device, dtype)
    unit = [q.to(dtype), k.to(dtype), v.to(dtype), w, beta, g]
    big = [(q * norm).to(dtype), (k * norm).to(dtype), v.to(dtype), w, beta, g]
    got = grads_of(lambda *xs: path_attention_triton(*xs, ut=ut), big, do)
    want = grads_of(reference, [x.double() for x in big], do.double())
    at_one = grads_of(reference, [x.double() for x in unit], do.double())
    tensors = {n: {"op": rms(a), "true": rms(b), "unit": rms(u), "error": rms(a.double() - b)}
               for n, a, b, u in zip(NAMES, got, want, at_one)}
    return {"dtype": str(dtype).removeprefix("torch."), "norm": norm, "ut": ut, "seed": seed, "shape": list(shape),
            "tensors": tensors}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bf16", help="comma-separated: bf16, fp16, fp32")
    p.add_argument("--norms", default="50,200")
    p.add_argument("--ut", default="torch,triton,triton_saved", help="comma-separated UT routes")
    p.add_argument("--seeds", default="0,1,2", help="input draws: whether rows saturate depends on the draw")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args()
    rows = []
    for name in args.dtype.split(","):
        for norm in (float(n) for n in args.norms.split(",")):
            for seed in (int(s) for s in args.seeds.split(",")):
                for ut in args.ut.split(","):
                    row = measure(DTYPES[name], norm, ut, args.device, seed=seed)
                    rows.append(row)
                    err = " ".join(f"{n} {t['error'] / max(t['unit'], t['true']):.2e}" for n, t in row["tensors"].items())
                    true = " ".join(f"{n} {t['true'] / t['unit']:.2g}" for n, t in row["tensors"].items() if n != "o")
                    print(f"{name} x{norm:g} seed {seed} ut={ut}: error/scale {err}\n"
                          f"    true gradient / its scale at norm 1: {true}", flush=True)
    if args.out:
        device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (TRITON_INTERPRET=1)"
        with open(args.out, "w") as f:
            json.dump({"command": "python benchmarks/large_norm_errors.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "out"),
                "device": device, "torch": torch.__version__, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
