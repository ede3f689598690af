"""The per-chunk UT transform alone: the fused Triton kernels (``ut="triton"``) against the PyTorch route.

For each size (T, H, Hkv, D; B = 1, bf16 q and k, fp32 w and β ∈ [1.5, 2], chunks of 64) it records the
first-call (compilation) time of the fused forward and backward, the relative L2 error of the four factors and
four input gradients against the PyTorch route (fp32 products, the reference), NaN flags, and the median
forward and forward+backward times of both routes; then prints the compiled kernels' registers, spills and
shared memory. A size whose kernels do not fit the GPU records the error and the run goes on.

    python benchmarks/bench_ut_transform.py --out ut-transform.json
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

from pathlab.testing import rel_err


def measure(T, H, Hkv, D, device="cuda", config=None):
    """One size; on a CPU (Triton's interpreter) the times are left out (None). ``config``: a
    :class:`pathlab.kernels.KernelConfig` for the fused kernels (None: the default)."""
    import triton.testing

    from pathlab.kernels.layout import build_layout
    from pathlab.kernels.path import _ut_factors_torch
    from pathlab.kernels.ut_backward import ut_factors_triton

    gen = torch.Generator(device=device).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    q, k, w = r(1, T, H, D).bfloat16(), r(1, T, Hkv, D).bfloat16(), r(1, T, Hkv, D)
    beta = 1.5 + 0.5 * torch.rand(1, T, Hkv, device=device, generator=gen)
    layout = build_layout(1, T, 64, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fused = [x.detach().requires_grad_() for x in (q, k, w, beta)]
    plain = [x.detach().requires_grad_() for x in (q, k, w, beta)]

    start = time.time()
    got = ut_factors_triton(*fused, layout, config)
    sync()
    first_fwd = time.time() - start
    upstream = [torch.randn_like(x) for x in got]
    start = time.time()
    got_grads = torch.autograd.grad(got, fused, upstream)
    sync()
    first_bwd = time.time() - start
    want = _ut_factors_torch(*plain, layout)
    want_grads = torch.autograd.grad(want, plain, upstream)

    errs = {f"out{i}": rel_err(a, b) for i, (a, b) in enumerate(zip(got, want))}
    errs.update({f"d{n}": rel_err(a, b) for n, a, b in zip("qkwb", got_grads, want_grads)})

    def bench(fn):
        return triton.testing.do_bench(fn, return_mode="median") if device == "cuda" else None

    return dict(
        first_fwd_s=first_fwd, first_bwd_s=first_bwd, errs=errs,
        nans=[bool(torch.isnan(x).any()) for x in list(got) + list(got_grads)],
        fused_fwd_ms=bench(lambda: ut_factors_triton(*fused, layout, config)),
        fused_fwdbwd_ms=bench(lambda: torch.autograd.grad(ut_factors_triton(*fused, layout, config), fused,
                                                                            upstream)),
        torch_fwd_ms=bench(lambda: _ut_factors_torch(*plain, layout)),
        torch_fwdbwd_ms=bench(lambda: torch.autograd.grad(_ut_factors_torch(*plain, layout), plain, upstream)),
    )


def measure_inverse(T, Hkv, D, warps, device="cuda"):
    """The inverse kernel alone, A = (I + strictLower(D_β W Wᵀ))⁻¹ for every (kv head, chunk) of B = 1, T tokens
    (β ∈ [1.5, 2]): its relative error against an fp64 inverse and its median time for each ``num_warps`` in
    ``warps``, beside ``torch.linalg.solve_triangular`` (cuBLAS trsm, the PyTorch route's solve) on the same
    matrices. Times are None on a CPU."""
    import triton.testing

    from pathlab.kernels import ut_common as _triton_ut
    from pathlab.kernels.layout import build_layout, slot_tokens, to_chunks

    gen = torch.Generator(device=device).manual_seed(1)
    w = torch.nn.functional.normalize(torch.randn(1, T, Hkv, D, device=device, generator=gen), dim=-1)
    beta = 1.5 + 0.5 * torch.rand(1, T, Hkv, device=device, generator=gen)
    layout = build_layout(1, T, 64, device)
    tokens = slot_tokens(layout, 1, T)
    wc, bc = to_chunks(w, layout), to_chunks(beta, layout)
    eye = torch.eye(64, device=device)
    lower = eye + (bc[..., :, None] * (wc @ wc.transpose(-1, -2))).tril(-1)
    want = torch.linalg.inv(lower.double())

    def bench(fn):
        return triton.testing.do_bench(fn, return_mode="median") if device == "cuda" else None

    out = dict(matrices=int(wc.shape[0] * wc.shape[1]))
    default = _triton_ut._INVERSE_NUM_WARPS
    try:
        for nw in warps:
            _triton_ut._INVERSE_NUM_WARPS = nw
            got = _triton_ut._inverse(w, beta, tokens, T, 64)
            out[f"triton_warps{nw}"] = dict(err=rel_err(got, want),
                                            ms=bench(lambda: _triton_ut._inverse(w, beta, tokens, T, 64)))
    finally:
        _triton_ut._INVERSE_NUM_WARPS = default
    solve = lambda: torch.linalg.solve_triangular(lower, eye.expand_as(lower), upper=False, unitriangular=True)  # noqa: E731
    out["trsm"] = dict(err=rel_err(solve(), want), ms=bench(solve))
    return out


def print_resources():
    """Registers, spills and shared memory of every compiled variant of the UT kernels."""
    from pathlab.kernels import ut_backward, ut_common, ut_forward

    for kernel in (ut_common._ut_inverse_kernel, ut_forward._ut_fwd_kernel, ut_backward._ut_bwd_heads_kernel,
                   ut_backward._ut_bwd_chunk_kernel, ut_backward._ut_bwd_inverse_kernel):
        for cache in getattr(kernel, "device_caches", {}).values():
            for compiled in cache[0].values():
                try:
                    compiled._init_handles()
                    print("  ", kernel.fn.__name__, "regs", compiled.n_regs, "spills", compiled.n_spills,
                          "shared", compiled.metadata.shared, flush=True)
                except Exception as err:  # noqa: BLE001  (a variant that does not fit: report it, go on)
                    print("  ", kernel.fn.__name__, "resource info failed", err)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="300x4x2x64,4096x12x12x64,512x16x16x128",
                    help="comma list of TxHxHkvxD ('' for none)")
    ap.add_argument("--inverse", default="", help="TxHkvxD: time the inverse kernel alone at this size (and trsm)")
    ap.add_argument("--inverse-warps", default="2,4,8", help="comma list of num_warps for --inverse")
    ap.add_argument("--out", default="ut-transform.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    out = {}
    if args.inverse:
        T, Hkv, D = map(int, args.inverse.split("x"))
        out["inverse"] = dict(size=args.inverse, **measure_inverse(T, Hkv, D, [int(x) for x in args.inverse_warps.split(",")]))
        print("inverse", json.dumps(out["inverse"]), flush=True)
    for size in filter(None, args.sizes.split(",")):
        T, H, Hkv, D = map(int, size.split("x"))
        try:
            out[size] = measure(T, H, Hkv, D)
        except Exception:  # noqa: BLE001  (record the failure, keep going)
            out[size] = dict(error=traceback.format_exc()[-3000:])
        print(size, json.dumps(out[size])[:1500], flush=True)
        print_resources()
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
