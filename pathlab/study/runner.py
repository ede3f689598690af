"""Running a study's cells: train, evaluate, probe, and write the compact results.

A cell runs in four stages, each resumable:

1. train into ``runs/<study>/<cell>/`` (a checkpoint every ``train.ckpt_interval`` iterations);
2. evaluate r(L) at every evaluation length (``eval.json``, ``eval.csv``, ``eval_positions.csv``);
3. probe the model at the probe lengths (M2–M6) and reduce the measurements to a compact record
   (``probes.npz``);
4. write ``train.csv`` (the training curve) and ``cell.json`` (resolved config, revision, seeds, tokens, times).

``cell.json`` is written last, so a cell has results exactly when it has a ``cell.json`` whose fingerprint
matches the study's. A run that is cut off loses at most the stage in progress; with a deadline, training stops
at a checkpoint in time for the cell's evaluation and probes, and the same call continues it. The raw probe
measurements go to ``build/study-raw/<study>/<cell>/``; checkpoints stay in ``runs/<study>/<cell>/``.
"""

from __future__ import annotations

import csv
import io
import json
import sys
import time
from pathlib import Path

from pathlab.atomic import atomic_write_bytes
from pathlab.data.tokens import file_sha256
from pathlab.study.config import (cell_config, cell_fingerprint, cell_names, cell_results_dir, load_study,
                                  run_dir)
from pathlab.training.checkpoint import CKPT_NAME, PREV_NAME
from pathlab.training.config import repo_root

STAGES = ("train", "eval", "probes")
TRAIN_SECONDS_NAME = "study_train_seconds.json"  # in the run folder: training seconds over every call so far


class StudyPaused(RuntimeError):
    """The time budget ran out: training stopped at a checkpoint, and the same command continues the cell."""


def cell_status(study: dict, cell: str) -> str:
    """"done" (results match the config), "stale" (results from another config), "trained" (a finished run
    without results), "partial" (a checkpoint) or "missing"."""
    marker = cell_results_dir(study, cell) / "cell.json"
    if marker.is_file():
        try:
            recorded = json.loads(marker.read_text()).get("fingerprint")
        except ValueError:
            recorded = None
        return "done" if recorded == cell_fingerprint(study, cell) else "stale"
    run = run_dir(study, cell)
    if (run / "summary.json").is_file() and (run / "ckpt.pt").is_file():
        return "trained"
    return "partial" if (run / "ckpt.pt").is_file() else "missing"


def _add_train_seconds(run: Path, seconds: float) -> float:
    """Adds one call's training seconds to the cell's total and returns the total, so that a cell paused and
    continued reports the time of all its calls, not only of the last one."""
    path = run / TRAIN_SECONDS_NAME
    total = 0.0
    if path.is_file():
        try:
            total = float(json.loads(path.read_text())["train_s"])
        except (ValueError, KeyError, TypeError):
            print(f"pathlab study: {path} is damaged; the cell's training time counts from this call on",
                  file=sys.stderr, flush=True)
    total += seconds
    atomic_write_bytes(path, json.dumps({"train_s": total}).encode())
    return total


def _train_curve(run: Path) -> str:
    """``train.csv``: step, loss, lr, grad_norm, tokens_per_s every iteration, val_loss where evaluated."""
    rows = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        rows.setdefault(record["step"], {}).update(record)
    out = io.StringIO()
    w = csv.writer(out)
    fields = ["step", "loss", "lr", "grad_norm", "tokens_per_s", "val_loss"]
    w.writerow(fields)
    for step in sorted(rows):
        r = rows[step]
        w.writerow([step] + [("" if r.get(k) is None else f"{r[k]:.6g}") for k in fields[1:]])
    return out.getvalue()


def run_cell(study: dict, cell: str, *, deadline: float | None = None, device: str | None = None,
             progress: bool = True) -> str:
    """Train, evaluate and probe one cell (each stage skipped when already done); returns the cell's status.

    ``deadline``: a ``time.monotonic()`` instant; training stops at a checkpoint once less than the study's
    ``reserve_s`` is left before it (raises :class:`StudyPaused`).
    """
    import torch

    from pathlab.training import trainer as training
    from pathlab.training.evaluate import evaluate
    from pathlab.probes import records
    from pathlab.results import git_revision, library_versions, to_jsonable

    status = cell_status(study, cell)
    if status == "done":
        return status
    if status == "stale":
        raise ValueError(f"cell {cell!r}: {cell_results_dir(study, cell)} holds results of another config; delete "
                         "that folder to run the cell again, or give the changed cell a new name")
    cfg = cell_config(study, cell)
    run = run_dir(study, cell)
    out = cell_results_dir(study, cell)
    times, started = {}, time.time()
    if progress:
        print(f"[{study['name']}/{cell}] {status}: {cfg['model']['attention']} "
              f"{cfg['model'].get('attention_kwargs') or ''}, {cfg['train']['max_iters']} iterations", flush=True)
    t0 = time.monotonic()
    # Always through the trainer, also for a finished run: it refuses a run of another config (the cell was edited
    # after training) and continues one whose final checkpoint was corrupt, instead of evaluating an older model.
    train_deadline = None if deadline is None else deadline - float(study["reserve_s"])
    resume = any((run / name).is_file() for name in (CKPT_NAME, PREV_NAME))
    if not resume:  # a run that starts over starts its time over too
        (run / TRAIN_SECONDS_NAME).unlink(missing_ok=True)
    try:
        training.train(cfg, run_dir=run, resume=resume, progress=progress, deadline=train_deadline)
    except training.TrainingPaused:
        _add_train_seconds(run, time.monotonic() - t0)
        raise StudyPaused(f"cell {cell!r}: the time budget ran out during training; its checkpoint in {run} "
                          "is kept and the same command continues it") from None
    except training.RunMismatch as err:  # a run of the cell's earlier config: removing it is the way out
        raise ValueError(f"cell {cell!r}: {err} (for a study cell: remove {run} to train the cell again)") from None
    times["train_s"] = _add_train_seconds(run, time.monotonic() - t0)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    t0 = time.monotonic()
    ev = study["eval"]
    report = evaluate(run, ev.get("lengths", cfg["eval"]["lengths"]), n_windows=ev.get("n_windows"),
                      seed=ev.get("seed"), device=device, out=out, progress=progress)
    if report["checkpoint_step"] != cfg["train"]["max_iters"]:
        raise RuntimeError(f"cell {cell!r}: the evaluation read the checkpoint of iteration {report['checkpoint_step']}"
                           f", not the final one ({cfg['train']['max_iters']}): {run} changed during the cell; run "
                           "the cell again")
    times["eval_s"] = time.monotonic() - t0

    t0 = time.monotonic()
    model, run_cfg = training.load_run(run, device=device or ("cuda" if torch.cuda.is_available() else "cpu"))
    record, raw = records.measure_cell(model, run_cfg, study["probes"], progress=progress)
    records.save_record(out / "probes.npz", record)
    probes_sha256 = file_sha256(out / "probes.npz")  # binds the record to this cell (a JSON names its cell itself)
    raw_dir = (repo_root() or Path.cwd()) / "build" / "study-raw" / study["name"] / cell
    records.save_raw(raw_dir, raw)
    del model
    times["probes_s"] = time.monotonic() - t0

    summary = json.loads((run / "summary.json").read_text())
    env = json.loads((run / "env.json").read_text())
    atomic_write_bytes(out / "train.csv", _train_curve(run).encode())
    marker = {
        "study": study["name"], "cell": cell, "fingerprint": cell_fingerprint(study, cell),
        "group": study["cells"][cell].get("group"), "note": study["cells"][cell].get("note"),
        "attention": cfg["model"]["attention"], "attention_kwargs": cfg["model"].get("attention_kwargs", {}),
        "tokens": summary["tokens"], "iterations": summary["iterations"], "train_loss": summary["train_loss"],
        "val_loss": summary["val_loss"], "tokens_per_s": summary["tokens_per_s"],
        "parameters": summary["parameters"], "seed": cfg["train"]["seed"], "eval": study["eval"],
        "probes": study["probes"], "probes_sha256": probes_sha256, "config": cfg, "git_revision": git_revision(),
        "environment": env, "versions": library_versions(), "seconds": times,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "wall_s": time.time() - started,
    }
    atomic_write_bytes(out / "cell.json", json.dumps(to_jsonable(marker), indent=1).encode())
    if progress:
        print(f"[{study['name']}/{cell}] done in {marker['wall_s']:.0f} s ({', '.join(f'{k} {v:.0f}' for k, v in times.items())})"
              f" -> {out}", flush=True)
    return "done"


def run_study(study, cells=None, *, budget_s: float | None = None, device: str | None = None,
              progress: bool = True, fast: bool = False) -> dict:
    """Run every cell without results (or those in ``cells``), in order; returns ``{cell: status}``.

    With ``budget_s``, no stage starts that cannot finish before the budget's end: training pauses at a
    checkpoint (the cell reports "paused") and later cells are left for the next call ("not started").
    A failing cell is reported and the next one runs.
    """
    study = study if isinstance(study, dict) else load_study(study, fast=fast)
    names = list(study["cells"]) if cells is None else cell_names(study, cells)
    if device is not None:  # before any cell trains: a device that is not there fails the evaluation, not the run
        from pathlab.training.distributed import resolve_device

        resolve_device(device, what="device")
    deadline = None if budget_s is None else time.monotonic() + float(budget_s)
    out = {}
    for name in names:
        if deadline is not None and deadline - time.monotonic() < float(study["reserve_s"]):
            out[name] = "not started"
            continue
        try:
            out[name] = run_cell(study, name, deadline=deadline, device=device, progress=progress)
        except StudyPaused as err:
            print(f"pathlab study: {err}", file=sys.stderr, flush=True)
            out[name] = "paused"
        except Exception as err:  # noqa: BLE001  one broken cell must not cost the others their turn
            import traceback

            traceback.print_exc()
            print(f"pathlab study: cell {name!r} failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            out[name] = "failed"
    return out
