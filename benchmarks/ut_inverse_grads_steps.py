"""The last step of the UT backward's dw, (dG + dGᵀ) W, in a standalone kernel, against fp64 PyTorch.

    python benchmarks/ut_inverse_grads_steps.py --out ut-inverse-grads-steps.json

``_inverse_and_norm_gradients`` (``kernels/ut_backward.py``) forms dN = strictLower(−Aᵀ dA Aᵀ), dG = D_β dN and
adds (dG + dGᵀ) W to dw. Built by Triton 3.6 for an H200 with 4 warps at head dims 16 and 32, that kernel gave
NaN in dw while its inputs (d(A D_β), dw so far) were finite. This script runs the same steps on one random
chunk, on fp16 operands (``HALF``) or tf32, at 2, 4 and 8 warps, with the product formed three ways:

    sum          (dG + dGᵀ) W, the sum as one operand (the kernel's form)
    lower        dG W alone
    two          dG W + dGᵀ W, two products on one operand

and records, for each, the non-finite elements of the result and its relative error (dβ, which takes the same
dN, alongside). Run it on a GPU; under ``TRITON_INTERPRET=1`` it runs on the CPU, where every form is right.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

from pathlab.kernels.ut_common import _dot, _mm, _operand

FORMS = {"sum": 0, "lower": 1, "two": 2}


@triton.jit
def _steps(A, DAD, W, B, OUT, DB, BT: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, FORM: tl.constexpr):
    """OUT [BT, D] = the chosen form of (dG + dGᵀ) W and DB [BT] = dβ, from A, d(A D_β) [BT, BT], W [BT, D], β."""
    rows = tl.arange(0, BT)
    square = rows[:, None] * BT + rows[None, :]
    chunk = rows[:, None] * D + tl.arange(0, D)[None, :]
    a, dad, w, b = tl.load(A + square), tl.load(DAD + square), tl.load(W + chunk), tl.load(B + rows)
    db = tl.sum(a * dad, axis=0)
    at_h, at_s = _operand(tl.trans(a), HALF)
    dn = -_dot(*_operand(_dot(at_h, at_s, *_operand(dad * b[None, :], HALF), HALF), HALF), at_h, at_s, HALF)
    dn = tl.where(rows[:, None] > rows[None, :], dn, 0.0)
    db += tl.sum(dn * _mm(w, tl.trans(w), HALF, A_UNIT=True, B_UNIT=True), axis=1)
    dgram = dn * b[:, None]
    if FORM == 0:
        out = _mm(dgram + tl.trans(dgram), w, HALF, B_UNIT=True)
    elif FORM == 1:
        out = _mm(dgram, w, HALF, B_UNIT=True)
    else:
        dg_h, dg_s = _operand(dgram, HALF)
        w_h, w_s = _operand(w, HALF, True)
        out = _dot(dg_h, dg_s, w_h, w_s, HALF) + _dot(tl.trans(dg_h), dg_s, w_h, w_s, HALF)
    tl.store(OUT + chunk, out)
    tl.store(DB + rows, db)


def reference(a, dad, w, b, form):
    """fp64 (result, dβ) of ``_steps``."""
    a, dad, w, b = (x.double() for x in (a, dad, w, b))
    dn = torch.tril(-(a.T @ (dad * b[None, :]) @ a.T), -1)
    db = (a * dad).sum(0) + (dn * (w @ w.T)).sum(1)
    dgram = dn * b[:, None]
    return (dgram @ w if form == "lower" else (dgram + dgram.T) @ w), db


def rel_err(got, want):
    return float((torch.nan_to_num(got.double()) - want).norm() / want.norm())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="16,32,64")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    gen = torch.Generator().manual_seed(0)
    BT, rows = 64, []
    for D in (int(x) for x in args.dims.split(",")):
        n = torch.tril(torch.randn(BT, BT, generator=gen) * 0.1, -1)
        a = torch.linalg.inv(torch.eye(BT) + n)
        dad = torch.randn(BT, BT, generator=gen)
        w = torch.nn.functional.normalize(torch.randn(BT, D, generator=gen), dim=-1)
        b = 2 * torch.rand(BT, generator=gen)
        a, dad, w, b = (x.to(device).contiguous() for x in (a, dad, w, b))
        for warps in (int(x) for x in args.warps.split(",")):
            for half in (True, False):
                for form, code in FORMS.items():
                    out = torch.full((BT, D), float("nan"), device=device)
                    db = torch.full((BT,), float("nan"), device=device)
                    _steps[(1,)](a, dad, w, b, out, db, BT=BT, D=D, HALF=half, FORM=code, num_warps=warps)
                    want, want_db = reference(a, dad, w, b, form)
                    row = dict(D=D, warps=warps, half=half, form=form, nonfinite=int((~torch.isfinite(out)).sum()),
                               err=rel_err(out, want), db_nonfinite=int((~torch.isfinite(db)).sum()),
                               db_err=rel_err(db, want_db))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if args.out:
        given = sys.argv[1:] if argv is None else argv
        result = dict(command="python3 benchmarks/ut_inverse_grads_steps.py " + " ".join(given),
                      device=torch.cuda.get_device_name() if device == "cuda" else "cpu (TRITON_INTERPRET=1)",
                      triton=triton.__version__, torch=torch.__version__, rows=rows)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
