"""Milliseconds per training step of the state-tracking models, per attention variant, precision and compile mode.

    python3 benchmarks/bench_task_step.py --out benchmarks/results/task-step-h200.json

The models and settings are those of ``pathlab tasks run TASK --preset PRESET`` (``configs/tasks/*.yaml``), with
the overrides given per case. Each (case, attention, precision, compile) combination builds the model, runs
``--warmup`` untimed steps (compilation, CUDA-graph capture, autotuning) and ``--steps`` timed ones on one fixed
batch between device synchronisations, with :func:`pathlab.tasks.runner.train_step` (the step the task runner
takes). A failure (a compiler error, say) is recorded as that combination's ``error``; the others still run.
The file says which compile mode is fastest per (case, attention) among those that ran and reached a finite loss.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from pathlab.results import atomic_write_text, library_versions
from pathlab.tasks.runner import build_task_model, compile_for_training, task_optimizer, train_step
from pathlab.tasks.settings import parse_overrides, resolve_settings
from pathlab.tasks.specs import get_task
from pathlab.training.distributed import resolve_device

# name: (task, preset, overrides); the shapes of the committed A5 and MQRAR-N runs
CASES = {
    "a5-k5-L2": ("a5", "h200", {"length": 5, "n_layer": 2, "batch_size": 512}),
    "mqrar-n2": ("mqrar", "h200", {"n_back": 2}),
}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(case: str, attention: str, precision: str, compile_mode: str, steps: int, warmup: int) -> dict:
    task, preset, overrides = CASES[case]
    s = resolve_settings(task, preset=preset,
                         overrides={**overrides, "precision": precision, "compile": compile_mode})
    device = resolve_device(s["device"], what="device")
    torch.manual_seed(0)
    torch._dynamo.reset()
    if precision == "tf32":
        torch.set_float32_matmul_precision("high")
    else:
        torch.set_float32_matmul_precision("highest")
    model = build_task_model(task, attention, s).to(device)
    model.train()
    opt = task_optimizer(model, s)
    step_model = compile_for_training(model, compile_mode)
    xb, yb = (t.to(device) for t in get_task(task).train_batch(s, 0))
    t0 = time.perf_counter()
    for _ in range(warmup):
        loss = train_step(step_model, model, opt, xb, yb, s, device)
    _sync(device)
    warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = train_step(step_model, model, opt, xb, yb, s, device)
    _sync(device)
    ms = 1000 * (time.perf_counter() - t0) / steps
    value = loss.item()
    return {"case": case, "task": task, "attention": attention, "precision": precision, "compile": compile_mode,
            "ms_per_step": ms, "warmup_s": warm_s, "loss": value, "loss_finite": math.isfinite(value),
            "batch_size": s["batch_size"], "seq_len": xb.shape[1], "n_layer": s["n_layer"], "n_embd": s["n_embd"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    p.add_argument("--attentions", default="rope,path")
    p.add_argument("--precisions", default="bf16")
    p.add_argument("--compile", default="none,inductor,cudagraphs")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--set", action="append", default=[], metavar="CASE:key=value",
                   help="extra setting for one case (repeatable)")
    p.add_argument("--out", default="benchmarks/results/task-step.json")
    args = p.parse_args(argv)
    for item in args.set:
        case, _, kv = item.partition(":")
        if case not in CASES:
            raise SystemExit(f"--set: unknown case {case!r}; known: {', '.join(CASES)}")
        CASES[case][2].update(parse_overrides([kv]))
    rows = []
    result = {"command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]), "versions": library_versions(),
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "cases": {k: {"task": v[0], "preset": v[1], "overrides": v[2]} for k, v in CASES.items()},
              "rows": rows, "fastest": {}}
    for case in args.cases.split(","):
        for attention in args.attentions.split(","):
            for precision in args.precisions.split(","):
                for mode in args.compile.split(","):
                    try:
                        row = time_steps(case, attention, precision, mode, args.steps, args.warmup)
                    except Exception as err:  # noqa: BLE001 - the failure is this combination's result
                        row = {"case": case, "attention": attention, "precision": precision, "compile": mode,
                               "error": f"{type(err).__name__}: {str(err)[:1500]}"}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                    ok = [r for r in rows if r["case"] == case and r["attention"] == attention
                          and r.get("loss_finite")]
                    if ok:
                        best = min(ok, key=lambda r: r["ms_per_step"])
                        result["fastest"][f"{case}/{attention}"] = {k: best[k] for k in
                                                                    ("precision", "compile", "ms_per_step")}
                    atomic_write_text(args.out, json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
