"""Peak memory of one forward+backward of the blockwise PyTorch PaTH, against the size of a T×T matrix.

    MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/bench_blockwise_memory.py --T 16384 --H 2 --D 64 \
        --out benchmarks/results/blockwise-memory-cpu.json
    python benchmarks/bench_blockwise_memory.py --device cuda --T 16384 --out ...

On the CPU, peak resident memory is read from the kernel (VmHWM, reset through /proc/self/clear_refs just before
the measured region), so it counts every allocation of the process, not only PyTorch's; a fixed malloc mmap
threshold makes freed buffers leave the process, so the peak reflects live memory. On CUDA the allocator's peak
(torch.cuda.max_memory_allocated) is used.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

import pathlab
from pathlab.atomic import atomic_write_text
from pathlab.testing import random_path_inputs


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, default=16384)
    parser.add_argument("--H", type=int, default=2)
    parser.add_argument("--D", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--gate", action="store_true")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    inputs = random_path_inputs(1, args.T, args.H, args.D, beta_range=(0.05, 1.95), gate=args.gate,
                                requires_grad=True, device=args.device)
    cuda = args.device == "cuda"
    # warm up on a short sequence first: loading kernels and thread pools must not count as the op's memory
    warm = random_path_inputs(1, 2 * args.chunk + 3, args.H, args.D, gate=args.gate, requires_grad=True,
                              device=args.device)
    pathlab.path_attention(*warm, backend="torch", chunk_size=args.chunk).sum().backward()
    del warm
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 1024
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak-RSS counter
        base = _status_kib("VmRSS")
    start = time.perf_counter()
    out = pathlab.path_attention(*inputs, backend="torch", chunk_size=args.chunk)
    out.square().mean().backward()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 1024 if cuda else _status_kib("VmHWM")
    finite = all(bool(torch.isfinite(t.grad).all()) for t in inputs if t is not None)
    extra_mib = (peak - base) / 1024
    txt_mib = args.T * args.T * 4 * args.H / 2**20
    result = {
        "what": f"blockwise PyTorch PaTH forward+backward, peak extra memory on {args.device}",
        "shape": {"B": 1, "T": args.T, "H": args.H, "D": args.D, "chunk": args.chunk, "gate": args.gate},
        "peak_extra_MiB": round(extra_mib, 1),
        "TxT_fp32_matrix_all_heads_MiB": round(txt_mib, 1),
        "inputs_MiB": round(sum(t.numel() * 4 for t in inputs if t is not None) / 2**20, 1),
        "seconds": round(seconds, 1),
        "grads_finite": finite,
        "torch": torch.__version__,
        "machine": torch.cuda.get_device_name() if cuda else f"{platform.machine()}, {os.cpu_count()} cores",
    }
    print(json.dumps(result, indent=2))
    if args.out:
        atomic_write_text(args.out, json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
