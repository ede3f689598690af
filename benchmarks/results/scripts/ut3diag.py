# Ran at commit c6da3b2 (its UT3_* settings of the UT backward exist only there; PATHLAB_UT3_* at 0fd04c6) as `python3 ut3diag.py`
# from the repository root; writes ut3diag.json into $OUT (committed as ut-three-kernel-variants-h200-c6da3b2.json).
"""Which three-kernel UT backward variant gives NaN dw on the GPU, and where it first appears."""
import json, os, sys
import torch
sys.path.insert(0, os.getcwd())
from pathlab.kernels import _triton_ut
from pathlab.kernels._layout import build_layout, to_chunks
from pathlab.kernels._triton_ut import ut_factors_triton
from pathlab.kernels._ut import ut_factors

NAMES = ["q~", "k~", "M", "S_d", "dq", "dk", "dw", "dbeta"]
def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-12))

def run(D, dtype, seed=0, B=1, T=300, H=4, Hkv=2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g); k = torch.randn(B, T, Hkv, D, generator=g)
    w = torch.randn(B, T, Hkv, D, generator=g); beta = 2 * torch.rand(B, T, Hkv, generator=g)
    dev = "cuda"
    q, k = q.to(dev, dtype), k.to(dev, dtype); w, beta = w.to(dev), beta.to(dev)
    leaves = [x.detach().requires_grad_() for x in (q, k, w, beta)]
    layout = build_layout(B, T, 64, dev)
    f32 = torch.float32
    want = ut_factors(*(to_chunks(x, layout) for x in (leaves[0].to(f32), leaves[1].to(f32),
                      torch.nn.functional.normalize(leaves[2].to(f32), dim=-1), leaves[3].to(f32))))
    got = ut_factors_triton(*leaves, layout)
    up = [torch.randn(t.shape, generator=g).to(dev) for t in want]
    wg = torch.autograd.grad(want, leaves, up, retain_graph=True)
    gg = torch.autograd.grad(got, leaves, up)
    out = {}
    for n, a, b in zip(NAMES, list(got) + list(gg), list(want) + list(wg)):
        out[n] = dict(nan=int((~torch.isfinite(a)).sum()), err=rel(torch.nan_to_num(a), b))
    dbg = {k: dict(nan=int((~torch.isfinite(v)).sum()), numel=v.numel()) for k, v in _triton_ut.DEBUG.items()}
    return out, dbg

variants = [("alias", "alias", ""), ("own", "alias", ""), ("alias", "own", ""), ("own", "own", ""),
            ("alias", "alias", "8"), ("alias", "alias", "2")]
results = []
os.environ["UT3_DEBUG"] = "1"
for dad, dw, iw in variants:
    os.environ["UT3_DAD"], os.environ["UT3_DW"], os.environ["UT3_INV_WARPS"] = dad, dw, iw
    for D in (16, 32, 64):
        for dtype in (torch.bfloat16, torch.float16):
            try:
                out, dbg = run(D, dtype)
                r = dict(dad=dad, dw=dw, inv_warps=iw, D=D, dtype=str(dtype), out=out, debug=dbg)
            except Exception as e:
                r = dict(dad=dad, dw=dw, inv_warps=iw, D=D, dtype=str(dtype), error=repr(e)[:500])
            results.append(r)
            bad = {n: v for n, v in r.get("out", {}).items() if v["nan"]}
            print(dad, dw, iw, D, dtype, "NaN outputs:", bad, "debug:", r.get("debug"), r.get("error", ""), flush=True)
os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
json.dump(results, open(os.path.join(os.environ.get("OUT", "."), "ut3diag.json"), "w"), indent=1)
