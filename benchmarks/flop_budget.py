"""How fast PaTH's kernels run against SDPA's, in tensor-core work, and what that allows the owt16 model.

No GPU: the matrix products of each kernel are counted as the kernels' loops make them (multiply-adds, MAC, per
forward+backward at one case; ``kernel_macs`` below mirrors ``kernels/scan_*.py`` and
``kernels/ut_*.py`` product by product), and a committed profile gives each kernel's time. Reported:

* per kernel, its MACs, time and rate (TFLOP/s, 2 FLOP a MAC), and SDPA's rate at the same case, counted two
  ways: the 7 T×T×D products of a causal forward and backward over half the square (3.5·T²·D MAC per head and
  sequence), or over the whole BT×BT tiles on and below the diagonal, as PaTH's kernels are counted (BT = 64:
  7·n(n+1)/2·BT²·D with n = T/BT; 12% more at T = 512, so a higher rate);
* the op's time if every PaTH kernel ran at SDPA's rate, each way;
* the ``owt16`` step and tokens/s that op time allows, from a step profile of each model: PaTH's step with its op
  kernels' time replaced, against RoPE's step.

    python benchmarks/flop_budget.py --kernels benchmarks/results/kernels-h200-profile-512-5ed5097.json \\
        --path-step benchmarks/results/throughput-h200-profile-all-path-f932ee5.json \\
        --rope-step benchmarks/results/throughput-h200-profile-all-rope-f932ee5.json --out flop-budget.json

Counted are the products on the tensor cores only (a W Wᵀ taken in three tf32 passes counts once; the inverse's
16×16 forward substitutions and every elementwise step are left out), so the rates are of useful work.
"""

from __future__ import annotations

import argparse
import json
import sys


def kernel_macs(T: int, D: int, BT: int = 64, group: int = 1) -> dict[str, int]:
    """MACs of each PaTH kernel per kv head and sequence of T tokens (head dim D = Dv, chunks of BT, ``group``
    query heads per kv head), forward+backward, on the route the model takes (UT factors kept, A kept)."""
    nc = T // BT
    pairs = nc * (nc - 1) // 2  # (query chunk, earlier key chunk)
    sq, sd, dd = BT * BT * D, BT * BT * D, BT * D * D  # BT×D·D×BT (logits), BT×BT·BT×D, BT×D·D×D
    cube = BT * BT * BT
    doubling = sum(BT * s * s for s in (16, 32, 64, 128) if 2 * s <= BT)  # A₂₁ = −A₂₂ N₂₁ A₁₁ by levels
    return {
        # per query chunk: P·V of the diagonal block; per pair: S, P·V, the carry q M
        "_path_fwd_kernel": group * (nc * sd + pairs * (sq + sd + dd)),
        # per pair: the replayed carry, S, dP, dV, dk̃, dM, λ Mᵀ, λ += dS k̃; per query chunk: dP, dV of the diagonal
        "_path_bwd_kernel": group * (pairs * (dd + sq + sq + sd + sd + dd + dd + sd) + nc * (sq + sd)),
        # W Wᵀ, then the doubling steps
        "_ut_inverse_kernel": nc * (sq + doubling),
        # U, W Kᵀ, X, k̃, M; per query head Q Wᵀ, q̃, Q Kᵀ, Q_W X
        "_ut_fwd_kernel": nc * (sd + sq + cube + sd + dd + group * (sq + sd + sq + cube)),
        # U, W Kᵀ, X again; dU, dW, dX, dW from dM and dk̃; per query head dQ_W (2), dQ (2), Q Wᵀ and four sums
        "_ut_bwd_heads_kernel": nc * (sd + sq + cube + dd + dd + sq + sd
                                      + group * (sq + cube + sd + sd + sq + sd + cube + sd + sd)),
        # W Kᵀ, d(A D_β) (2), dW, dWK, dW, dk
        "_ut_bwd_chunk_kernel": nc * (sq + sq + cube + sd + cube + sd + sd),
        # dN = −Aᵀ dA Aᵀ (2), W Wᵀ, (dG + dGᵀ) W
        "_ut_bwd_inverse_kernel": nc * (cube + cube + sq + sd),
    }


def sdpa_macs(T: int, D: int, tiles: int = 0) -> float:
    """Causal attention's MACs per head and sequence, forward+backward: 7 T×T×D products over half the square, or
    (``tiles`` = BT > 0) over the whole BT×BT tiles on and below the diagonal."""
    if tiles:
        n = T // tiles
        return 7.0 * n * (n + 1) / 2 * tiles * tiles * D
    return 3.5 * T * T * D


def _kernel_ms(profile: dict) -> dict[str, float]:
    return {k["name"]: k["ms_per_call"] for k in profile["kernels"]}


def budget(kernels_file: dict, path_step: dict, rope_step: dict, BT: int = 64) -> dict:
    path_profile = next(p for p in kernels_file["profile"] if p["method"] == "path")
    T, B, H, D = (path_profile[k] for k in ("T", "B", "H", "D"))
    sdpa_ms = next(c["fwd_bwd_ms"] for c in kernels_file["cases"]
                   if c["method"] == "sdpa" and (c["T"], c["B"], c["H"], c["D"]) == (T, B, H, D))
    heads = B * H
    counts = {"half_square": sdpa_macs(T, D), "whole_tiles": sdpa_macs(T, D, BT)}
    sdpa_rate = {way: macs * heads * 2 / (sdpa_ms * 1e-3) / 1e12 for way, macs in counts.items()}
    ms = _kernel_ms(path_profile)
    rows = []
    for name, macs in kernel_macs(T, D, BT).items():
        flop = 2 * macs * heads
        rows.append(dict(kernel=name, gmac=macs * heads / 1e9, ms=ms[name], tflops=flop / (ms[name] * 1e-3) / 1e12,
                         ms_at_sdpa_rate={way: flop / (rate * 1e12) * 1e3 for way, rate in sdpa_rate.items()}))
    op_ms = sum(r["ms"] for r in rows)
    op_gmac = sum(r["gmac"] for r in rows)
    op_at_sdpa = {way: sum(r["ms_at_sdpa_rate"][way] for r in rows) for way in counts}

    step = path_step["throughput"]["path"]
    op_kernels = {r["kernel"] for r in rows}
    in_step = [k for k in step["profile"]["kernels"] if k["name"] in op_kernels]
    op_in_step_ms = sum(k["ms_per_call"] for k in in_step)  # the op's kernels in one step, all layers
    layers = round(next(k["launches_per_call"] for k in in_step if k["name"] == "_path_bwd_kernel"))
    rest_ms = step["ms_per_step"] - op_in_step_ms  # everything but the op, per step
    rope = rope_step["throughput"]["rope"]
    tokens = step["tokens_per_s"] * step["ms_per_step"] / 1e3  # per step
    with_op_at_sdpa = {way: tokens / ((rest_ms + layers * t) / 1e3) / rope["tokens_per_s"]
                       for way, t in op_at_sdpa.items()}
    return dict(
        case=dict(T=T, B=B, H=H, D=D, BT=BT), kernels=rows,
        sdpa=dict(ms=sdpa_ms, gmac={way: macs * heads / 1e9 for way, macs in counts.items()}, tflops=sdpa_rate),
        op=dict(ms=op_ms, gmac=op_gmac, tflops=2 * op_gmac * 1e9 / (op_ms * 1e-3) / 1e12, ms_at_sdpa_rate=op_at_sdpa,
                gmac_over_sdpa={way: op_gmac * 1e9 / (macs * heads) for way, macs in counts.items()}),
        owt16=dict(layers=layers, path_step_ms=step["ms_per_step"], path_op_kernels_ms=op_in_step_ms,
                   path_rest_ms=rest_ms, path_tokens_per_s=step["tokens_per_s"], rope_step_ms=rope["ms_per_step"],
                   rope_tokens_per_s=rope["tokens_per_s"], path_over_rope=step["tokens_per_s"] / rope["tokens_per_s"],
                   path_over_rope_with_op_at_sdpa_rate=with_op_at_sdpa,
                   op_ms_per_layer_for_0_8_rope=(rope["ms_per_step"] / 0.8 - rest_ms) / layers))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", required=True, help="bench_kernels.py result with a profile of path and sdpa")
    ap.add_argument("--path-step", required=True, help="bench_throughput.py result of path with --profile-top 0")
    ap.add_argument("--rope-step", required=True, help="bench_throughput.py result of rope")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    loaded = [json.load(open(f)) for f in (args.kernels, args.path_step, args.rope_step)]
    result = budget(*loaded)
    print(json.dumps(result, indent=1))
    if args.out:
        from pathlab.results import write_benchmark_result

        write_benchmark_result(args.out, "benchmarks/flop_budget.py", sys.argv[1:] if argv is None else argv,
                               **result)


if __name__ == "__main__":
    main()
