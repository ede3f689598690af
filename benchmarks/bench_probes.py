"""Wall time of the streamed theory probes (:func:`pathlab.probes.model.measure_model`) on a paper-shaped model.

Per variant: ``ModelConfig.paper(variant)`` (16 layers, width 768, 12 heads, vocabulary 50304), random init, fp32
weights on ``--device``. Per length L: ``--n-windows`` random token windows [B, L], then measure_model with the
study's settings (64 sampled queries in the last 512 positions, near sets W = 512, 64, 128; angle statistics up to
lag min(``--angle-lag``, L − 1) for rotation models). Each row records the forward through the blocks alone
(no hooks), the full measurement (forward + probes), and on CUDA the peak memory. One untimed measurement at a
short length first compiles the model's kernels, and one untimed forward at each length precedes its timed one.
``--m2-windows N`` also times the M2 pass (:func:`learned_head_windows` on N windows of 512 tokens).
``--bias-route`` picks ALiBi's and FoX's attention on CUDA: ``chunked`` the chunked additive-bias SDPA (the route of
fp32 inputs, so of the probes' fp32 forward), ``flex`` FlexAttention in every dtype (the route of bf16 and fp16).

    python benchmarks/bench_probes.py --variants rope,path --lengths 4096,65536 --n-windows 2 --device cuda
    python benchmarks/bench_probes.py --device cpu --n-layer 2 --lengths 1024 --n-windows 1
    python benchmarks/bench_probes.py --variants fox,alibi --bias-route chunked --n-layer 2 --n-windows 1
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import pathlab.ops.softmax as softmax_ops
from pathlab import ModelConfig, build_model
from pathlab.probes.model import learned_head_windows, measure_model, run_blocks

VOCAB, N_QUERIES, SPAN, NEAR = 50304, 64, 512, (512, 64, 128)


HEADER = f"{'variant':<16}{'layers':>7}{'L':>8}{'B':>4}{'forward s':>11}{'measure s':>11}{'probes s':>10}{'peak GiB':>10}"


def row_line(r) -> str:
    peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
    return (f"{r['variant']:<16}{r['n_layer']:>7}{r['length']:>8}{r['n_windows']:>4}{r['forward_s']:>11.2f}"
            f"{r['measure_s']:>11.2f}{r['probe_s']:>10.2f}{peak:>10}")


def timed(fn, device):
    """Seconds of ``fn()``, synchronised with the device before and after."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - start, out


def bench_variant(variant, lengths, n_windows, device, n_layer=None, angle_lag=4096, m2_windows=0, seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig.paper(variant)
    if n_layer:
        cfg = ModelConfig.from_dict({**cfg.to_dict(), "n_layer": n_layer})
    model = build_model(cfg).to(device).eval()
    gen = torch.Generator().manual_seed(seed)

    def measure(windows):
        L = windows.shape[1]
        return measure_model(model, windows, n_queries=N_QUERIES, span=min(SPAN, L), near_windows=NEAR,
                             angle_lag=min(angle_lag, L - 1) or None, seed=seed)

    warm = min(min(lengths), 1024)
    warmup_s, _ = timed(lambda: measure(torch.randint(0, VOCAB, (1, warm), generator=gen).to(device)), device)
    rows = []
    for L in lengths:
        windows = torch.randint(0, VOCAB, (n_windows, L), generator=gen).to(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with torch.no_grad():
            run_blocks(model, windows[:1])  # untimed: the kernels' first launch at this length
            forward_s, _ = timed(lambda: [run_blocks(model, windows[b:b + 1]) for b in range(n_windows)], device)
        measure_s, _ = timed(lambda: measure(windows), device)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        rows.append({"variant": variant, "n_layer": cfg.n_layer, "length": L, "n_windows": n_windows,
                     "forward_s": forward_s, "measure_s": measure_s, "probe_s": measure_s - forward_s,
                     "peak_gib": peak, "warmup_s": warmup_s})
        print(row_line(rows[-1]), flush=True)
    if m2_windows:
        windows = torch.randint(0, VOCAB, (m2_windows, SPAN), generator=gen).to(device)
        m2_s, _ = timed(lambda: learned_head_windows(model, windows, n_max=min(angle_lag or SPAN, SPAN) - 1,
                                                     fallback=SPAN), device)
        for r in rows:
            r["m2_s"], r["m2_windows"] = m2_s, m2_windows
        print(f"# {variant}: M2 pass (learned_head_windows) on {m2_windows} × {SPAN} tokens: {m2_s:.2f} s", flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="rope,path")
    p.add_argument("--lengths", default="4096,65536")
    p.add_argument("--n-windows", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--n-layer", type=int, default=None, help="fewer layers than the paper's 16 (a quick check)")
    p.add_argument("--angle-lag", type=int, default=4096, help="largest lag of the angle statistics (0: none)")
    p.add_argument("--m2-windows", type=int, default=0, help="also time the M2 pass on this many 512-token windows")
    p.add_argument("--bias-route", choices=("flex", "chunked"), default="chunked",
                   help="ALiBi's and FoX's attention on CUDA: FlexAttention in every dtype, or the chunked SDPA")
    p.add_argument("--out", default=None, help="write the rows as JSON here (rewritten after each variant)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    lengths = [int(s) for s in args.lengths.split(",")]
    # flex: FlexAttention on CUDA in every dtype, fp32 included (which pathlab routes to the chunked SDPA)
    softmax_ops._flex_route = lambda device_type, dtype: args.bias_route == "flex" and device_type == "cuda"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {name}, torch {torch.__version__}, {N_QUERIES} queries, span {SPAN}, near {list(NEAR)}, "
          f"bias route {args.bias_route}")
    print(HEADER, flush=True)
    rows = []
    for variant in args.variants.split(","):
        rows += bench_variant(variant, lengths, args.n_windows, device, args.n_layer, args.angle_lag,
                              args.m2_windows)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": name, "torch": torch.__version__, "bias_route": args.bias_route, "rows": rows},
                          f, indent=1)


if __name__ == "__main__":
    main()
