"""Launch configurations of the deferred decode step's split-K attention (``_deferred_attend_dot_kernel``) alone.

The attention over the base keys reads the fp16 shadow keys and bf16 values once per step: the same bytes as
plain decoding. For one cache (B = 1, H × D, ``--length`` cached tokens, all of them base keys) it times the
kernel (median of ``triton.testing.do_bench``) for every (3-pass TF32 or 16-bit products, key block,
num_warps, num_stages, programs per SM) of the grid, checks each against the softmax over the same keys in fp32, and times plain decoding's attention over
a bf16 cache of the same length (SDPA, one query row) as the yardstick. Reports GB/s and the ratio to SDPA.

    python benchmarks/sweep_decode_attend.py --out decode-attend-sweep.json

Use the best row through ``KernelConfig(decode_attend=(block, warps, stages, per_sm), decode_native=dot == 2)``
or as the new default of ``pathlab.kernels.decode.attend_config``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch
import torch.nn.functional as F


def sweep(length, H, D, blocks, warps, stages, per_sm, dots=(2,), device="cuda", value_dtype=torch.bfloat16):
    """One row per launch configuration (products ``dots`` × key ``blocks`` × ``warps`` × ``stages`` × programs
    ``per_sm``): ``rel_err`` of the merged partials against softmax(q_τ Kᵀ) V in fp32, and on CUDA the median µs
    and GB/s; then SDPA's time over the same keys and values. On a CPU (the interpreter) only the errors."""
    import triton
    import triton.testing

    from pathlab.kernels.decode import attend

    gen = torch.Generator(device=device).manual_seed(0)
    keys = torch.randn(1, H, length, D, device=device, generator=gen).half()  # the fp16 shadow
    values = torch.randn(1, H, length, D, device=device, generator=gen).to(value_dtype)  # bf16 as in generation
    qt = torch.randn(H, 1, D, device=device, generator=gen) * (D ** -0.5 / math.log(2))  # q_τ · scale · log2 e
    pos = torch.tensor([length, length], dtype=torch.int32, device=device)  # n, base: every key is a base key
    want = F.scaled_dot_product_attention(qt[None].float() * math.log(2), keys.float(), values.float(), scale=1.0)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device == "cuda" else 1
    nbytes = keys.numel() * 2 + values.numel() * 2
    rows = []
    for dot, block, nw, ns, ps in itertools.product(dots, blocks, warps, stages, per_sm):
        splits = max(1, min(triton.cdiv(length, block), triton.cdiv(ps * sms, H)))
        n_slots = 1 + splits
        m = torch.full((H, n_slots, 1), float("-inf"), device=device)
        l = torch.zeros(H, n_slots, 1, device=device)
        acc = torch.zeros(H, n_slots, 1, D, device=device)

        def run():
            attend(keys, values, values, qt, m, l, acc, pos, length, n_slots, H, splits, group=1, has_gate=False,
                   block=block, warps=nw, stages=ns, dot=dot)

        row = dict(dot=dot, block=block, warps=nw, stages=ns, per_sm=ps, splits=splits)
        try:
            run()
            top = m.max(1, keepdim=True).values  # slot 0 (the recent part) is empty here: m = −inf, l = 0
            wgt = torch.exp2(m - top)
            got = (acc * wgt[..., None]).sum(1) / (l * wgt).sum(1)[..., None]  # [H, 1, D]
            row["rel_err"] = float((got - want[0]).norm() / want[0].norm())
            if device == "cuda":
                row["us"] = 1e3 * triton.testing.do_bench(run, warmup=25, rep=100)
                row["gb_per_s"] = nbytes / (row["us"] * 1e-6) / 1e9
        except Exception as err:  # a config that does not compile or fit is recorded, the sweep goes on
            row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = dict(length=length, H=H, D=D, bytes_per_step=nbytes, rows=rows)
    if device != "cuda":  # the interpreter: correctness only
        return result
    q = torch.randn(1, H, 1, D, device=device, generator=gen).bfloat16()
    kb = keys.bfloat16()
    sdpa_us = 1e3 * triton.testing.do_bench(lambda: F.scaled_dot_product_attention(q, kb, values), warmup=25, rep=100)
    for row in rows:
        if "us" in row:
            row["ratio_to_sdpa"] = row["us"] / sdpa_us
    return dict(result, sdpa_us=sdpa_us, sdpa_gb_per_s=nbytes / (sdpa_us * 1e-6) / 1e9)


def _ints(text):
    return [int(x) for x in text.split(",") if x]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=65536)
    ap.add_argument("--shape", default="12x64", help="HxD (B = 1, one query head per kv head)")
    ap.add_argument("--blocks", default="64,128,256")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="1,3")
    ap.add_argument("--per-sm", default="4,8,16")
    ap.add_argument("--dot", default="1,2", help="1: tensor cores (tl.dot, 3-pass TF32), "
                                                 "2: tensor cores in the caches' fp16/bf16 (two-part query and P)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    H, D = (int(x) for x in args.shape.split("x"))
    result = dict(command="python3 benchmarks/sweep_decode_attend.py " + " ".join(argv or []),
                  device=torch.cuda.get_device_name(), torch=torch.__version__)
    import triton

    result["triton"] = triton.__version__
    result.update(sweep(args.length, H, D, _ints(args.blocks), _ints(args.warps), _ints(args.stages),
                        _ints(args.per_sm), _ints(args.dot)))
    ok = [r for r in result["rows"] if "us" in r and r["rel_err"] < 1e-2]
    if ok:
        result["best"] = min(ok, key=lambda r: r["us"])
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
