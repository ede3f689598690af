"""Time a study cell's evaluation, length by length, on an untrained model of the cell's shape.

A study cell trains its model compiled (``torch.compile``) and then, in the same process, evaluates it eagerly at
every length of the study's protocol (``pathlab.training.evaluate.evaluate_model``). This script does the same
with a randomly initialised model: optionally a few compiled training steps first (so that the compiler holds
what training left it), then the evaluation on random tokens, printing each length's time with the compiler's
graph and recompile counts. The losses are meaningless; the times are the evaluation's. Usage (a GPU)::

    python benchmarks/bench_eval_lengths.py --study owt16-debian --cell fox --train-steps 3 --out eval-fox.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

import numpy as np
import torch
import torch._dynamo.utils as dynamo_utils

from pathlab.study import cell_config, load_study
from pathlab.model import ModelConfig, build_model
from pathlab.training.evaluate import autocast, evaluate_model
from pathlab.training.trainer import make_optimizer


def compiler_counts() -> dict:
    stats = dict(dynamo_utils.counters["stats"])
    recompiles = sum(dynamo_utils.counters["recompiles"].values()) if "recompiles" in dynamo_utils.counters else 0
    return {"unique_graphs": stats.get("unique_graphs", 0), "recompiles": recompiles}


def train_steps(model, steps: int, cfg: dict, vocab: int) -> float:
    """``steps`` compiled steps on random tokens with the trainer's optimiser and batch shape; returns the seconds."""
    net = torch.compile(model)
    opt = make_optimizer(model, cfg["optim"], torch.device("cuda"))
    batch, block = cfg["train"]["batch_size"], cfg["data"]["block_size"]
    model.train()
    t0 = time.perf_counter()
    for _ in range(steps):
        x = torch.randint(vocab, (batch, block + 1), device="cuda")
        with autocast(torch.device("cuda")):
            _, loss = net(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", default="owt16-debian")
    parser.add_argument("--cell", required=True)
    parser.add_argument("--train-steps", type=int, default=0, help="compiled training steps before the evaluation")
    parser.add_argument("--lengths", default=None, help="comma-separated; default: the study's")
    parser.add_argument("--n-windows", type=int, default=None, help="default: the study's")
    parser.add_argument("--val-tokens", type=int, default=1_080_000, help="size of the random validation split")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    study = load_study(args.study)
    cfg = cell_config(study, args.cell)
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else cfg["eval"]["lengths"]
    n_windows = args.n_windows or cfg["eval"]["n_windows"]
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_dict(cfg["model"])).cuda()
    vocab, block = model.config.vocab_size, cfg["data"]["block_size"]
    report = {"command": " ".join(["python"] + sys.argv), "study": args.study, "cell": args.cell,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "train_steps": args.train_steps,
              "n_windows": n_windows, "lengths": {}}
    if args.train_steps:
        report["train_s"] = train_steps(model, args.train_steps, cfg, vocab)
        report["after_training"] = compiler_counts()
        print(json.dumps({"train_s": report["train_s"], **report["after_training"]}), flush=True)
    val = np.random.default_rng(0).integers(0, vocab, args.val_tokens, dtype=np.int64)
    for L in lengths:
        n = min(n_windows, (len(val) - 1) // L)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            evaluate_model(model, val, [L], block, n_windows=n, seed=1234, progress=False)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        row = {"seconds": seconds, "n_windows": n, **compiler_counts(),
               "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
               "warnings": sorted({str(w.message)[:160] for w in caught})}
        print(json.dumps({"L": L, **row}), flush=True)
        report["lengths"][L] = row
        torch.cuda.reset_peak_memory_stats()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
