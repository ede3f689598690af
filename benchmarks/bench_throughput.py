"""Training throughput of the ``owt16`` model per attention variant, and a 65K-token evaluation smoke test.

    python3 benchmarks/bench_throughput.py --out benchmarks/results/throughput-h200.json

Throughput: the paper model (16 layers, width 768, 12 heads, context 512, GPT-2 vocabulary 50304), batch 64 x 512,
bf16 autocast, fused AdamW, ``torch.compile`` of the whole model as ``pathlab train`` does (``--compile model``,
the default: the loss and output layer are fused too; 30-60 s of compiling, so give ``--variant-timeout-s`` room)
or of each block (``--compile blocks``: the 16 identical blocks share one compiled graph, seconds to compile),
random tokens. Each variant runs ``--warmup``
untimed iterations (compilation, autotuning) and ``--steps`` timed ones between CUDA synchronisations:

    tokens/s = steps x 64 x 512 / elapsed.

Reference anchors measured on one H200: RoPE through SDPA about 436K tokens/s; PaTH through the public kernel
about 218K. Targets: RoPE >= 400K and every variant >= 0.8 x RoPE.

65K smoke test (``--eval-length 65536``): a small random-init model (``--eval-layers`` x ``--eval-width``) runs one
forward pass over a 65,536-token sequence per variant in bf16 without gradients; we record the time, the peak
memory and that the loss is finite. A T x T score matrix at 65K would need 16 GiB per head in fp32, so a small
peak shows that no variant materialises it.

Data parallel (``--gpus N``): each measurement runs under ``torchrun --nproc_per_node N`` with
DistributedDataParallel, one process per GPU, each with the per-GPU batch ``--batch`` x ``--block`` (weak scaling:
the global batch grows with N, as when a run adds GPUs and lowers its gradient accumulation). Then

    tokens/s = steps x N x batch x block / elapsed,   scaling efficiency = tokens/s(N) / (N x tokens/s(1)).

Isolation: every measurement (one variant, one phase) runs in its own Python subprocess with its own time limit
(``--variant-timeout-s``), so a crash, a compiler failure or a hang of one variant is recorded as that variant's
``error`` (with the tail of its output, its exit code, ``timed_out``) and the others still run with a fresh GPU.
No measurement starts after the phase's ``--budget-s``, so a phase ends within about
``--budget-s + --variant-timeout-s``. ``--in-process`` runs everything in one process instead (no isolation).

Results are written (atomically, after every variant) to ``--out`` as JSON with the command line and environment.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import pathlab
from pathlab.training import distributed
from pathlab.atomic import atomic_write_text
from pathlab.profiling import time_by_kernel
from pathlab.training.trainer import make_optimizer

ORDER = ["rope", "path", "path_fox", "fox", "alibi", "nope", "rot_learned_qkv", "rot_random_qkv",
         "rot_learned_qk", "rot_random_qk"]


def write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def throughput(variant: str, args, ctx: distributed.DistContext) -> dict:
    """One variant's training throughput on this process's device (all processes' tokens under torchrun)."""
    device = ctx.device
    torch.manual_seed(0)
    cfg = pathlab.ModelConfig(n_layer=args.layers, n_head=args.width // 64, n_embd=args.width, vocab_size=50304,
                              attention=variant)
    model = pathlab.build_model(cfg).to(device)
    optim = make_optimizer(model, {"lr": 6e-4, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95}, device)
    n_parameters = sum(p.numel() for p in set(model.parameters()))
    if args.compile == "blocks":
        for block in model.blocks:
            block.compile()
    elif args.compile == "model":
        model = torch.compile(model)
    model = distributed.wrap_model(model, ctx, "ddp")  # unchanged on one process
    B, T = args.batch, args.block
    torch.manual_seed(ctx.rank)  # each process its own tokens
    x = torch.randint(0, 50257, (B, T + 1), device=device)
    inputs, targets = x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            _, loss = model(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        return loss.detach()

    def sync_all():
        _sync(device)
        ctx.barrier()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        loss = step()
    sync_all()
    warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    sync_all()
    elapsed = time.perf_counter() - t0
    profile = (time_by_kernel(step, args.profile_steps, device, top=args.profile_top or 10**9)
               if args.profile_steps else None)
    loss = float(ctx.all_reduce_mean(loss.float()))
    out = {
        "variant": variant, "processes": ctx.world_size,
        "tokens_per_s": args.steps * ctx.world_size * B * T / elapsed, "ms_per_step": 1000 * elapsed / args.steps,
        "warmup_s": warm_s, "loss": loss, "loss_finite": math.isfinite(loss),
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "parameters": n_parameters,
    }
    if profile is not None:
        out["profile"] = profile
    del model, optim
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


@torch.no_grad()
def eval_smoke(variant: str, args) -> dict:
    device = torch.device(args.device)
    if device.type != "cuda":
        raise ValueError("the long-sequence smoke test needs CUDA")
    torch.manual_seed(0)
    cfg = pathlab.ModelConfig(n_layer=args.eval_layers, n_head=args.eval_width // 64, n_embd=args.eval_width,
                              vocab_size=50304, attention=variant)
    model = pathlab.build_model(cfg).to(device).eval()
    T = args.eval_length
    x = torch.randint(0, 50257, (1, T + 1), device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits, _ = model(x[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits[0].float(), x[0, 1:])
    torch.cuda.synchronize(device)
    out = {"variant": variant, "length": T, "seconds": time.perf_counter() - t0, "loss": float(loss),
           "loss_finite": math.isfinite(float(loss)),
           "peak_extra_mem_gib": (torch.cuda.max_memory_allocated(device) - base) / 2**30}
    del model, logits
    torch.cuda.empty_cache()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_isolated(kind: str, variant: str, argv: list[str], timeout_s: float, nproc: int = 1) -> dict:
    """Run one measurement in a fresh ``python bench_throughput.py ... --worker KIND:VARIANT`` process (under
    ``torchrun --nproc_per_node NPROC`` when ``nproc > 1``; process 0 writes the result).

    Returns the worker's result dict, or ``{"variant", "error", "returncode", "timed_out", "output_tail"}`` when
    it fails, exits without a result or runs past ``timeout_s`` (then its whole process group, compile workers
    included, is killed).
    """
    with tempfile.TemporaryDirectory(prefix="bench_throughput_") as tmp:
        result_path = Path(tmp) / "result.json"
        log_path = Path(tmp) / "output.log"
        launcher = [sys.executable]
        if nproc > 1:
            launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
                         "--master_port", str(_free_port())]
        cmd = [*launcher, str(Path(__file__).resolve()), *argv,
               "--worker", f"{kind}:{variant}", "--worker-out", str(result_path)]
        t0 = time.perf_counter()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            timed_out = False
            try:
                returncode = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
                returncode = proc.wait()
            except BaseException:  # this process is being stopped (SIGTERM, Ctrl-C): the worker must not outlive it
                _kill_group(proc)
                raise
        seconds = time.perf_counter() - t0
        tail = log_path.read_text(errors="replace")[-3000:]
        if not timed_out and result_path.exists():  # under torchrun a failed variant also exits non-zero
            out = json.loads(result_path.read_text())
            out["subprocess_s"] = seconds
            if "error" in out:
                out["output_tail"] = tail  # the worker's traceback
            return out
    if timed_out:
        error = f"timeout: no result after {timeout_s:.0f} s (process group killed)"
    else:
        last = [line for line in tail.strip().splitlines() if line.strip()]
        error = f"worker exited with code {returncode}: {last[-1][:500] if last else 'no output'}"
    return {"variant": variant, "error": error, "returncode": returncode, "timed_out": timed_out,
            "subprocess_s": seconds, "output_tail": tail}


def _kill_group(proc) -> None:
    """SIGKILL the worker's own session: it and its compile workers. A worker left running would share the GPU
    with the measurements that follow."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through run_isolated, which then kills the running worker


def run_worker(spec: str, result_path: str, args) -> int:
    """Worker mode: one measurement, its result written as JSON to ``result_path`` (exit code 0), or an
    ``error`` entry with the traceback's last line (exit code 0 too: the failure is the variant's result).

    Under torchrun every process measures and process 0 writes the result; a failure in any process exits
    non-zero, so that torchrun stops the others instead of leaving them waiting in a collective."""
    kind, _, variant = spec.partition(":")
    if kind not in ("throughput", "eval_smoke") or not variant:
        raise SystemExit(f"--worker must be throughput:VARIANT or eval_smoke:VARIANT, got {spec!r}")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    ctx = distributed.setup(args.device)
    failed = False
    try:
        r = throughput(variant, args, ctx) if kind == "throughput" else eval_smoke(variant, args)
    except Exception as err:  # noqa: BLE001 - the failure is this variant's result
        import traceback

        traceback.print_exc()
        r = {"variant": variant, "error": f"{type(err).__name__}: {str(err)[:2000]}"}
        failed = True
    if torch.cuda.is_available():
        r["device_name"] = torch.cuda.get_device_name(0)
    if ctx.is_main:
        write_json(Path(result_path), r)
    if ctx.enabled and failed:
        return 1
    distributed.teardown()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(ORDER))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--compile", choices=["none", "blocks", "model"], default="model")
    p.add_argument("--budget-s", type=float, default=400.0,
                   help="start no new throughput measurement after this many seconds")
    p.add_argument("--eval-budget-s", type=float, default=120.0,
                   help="start no new long-sequence smoke test after this many seconds of that phase")
    p.add_argument("--eval-length", type=int, default=0, help="also run the long-sequence smoke test (e.g. 65536)")
    p.add_argument("--eval-layers", type=int, default=2)
    p.add_argument("--eval-width", type=int, default=256)
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="after timing, profile this many steps and record the device time per kernel")
    p.add_argument("--profile-top", type=int, default=30,
                   help="record this many kernels of the profile, the longest first (0: all)")
    p.add_argument("--out", default="benchmarks/results/throughput-h200.json")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--device", default="cuda")
    p.add_argument("--gpus", type=int, default=1,
                   help="processes per throughput measurement, one per GPU (gloo processes with --device cpu), "
                        "under torchrun with DistributedDataParallel; --batch is per process")
    p.add_argument("--variant-timeout-s", type=float, default=240.0,
                   help="time limit of one variant's subprocess (compilation included); on expiry it is killed "
                        "and recorded as a timeout")
    p.add_argument("--in-process", action="store_true",
                   help="run every variant in this process (no isolation; for debugging)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: KIND:VARIANT
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    if args.worker:
        if not args.worker_out:
            raise SystemExit("--worker needs --worker-out")
        return run_worker(args.worker, args.worker_out, args)
    if args.gpus < 1 or (args.gpus > 1 and args.in_process):
        p.error("--gpus must be >= 1, and --in-process runs one process only")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # e.g. `timeout`: stop the running worker too
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_throughput: needs a CUDA device (or --device cpu for a dry run)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    variants = [v for v in args.variants.split(",") if v]
    report = {
        "command": "python3 benchmarks/bench_throughput.py " + " ".join(argv),
        "setup": {"model": f"{args.layers} layers, width {args.width}, {args.width // 64} heads, vocab 50304",
                  "batch": args.batch, "processes": args.gpus,
                  "parallelism": "DistributedDataParallel, one process per GPU, batch per process"
                                 if args.gpus > 1 else "one process",
                  "block": args.block, "dtype": "bf16 autocast", "optimizer": "fused AdamW",
                  "compile": args.compile, "steps": args.steps, "warmup": args.warmup,
                  "isolation": "in-process" if args.in_process else
                               f"one subprocess per variant, {args.variant_timeout_s:.0f} s limit"},
        "env": {"gpu": None,  # from the first worker's result (the parent process does not touch the GPU)
                "torch": torch.__version__, "python": platform.python_version(),
                "triton": __import__("triton").__version__,
                # the user-facing PATHLAB_* settings of the run (data, runs folders, debug)
                "pathlab": {key: val for key, val in os.environ.items() if key.startswith("PATHLAB_")}},
        "anchors_tokens_per_s": {"rope_sdpa": 436_000, "path_public_kernel": 218_000},
        "throughput": {}, "eval_smoke": {}, "skipped": [],
    }
    out = Path(args.out)
    jobs = [] if args.skip_throughput else [("throughput", v) for v in variants]
    jobs += [("eval_smoke", v) for v in variants] if args.eval_length else []
    phase_start = {"throughput": None, "eval_smoke": None}
    budget = {"throughput": args.budget_s, "eval_smoke": args.eval_budget_s}
    for kind, v in jobs:
        if phase_start[kind] is None:
            phase_start[kind] = time.perf_counter()
        used = time.perf_counter() - phase_start[kind]
        if used > budget[kind]:
            report["skipped"].append(f"{kind}:{v} (time budget)")
            continue
        if args.in_process:
            try:
                r = throughput(v, args, distributed.DistContext(device=torch.device(args.device))) \
                    if kind == "throughput" else eval_smoke(v, args)
            except Exception as err:  # noqa: BLE001 - record the failure and go on with the other variants
                r = {"variant": v, "error": f"{type(err).__name__}: {str(err)[:500]}"}
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        else:
            r = run_isolated(kind, v, argv, args.variant_timeout_s, args.gpus if kind == "throughput" else 1)
            if report["env"]["gpu"] is None and r.get("device_name"):
                report["env"]["gpu"] = r["device_name"]
        report[kind][v] = r
        if "error" in r:
            report.setdefault("errors", {})[f"{kind}:{v}"] = r["error"]
        print(kind, json.dumps({key: val for key, val in r.items() if key != "output_tail"}), flush=True)
        rope = report["throughput"].get("rope", {}).get("tokens_per_s")
        if rope:
            for r2 in report["throughput"].values():
                if "tokens_per_s" in r2:
                    r2["ratio_to_rope"] = r2["tokens_per_s"] / rope
        write_json(out, report)
    def num(d, key, spec):
        value = d.get(key)
        return format(value, spec) if isinstance(value, (int, float)) else format("-", spec.lstrip(",").split(".")[0]
                                                                                    .replace(",", ""))

    print(f"\n{'variant':18s} {'tok/s':>10s} {'x rope':>7s} {'GiB':>6s} | {'65K s':>7s} {'65K GiB':>8s}")
    for v in variants:
        t, e = report["throughput"].get(v, {}), report["eval_smoke"].get(v, {})
        print(f"{v:18s} {num(t, 'tokens_per_s', '>10,.0f')} {num(t, 'ratio_to_rope', '>7.2f')} "
              f"{num(t, 'peak_mem_gib', '>6.1f')} | {num(e, 'seconds', '>7.2f')} {num(e, 'peak_extra_mem_gib', '>8.2f')}"
              f" {t.get('error', '')[:60]} {e.get('error', '')[:60]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
