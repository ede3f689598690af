"""Train a small model on a state-tracking task and evaluate it: :func:`run_task`.

The model is the library's GPT (``pathlab.build_model``) with the chosen positional variant; the tasks are tagging
problems on its next-token head (targets aligned with the inputs, -1 where no loss is taken). Training draws fresh
seeded batches (no fixed training set, so no overfitting to memorise), uses AdamW with a linear warmup and a cosine
decay to ``min_lr_ratio * lr``, and stops at ``steps``, after ``max_seconds`` of training steps (the first step,
which compiles, and the evaluations are not counted) or when the quick evaluation of the task's primary metric
reaches ``stop_at``. With a time budget the schedule follows the larger of the step fraction and the time
fraction, so a time-bounded run still ends its decay. ``precision``: fp32, tf32 (fp32 with TF32 matmuls, set
process-wide) or bf16 (autocast). ``compile`` (none, inductor, aot_eager, cudagraphs) compiles the model of the
training step (:func:`compile_for_training`).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Mapping

import torch

from pathlab.tasks.settings import resolve_settings
from pathlab.tasks.specs import batch_counts, get_task, split_metrics
from pathlab.training.distributed import resolve_device
from pathlab.training.optimization import adamw, autocast, warmup_cosine

DATA_CHUNK = 8  # training batches generated per call of the (vectorised) generators


def build_task_model(task_name: str, attention: str, s: Mapping[str, Any]):
    """The GPT of the run: ``s`` gives depth, width, heads and the MLP ratio; the task gives the vocabulary."""
    from pathlab import ModelConfig, build_model

    task = get_task(task_name)
    cfg = ModelConfig(n_layer=s["n_layer"], n_head=s["n_head"], n_embd=s["n_embd"],
                      vocab_size=task.vocab_size(s), attention=attention,
                      attention_kwargs=dict(s["attention_kwargs"]), mlp_ratio=s["mlp_ratio"], dropout=0.0)
    return build_model(cfg)


def task_optimizer(model, s):
    """AdamW with weight decay on the matrices only (betas and decay from the settings)."""
    return adamw(model, lr=s["lr"], betas=(s["beta1"], s["beta2"]), weight_decay=s["weight_decay"])


def learning_rate(s: Mapping[str, Any], step: int, progress: float) -> float:
    """Linear warmup over ``warmup`` steps, then cosine from ``lr`` to ``min_lr_ratio * lr`` as ``progress``
    (fraction of the budget used, in [0, 1]) goes from the end of warmup to 1
    (:func:`pathlab.training.optimization.warmup_cosine`)."""
    warm = s["warmup"] / max(s["steps"], 1)
    return warmup_cosine(step, warmup=s["warmup"], fraction=(progress - warm) / max(1.0 - warm, 1e-9),
                         lr=s["lr"], min_lr=s["lr"] * s["min_lr_ratio"])


def compile_for_training(model, mode: str):
    """The module the training step calls: ``model`` itself ("none"), ``torch.compile`` with the Inductor or
    aot_eager backend, or Inductor with CUDA graphs ("cudagraphs", torch's ``mode="reduce-overhead"``: the whole
    forward and backward replay as two graph launches, which removes the per-kernel launch cost that dominates
    small models). The compiled module shares the parameters."""
    if mode == "none":
        return model
    if mode == "cudagraphs":
        return torch.compile(model, mode="reduce-overhead")
    return torch.compile(model, backend=mode)


def train_step(step_model, model, opt, xb, yb, s: Mapping[str, Any], device: torch.device) -> torch.Tensor:
    """One optimiser step on the batch (xb, yb): forward under the run's precision, backward, gradient clipping,
    AdamW. Returns the loss (not synchronised)."""
    if s["compile"] == "cudagraphs":
        torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs may be overwritten now
    with autocast(device, s["precision"] == "bf16")():
        _, loss = step_model(xb, yb)[:2]
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if s["grad_clip"] > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), s["grad_clip"])
    opt.step()
    return loss


@torch.no_grad()
def evaluate_model(model, task_name: str, s: Mapping[str, Any], *, quick: bool = False,
                   device: torch.device | None = None) -> dict[str, dict]:
    """Per-split metrics (see :func:`pathlab.tasks.specs.split_metrics`) on the task's held-out sets."""
    task = get_task(task_name)
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = {}
    for split, (x, y) in task.eval_sets(dict(s), quick).items():
        totals: dict[str, float] = {}
        for i in range(0, x.shape[0], s["eval_batch_size"]):
            xb = x[i:i + s["eval_batch_size"]].to(device)
            yb = y[i:i + s["eval_batch_size"]].to(device)
            with autocast(device, s["precision"] == "bf16")():
                logits, _ = model(xb, yb)[:2]
            for key, value in batch_counts(logits.float(), yb).items():
                totals[key] = totals.get(key, 0.0) + value
        out[split] = split_metrics(totals)
    model.train(was_training)
    return out


def run_task(task: str, attention: str, *, preset: str | None = None, overrides: Mapping[str, Any] | None = None,
             out: str | Path | None = None, progress: bool = True, command: str | None = None) -> dict:
    """Train and evaluate one model; returns the result record (also written atomically to ``out`` as JSON).

    Args:
        task: "flipflop", "a5" or "mqrar".
        attention: a registered variant name (``pathlab.available_attention()``).
        preset: a preset of ``configs/tasks/<task>.yaml`` ("tiny-cpu", "cpu", "h200"), or None for defaults.
        overrides: settings on top of the preset (see :mod:`pathlab.tasks.settings`).
        out: JSON path for the result, or None.
        progress: show a tqdm bar.
        command: the command line that produced the run, stored in the record.
    """
    from pathlab import available_attention

    if attention not in available_attention():
        raise ValueError(f"unknown attention {attention!r}; choose one of {', '.join(available_attention())}")
    spec = get_task(task)
    s = resolve_settings(task, preset=preset, overrides=overrides)
    if out is not None:
        check_output_file(out, "out")
    device = resolve_device(s["device"], what="device")
    if s["precision"] == "tf32":
        torch.set_float32_matmul_precision("high")  # process-wide: fp32 matmuls on TF32 tensor cores
    torch.manual_seed(s["seed"])
    model = build_task_model(task, attention, s).to(device)
    model.train()
    opt = task_optimizer(model, s)
    # the compiled module shares the parameters; evaluation keeps the eager model (other batch shapes)
    step_model = compile_for_training(model, s["compile"])

    history: list[dict] = []
    split, metric = spec.primary
    # `train_time` counts the training steps only: not the first step (compilation, autotuning) and not the
    # evaluations, so a time budget buys the same work whatever the warm-up costs
    stopped, t0, step, train_time = "steps", time.perf_counter(), 0, 0.0
    chunk: list = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=s["steps"], desc=f"{task}/{attention}", leave=False, dynamic_ncols=True)
    try:
        while step < s["steps"]:
            if s["max_seconds"] is not None and train_time >= s["max_seconds"]:
                stopped = "time"
                break
            frac = step / s["steps"]
            if s["max_seconds"] is not None:
                frac = max(frac, train_time / s["max_seconds"])
            t_step = time.perf_counter()
            lr = learning_rate(s, step, frac)
            for group in opt.param_groups:
                group["lr"] = lr
            if not chunk:
                x, y = spec.train_batch({**s, "batch_size": s["batch_size"] * DATA_CHUNK}, step // DATA_CHUNK)
                chunk = list(zip(x.split(s["batch_size"]), y.split(s["batch_size"])))
            xb, yb = (t.to(device, non_blocking=True) for t in chunk.pop(0))
            loss = train_step(step_model, model, opt, xb, yb, s, device)
            step += 1
            if step % s["eval_every"] == 0 or step == s["steps"]:
                value = loss.item()  # synchronises, so the step time below is complete
                if step > 1:
                    train_time += time.perf_counter() - t_step
                if not math.isfinite(value):
                    stopped = "diverged"
                    break
                quick = evaluate_model(model, task, s, quick=True, device=device)
                history.append({"step": step, "train_seconds": round(train_time, 3), "lr": lr,
                                "train_loss": value, metric: quick[split][metric]})
                if bar is not None:
                    bar.set_postfix(loss=f"{value:.4f}", **{metric: f"{quick[split][metric]:.4f}"})
                if s["stop_at"] is not None and quick[split][metric] >= s["stop_at"]:
                    stopped = "target"
                    break
            elif step > 1:
                train_time += time.perf_counter() - t_step
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    metrics = evaluate_model(model, task, s, device=device)
    record = {
        "task": task,
        "attention": attention,
        "preset": preset,
        "settings": s,
        "summary": spec.summary(metrics),
        "metrics": metrics,
        "steps": step,
        "stopped": stopped,
        "train_seconds": round(train_time, 2),
        "wall_seconds": round(time.perf_counter() - t0, 2),
        "n_params": int(sum(p.numel() for p in model.parameters())),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "path_backend": _kernel_backend(model, device),
        "history": history,
        "command": command,
    }
    if out is not None:
        write_json(out, record)
    return record


def _kernel_backend(model, device: torch.device) -> str | None:
    """Which kernel backend the run's variant used (PaTH: "triton" or "torch"; the record's ``path_backend``),
    from :meth:`~pathlab.attention.base.PositionalAttention.kernel_backend`; None for variants without a choice."""
    return model.blocks[0].attn.positional.kernel_backend(device)


def check_output_file(path: str | Path, argument: str) -> Path:
    """Refuse, before any training, a result path that cannot take a file (a directory, or a path under a file):
    the write at the end of the run would fail and lose the result."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{argument} {path} is a directory; give the path of a JSON file, e.g. "
                         f"{path / 'result.json'}")
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ValueError(f"{argument} {path} lies under {parent}, which is a file; choose another path")
    return path


def write_json(path: str | Path, record: Mapping) -> Path:
    """Atomically write a task record (with library versions and git revision) as indented JSON."""
    from pathlab.results import atomic_write_text, git_revision, library_versions, to_jsonable

    payload = dict(record)
    payload.setdefault("versions", library_versions())
    payload.setdefault("git_revision", git_revision())
    return atomic_write_text(path, json.dumps(to_jsonable(payload), indent=1, allow_nan=False) + "\n")
