"""Time ALiBi's and FoX's attention at the (batch, length) shapes of a study evaluation, in the order it meets them.

The evaluation (``pathlab.training.evaluate``) scores each length L twice: as 512-token chunks (batch 128) and
whole (batch 65,536 / L). FlexAttention is compiled, so the question is whether it stays compiled across these
shapes: each call's time, the compiler's graph and recompile counts after it, and any warning that it ran unfused
are recorded. Usage (a GPU)::

    python benchmarks/bench_bias_attention.py --out bias-attention.json
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import torch
import torch._dynamo.utils as dynamo_utils

from pathlab.ops import softmax as softmax_ops

EVAL_SHAPES = [(128, 512)] + [s for L in (1024, 2048, 4096, 8192, 16384, 32768, 65536)
                              for s in ((128, 512), (65536 // L, L))]


def _inputs(variant: str, B: int, T: int, H: int, D: int, device: str, dtype):
    gen = torch.Generator(device=device).manual_seed(B * 100003 + T)
    q, k, v = (torch.randn(B, T, H, D, device=device, dtype=dtype, generator=gen) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device=device, generator=gen) + 4.0)
    return q, k, v, g


def _call(variant: str, q, k, v, g):
    if variant == "fox":
        return softmax_ops.fox_attention(q, k, v, g)
    return softmax_ops.alibi_attention(q, k, v)


def measure(variant: str, shapes, *, H: int, D: int, device: str, dtype) -> list[dict]:
    rows = []
    for B, T in shapes:
        q, k, v, g = _inputs(variant, B, T, H, D, device, dtype)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            _call(variant, q, k, v, g)
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            _call(variant, q, k, v, g)
            torch.cuda.synchronize()
            second = time.perf_counter() - t0
        stats = dict(dynamo_utils.counters["stats"])
        recompiles = sum(dynamo_utils.counters["recompiles"].values()) if "recompiles" in dynamo_utils.counters else 0
        row = {"variant": variant, "B": B, "T": T, "first_s": first, "second_s": second,
               "unique_graphs": stats.get("unique_graphs", 0), "recompiles": recompiles,
               "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
               "warnings": sorted({str(w.message)[:160] for w in caught})}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del q, k, v, g
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="fox,alibi")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for variant in args.variants.split(","):
        torch._dynamo.reset()
        dynamo_utils.counters.clear()
        softmax_ops._compiled_flex.cache_clear()
        with torch.no_grad():
            rows += measure(variant, EVAL_SHAPES, H=args.heads, D=args.head_dim, device="cuda", dtype=torch.bfloat16)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": EVAL_SHAPES, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
