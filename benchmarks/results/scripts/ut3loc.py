# Ran at commit 0fd04c6 as `python3 ut3loc.py` from the repository root; writes ut3loc.json into $OUT (committed as
# ut-inverse-grads-steps-h200-0fd04c6.json). Its later form is benchmarks/ut_inverse_grads_steps.py.
"""Localise the NaN of _inverse_and_norm_gradients at 4 warps, D <= 32: its steps in a standalone kernel."""
import json, os, sys
import torch, triton, triton.language as tl
sys.path.insert(0, os.getcwd())
from pathlab.kernels._triton_ut import _operand, _dot, _mm

@triton.jit
def _steps(A, DAD, W, DW, B, NORM, OUT, DB, BT: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
           STAGE: tl.constexpr):
    rows = tl.arange(0, BT)
    dcol = tl.arange(0, D)
    sq = rows[:, None] * BT + rows[None, :]
    ch = rows[:, None] * D + dcol[None, :]
    a = tl.load(A + sq); dad = tl.load(DAD + sq); w = tl.load(W + ch); dw = tl.load(DW + ch)
    b = tl.load(B + rows); norm = tl.load(NORM + rows)
    strict = rows[:, None] > rows[None, :]
    da = dad * b[None, :]
    db = tl.sum(a * dad, axis=0)
    at_h, at_s = _operand(tl.trans(a), HALF)
    dn = -_dot(*_operand(_dot(at_h, at_s, *_operand(da, HALF), HALF), HALF), at_h, at_s, HALF)
    dn = tl.where(strict, dn, 0.0)
    db += tl.sum(dn * _mm(w, tl.trans(w), HALF, A_UNIT=True, B_UNIT=True), axis=1)
    dgram = dn * b[:, None]
    if STAGE == 0:
        out = dw
    elif STAGE == 1:
        out = _mm(dgram + tl.trans(dgram), w, HALF, B_UNIT=True)
    elif STAGE == 2:
        out = dw + _mm(dgram + tl.trans(dgram), w, HALF, B_UNIT=True)
    elif STAGE == 3:  # the product without the transposed term
        out = _mm(dgram, w, HALF, B_UNIT=True)
    else:
        dw += _mm(dgram + tl.trans(dgram), w, HALF, B_UNIT=True)
        radial = tl.where(norm > 1e-12, tl.sum(dw * w, axis=1), 0.0)
        out = (dw - radial[:, None] * w) / tl.maximum(norm, 1e-12)[:, None]
    tl.store(OUT + ch, out)
    tl.store(DB + rows, db)

def torch_steps(a, dad, w, dw, b, norm, stage):
    a, dad, w, dw, b, norm = (x.double() for x in (a, dad, w, dw, b, norm))
    strict = torch.tril(torch.ones_like(a), -1).bool()
    da = dad * b[None, :]
    db = (a * dad).sum(0)
    dn = torch.where(strict, -(a.T @ da @ a.T), 0.0)
    db = db + (dn * (w @ w.T)).sum(1)
    dg = dn * b[:, None]
    if stage == 0: return dw, db
    if stage == 1: return (dg + dg.T) @ w, db
    if stage == 2: return dw + (dg + dg.T) @ w, db
    if stage == 3: return dg @ w, db
    dw = dw + (dg + dg.T) @ w
    radial = (dw * w).sum(1)
    return (dw - radial[:, None] * w) / norm[:, None], db

torch.manual_seed(0)
res = []
BT = 64
for D in (16, 32, 64):
    n = torch.tril(torch.randn(BT, BT, device="cuda") * 0.1, -1)
    a = torch.linalg.inv(torch.eye(BT, device="cuda") + n).contiguous()
    dad = torch.randn(BT, BT, device="cuda"); wr = torch.randn(BT, D, device="cuda")
    norm = wr.norm(dim=1); w = (wr / norm[:, None]).contiguous()
    dw = torch.randn(BT, D, device="cuda"); b = 2 * torch.rand(BT, device="cuda")
    for warps in (4, 8):
        for half in (True,):
            for stage in range(5):
                out = torch.full((BT, D), float("nan"), device="cuda"); db = torch.full((BT,), float("nan"), device="cuda")
                _steps[(1,)](a, dad, w, dw, b, norm, out, db, BT=BT, D=D, HALF=half, STAGE=stage, num_warps=warps)
                want, wdb = torch_steps(a, dad, w, dw, b, norm, stage)
                err = float((torch.nan_to_num(out.double()) - want).norm() / want.norm())
                dberr = float((torch.nan_to_num(db.double()) - wdb).norm() / wdb.norm())
                r = dict(D=D, warps=warps, half=half, stage=stage, nan=int((~torch.isfinite(out)).sum()), err=err,
                         db_nan=int((~torch.isfinite(db)).sum()), db_err=dberr)
                res.append(r); print(r, flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "ut3loc.json"), "w"), indent=1)
