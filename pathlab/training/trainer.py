"""Language-model training: ``pathlab train --config NAME [--attention A] [--resume] [key=value ...]``.

The library call behind it is :func:`train`. One iteration is nanoGPT's: ``grad_accum`` micro-batches (split over
the processes under ``torchrun``), AdamW with decoupled weight decay on matrices only, a linear warm-up then a
cosine decay of the learning rate

    lr(it) = lr · (it + 1)/(warmup + 1)                                     for it < warmup
    lr(it) = min_lr + ½ (1 + cos(π (it − warmup)/(decay − warmup))) (lr − min_lr)   up to decay, then min_lr,

gradient clipping, bf16 autocast on CUDA and ``torch.compile`` where it helps. A run directory holds::

    config.yaml    the resolved config          env.json      versions, device, world size, git revision, corpus
    metrics.jsonl  one line per iteration (loss, lr, grad_norm, tokens_per_s) and per evaluation (val_loss)
    ckpt.pt        model, optimiser, step, RNG states, sampler position, corpus identity (pathlab.training.checkpoint:
                   atomic, checksummed, never non-finite)
    ckpt.prev.pt   the checkpoint before it (loaded when ckpt.pt is corrupt)
    summary.json   final numbers (written when the run completes)
    .lock          held by the trainer for the run's lifetime: a second trainer on the directory stops at once

``--resume`` continues a killed run from its checkpoint, on the same corpus (checked); on the CPU with the same
thread count the resumed losses equal the uninterrupted run's exactly. A NaN/inf loss or gradient norm stops
the run before the bad step is applied and leaves the last good checkpoint; so does a non-finite weight found
when checkpointing. A directory with an earlier run's files but no checkpoint is started over only for the same
config.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import yaml

from pathlab.atomic import DirectoryLock, DirectoryLocked, remove_stale_temporaries
from pathlab.data.batches import WindowSampler
from pathlab.data.corpus import CORPORA, check_corpus, corpus_dir, corpus_identity, corpus_meta, load_tokens, prepare
from pathlab.data.tokens import META, CorpusError, atomic_write_bytes, atomic_write_json
from pathlab.model import ModelConfig, build_model
from pathlab.results import git_revision
from pathlab.training import distributed
from pathlab.training.checkpoint import (
    CKPT_NAME,
    PREV_NAME,
    NonFiniteCheckpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from pathlab.training.config import config_diff, config_hash, repo_root, resolve_config
from pathlab.training.optimization import adamw, autocast, warmup_cosine

# Keys that may differ between a run and its resumption. log_interval does not change the trained numbers.
# train.threads does on the CPU: a parallel reduction's partial sums follow the thread count, so a resume on
# another count continues the run correctly but not bit-exactly (a notice says so); it stays allowed so that a
# run can move to a machine with fewer cores. train.compile changes the kernels, and so the rounding, too.
RESUME_MAY_CHANGE = ("train.log_interval", "train.threads", "train.compile")
# What a run writes into its directory (their stale temporary files are removed when a run starts).
RUN_FILES = ("config.yaml", "env.json", "metrics.jsonl", CKPT_NAME, PREV_NAME, "summary.json")


class TrainingPaused(RuntimeError):
    """The time limit (``deadline``) was reached: the run stopped at a checkpoint and ``resume=True`` continues it."""


class RunMismatch(ValueError):
    """The run directory holds a run of another config or corpus, which this call must not continue."""


class TrainingDiverged(RuntimeError):
    """The loss, the gradient norm or the weights became NaN or infinite; the run stopped before that state was
    used or saved, and its last good checkpoint is kept."""


def runs_root() -> Path:
    """``$PATHLAB_RUNS`` if set, else ``runs/`` in the repository root (or the working directory)."""
    if os.environ.get("PATHLAB_RUNS"):
        return Path(os.environ["PATHLAB_RUNS"]).expanduser()
    return (repo_root() or Path.cwd()) / "runs"


def default_run_dir(cfg: dict) -> Path:
    return runs_root() / cfg["name"] / cfg["model"]["attention"]


def learning_rate(it: int, optim: dict, max_iters: int) -> float:
    """nanoGPT's schedule: linear warm-up, cosine decay to ``min_lr`` at ``lr_decay_iters``, then constant
    (:func:`pathlab.training.optimization.warmup_cosine`, f = (it − warmup) / (decay − warmup))."""
    warmup, decay = optim["warmup_iters"], optim["lr_decay_iters"] or max_iters
    return warmup_cosine(it, warmup=warmup, fraction=(it - warmup) / max(1, decay - warmup),
                         lr=optim["lr"], min_lr=optim["min_lr"])


def make_optimizer(model: torch.nn.Module, optim: dict, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on parameters of 2+ dimensions (matrices, embeddings), fused on CUDA."""
    return adamw(model, lr=optim["lr"], betas=(optim["beta1"], optim["beta2"]),
                 weight_decay=optim["weight_decay"], fused=device.type == "cuda")


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def _clean_state_dict(state: dict) -> dict:
    out = {}
    for key, value in state.items():
        for prefix in ("_orig_mod.", "module."):
            key = key.replace(prefix, "")
        out[key] = value
    return out


def environment_info(ctx: distributed.DistContext) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
            "platform": platform.platform(), "device": str(ctx.device), "world_size": ctx.world_size,
            "threads": torch.get_num_threads(), "git_revision": git_revision()}
    if ctx.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(ctx.device)
        info["cuda"] = torch.version.cuda
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def _ensure_corpus(name: str, ctx: distributed.DistContext, progress: bool) -> Path:
    """The corpus folder; a known corpus that was never prepared is prepared first (on rank 0)."""
    folder = corpus_dir(name)
    if name in CORPORA and not (folder / META).exists():
        if ctx.is_main:
            print(f"corpus {name!r} is not prepared yet: preparing it now (`pathlab data prepare {name}`)", flush=True)
            prepare(name, progress=progress)
        ctx.barrier()
    return folder


def _check_data(cfg: dict, meta: dict) -> None:
    """Tokenizer, vocabulary and context checks between a config and its corpus."""
    tok = meta["tokenizer"]
    want = cfg["data"]["tokenizer"]
    if want is not None and want != tok["name"]:
        raise ValueError(
            f"tokenizer mismatch: the config expects data.tokenizer={want!r} but corpus {cfg['data']['corpus']!r} "
            f"was made with {tok['name']!r}; pick a corpus made with {want!r} or set data.tokenizer={tok['name']}"
        )
    vocab = cfg["model"].get("vocab_size")
    if vocab is not None and vocab < tok["vocab_size"]:
        raise ValueError(
            f"model.vocab_size={vocab} is smaller than the corpus tokenizer's {tok['vocab_size']} tokens; "
            "leave model.vocab_size unset to take it from the corpus"
        )
    longest = meta["splits"]["train"]["longest_document"]
    if cfg["data"]["block_size"] > longest:
        raise ValueError(
            f"data.block_size={cfg['data']['block_size']} is longer than the corpus's longest training document "
            f"({longest} tokens); use a shorter context or a corpus with longer documents"
        )


class _MetricsLog:
    """Append-only JSONL (rank 0); on resume, entries from iterations at or after the checkpoint are dropped, and
    so is a damaged line (a process killed mid-write), with a warning that names it: every other line is kept."""

    def __init__(self, path: Path, enabled: bool, keep_before: int | None):
        self.path, self.enabled = path, enabled
        if not enabled:
            return
        lines, damaged = [], []
        if keep_before is not None and path.exists():
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
                try:
                    if json.loads(line)["step"] < keep_before:
                        lines.append(line)
                except (json.JSONDecodeError, KeyError, TypeError):
                    damaged.append(number)
        if damaged:
            warnings.warn(f"{path}: dropped damaged line(s) {damaged}; the other entries are kept", stacklevel=2)
        atomic_write_bytes(path, "".join(line + "\n" for line in lines).encode())
        self.file = open(path, "a")

    def write(self, record: dict) -> None:
        if self.enabled:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.enabled:
            self.file.close()


def _autocast(cfg: dict, device: torch.device):
    dtype = cfg["train"]["dtype"]
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    return autocast(device, dtype == "bfloat16")


@torch.no_grad()
def estimate_loss(model, sampler: WindowSampler, iters: int, device, autocast) -> float:
    """Mean loss over ``iters`` fixed validation batches (the same windows at every evaluation)."""
    was_training = model.training
    model.eval()
    losses = []
    for k in range(iters):
        x, y = sampler.batch(0, k, device)
        with autocast():
            _, loss = model(x, y)
        losses.append(loss.float().item())
    model.train(was_training)
    return float(np.mean(losses))


def _prepare_run(config, overrides, ctx, progress):
    cfg = resolve_config(config, overrides)
    folder = _ensure_corpus(cfg["data"]["corpus"], ctx, progress)
    try:
        meta = corpus_meta(folder)
    except CorpusError as err:
        raise CorpusError(f"data.corpus={cfg['data']['corpus']!r}: {err}") from None
    _check_data(cfg, meta)
    model_section = dict(cfg["model"])
    if model_section.get("vocab_size") is None:
        model_section["vocab_size"] = -(-meta["tokenizer"]["vocab_size"] // 64) * 64  # padded like nanoGPT
    cfg["model"] = ModelConfig.from_dict(model_section).to_dict()
    if cfg["train"]["grad_accum"] % ctx.world_size:
        raise ValueError(
            f"train.grad_accum={cfg['train']['grad_accum']} must be a multiple of the number of processes "
            f"({ctx.world_size}): the global batch is batch_size x grad_accum sequences"
        )
    return cfg, folder, meta


def train(config, *, overrides=None, run_dir=None, resume: bool = False, progress: bool = True,
          deadline: float | None = None, _interrupt_at: int | None = None) -> Path:
    """Train a language model and return its run directory.

    ``config``: a name under ``configs/`` ("tiny-cpu", "h200-mini", "owt16"), a YAML path or a dict;
    ``overrides``: dict or list of ``"key=value"`` strings with dotted keys (``"model.attention=path"``);
    ``run_dir``: default ``runs/<config name>/<attention>/``; ``resume``: continue from ``run_dir/ckpt.pt``;
    ``deadline``: a ``time.monotonic()`` instant after which the run checkpoints and raises :class:`TrainingPaused`
    (for time-limited machines; the iteration that crosses it completes first).
    """
    ctx = distributed.setup(resolve_config(config, overrides)["train"]["device"])
    try:
        return _train(config, overrides, run_dir, resume, progress, ctx, _interrupt_at, deadline)
    finally:
        distributed.teardown()


def _train(config, overrides, run_dir, resume, progress, ctx, interrupt_at, deadline=None) -> Path:
    cfg, corpus_folder, meta = _prepare_run(config, overrides, ctx, progress)
    run_dir = Path(run_dir) if run_dir is not None else default_run_dir(cfg)
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"run_dir: {run_dir} is a file, not a run directory; choose another (`--run-dir`)")
    threads = torch.get_num_threads()
    with _locked(run_dir, ctx):
        try:
            return _train_locked(cfg, corpus_folder, meta, run_dir, resume, progress, ctx, interrupt_at, deadline)
        finally:
            torch.set_num_threads(threads)  # train.threads applies to the run, not to the rest of the process


@contextlib.contextmanager
def _locked(run_dir: Path, ctx: distributed.DistContext):
    """Hold ``run_dir/.lock`` (rank 0) for the run's lifetime; when another process holds it, every rank stops."""
    lock, problem = None, None
    if ctx.is_main:
        try:
            lock = DirectoryLock(run_dir).acquire()
        except DirectoryLocked as err:
            problem = str(err)
    problem = ctx.broadcast_object(problem)
    if problem is not None:
        raise DirectoryLocked(f"run directory {problem}")
    try:
        if ctx.is_main:
            remove_stale_temporaries(run_dir, RUN_FILES)  # left by a killed write; nobody else writes here now
        yield
    finally:
        if lock is not None:
            lock.release()


def _earlier_run_files(run_dir: Path) -> list[str]:
    return [name for name in ("config.yaml", "env.json", "metrics.jsonl", "summary.json") if (run_dir / name).exists()]


def _check_partial_run(run_dir: Path, cfg: dict, ctx: distributed.DistContext) -> None:
    """A directory with an earlier run's files but no checkpoint (a run stopped before its first checkpoint) is
    started over when its config is this one, and refused otherwise, so that no directory mixes two runs."""
    leftovers = _earlier_run_files(run_dir)
    if not leftovers:
        return
    try:
        earlier = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        earlier = None
    diff = config_diff(earlier, cfg, ignore=RESUME_MAY_CHANGE) if isinstance(earlier, dict) else [
        "config.yaml missing or unreadable"]
    if diff:
        raise ValueError(
            f"{run_dir} holds an earlier run ({', '.join(leftovers)}) that has no checkpoint and another config "
            f"({'; '.join(diff)}); delete those files or choose another run directory (`--run-dir`)"
        )
    if ctx.is_main:
        print(f"{run_dir} holds an earlier run of this config that stopped before its first checkpoint: starting it "
              "over (its metrics.jsonl is replaced)", flush=True)


def _check_resume(run_dir: Path, ckpt: dict, cfg: dict, meta: dict, ctx: distributed.DistContext) -> None:
    diff = config_diff(ckpt["config"], cfg, ignore=RESUME_MAY_CHANGE)
    if diff:
        raise RunMismatch(
            f"cannot resume {run_dir}: the config differs from the run's ({'; '.join(diff)}). Resume with the "
            "run's own config, or start a new run in another directory"
        )
    if ckpt.get("corpus") is not None:  # checkpoints before format 2 recorded no corpus identity
        try:
            check_corpus(ckpt, meta)
        except ValueError as err:
            raise RunMismatch(f"cannot resume {run_dir}: {err}") from None
    then = ckpt.get("threads")
    now = cfg["train"]["threads"] or torch.get_num_threads()
    if ctx.is_main and ctx.device.type == "cpu" and then is not None and then != now:
        print(f"note: resuming with {now} CPU threads where the run used {then} (train.threads): the run continues "
              "correctly, but not bit-exact with an uninterrupted run", flush=True)


def _train_locked(cfg, corpus_folder, meta, run_dir, resume, progress, ctx, interrupt_at, deadline) -> Path:
    tcfg, ocfg = cfg["train"], cfg["optim"]
    ckpt_path = run_dir / CKPT_NAME
    has_ckpt = ckpt_path.is_file() or (run_dir / PREV_NAME).is_file()
    identity = corpus_identity(meta)
    ckpt = None
    if resume:
        if not has_ckpt:
            leftovers = _earlier_run_files(run_dir)
            raise ValueError(
                f"cannot resume {run_dir}: it holds no checkpoint to resume from"
                + (f" (only {', '.join(leftovers)}: the earlier run stopped before its first checkpoint); start it "
                   "again without --resume" if leftovers else "; is this the run's directory?")
            )
        ckpt = load_checkpoint(ckpt_path)  # falls back to ckpt.prev.pt, with a warning, when ckpt.pt is corrupt
        _check_resume(run_dir, ckpt, cfg, meta, ctx)
        ctx.barrier()
        if ctx.is_main and ckpt["loaded_from"] != str(ckpt_path) and ckpt_path.exists():
            # set the corrupt file aside, so that the next save does not make it the previous checkpoint
            os.replace(ckpt_path, run_dir / "ckpt.corrupt.pt")
    elif has_ckpt:
        raise ValueError(
            f"{run_dir} already holds a checkpoint; pass resume=True (`--resume`) to continue that run, or choose "
            "another run directory (`--run-dir`); the existing checkpoint is left untouched"
        )
    else:
        _check_partial_run(run_dir, cfg, ctx)
    if ckpt is not None and int(ckpt["step"]) >= tcfg["max_iters"]:
        if ctx.is_main:
            if not (run_dir / "summary.json").is_file() and "summary" in ckpt:
                # stopped between the final checkpoint and its summary: the checkpoint carries the summary
                atomic_write_json(run_dir / "summary.json", ckpt["summary"])
            print(f"{run_dir} is already complete ({ckpt['step']} iterations); nothing to do", flush=True)
        return run_dir
    if tcfg["threads"] and ctx.device.type == "cpu":
        torch.set_num_threads(tcfg["threads"])

    torch.manual_seed(tcfg["seed"])
    model = build_model(ModelConfig.from_dict(cfg["model"])).to(ctx.device)
    fsdp = ctx.enabled and tcfg["distributed"] == "fsdp"
    start = 0
    if ckpt is not None:
        model.load_state_dict(_clean_state_dict(ckpt["model"]))
    compile_flag = tcfg["compile"] if tcfg["compile"] != "auto" else ctx.device.type == "cuda"
    if fsdp:  # shard first (parameters become DTensors), then compile the sharded blocks
        net = distributed.wrap_model(model, ctx, "fsdp")
        if compile_flag:
            for block in model.blocks:
                block.compile()
    else:
        net = torch.compile(model) if compile_flag else model
        net = distributed.wrap_model(net, ctx, "ddp")
    optimizer = make_optimizer(model, ocfg, ctx.device)
    if ckpt is not None:
        if fsdp:
            distributed.load_full_state_dicts(model, optimizer, _clean_state_dict(ckpt["model"]), ckpt["optimizer"])
        else:
            optimizer.load_state_dict(ckpt["optimizer"])
        start = int(ckpt["step"])
        set_rng_state(ckpt["rng"])
    autocast = _autocast(cfg, ctx.device)

    vocab = meta["tokenizer"]["vocab_size"]  # <= model.vocab_size (checked); ids at or above it are corruption
    train_tokens = load_tokens(corpus_folder, "train", vocab_size=vocab)
    val_tokens = load_tokens(corpus_folder, "val", vocab_size=vocab)
    block = cfg["data"]["block_size"]
    sampler = WindowSampler(train_tokens, block, tcfg["batch_size"], tcfg["seed"])
    val_sampler = WindowSampler(val_tokens, block, tcfg["batch_size"], tcfg["seed"] + 1)
    accum_local = tcfg["grad_accum"] // ctx.world_size
    micro_ids = range(ctx.rank * accum_local, (ctx.rank + 1) * accum_local)
    tokens_per_iter = tcfg["batch_size"] * block * tcfg["grad_accum"]

    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(run_dir / "config.yaml", yaml.safe_dump(cfg, sort_keys=False).encode())
        atomic_write_json(run_dir / "env.json", {**environment_info(ctx), "corpus": meta["name"],
                                                 "corpus_recipe_hash": meta.get("recipe_hash"),
                                                 "corpus_identity": identity})
        print(f"training {cfg['model']['attention']} ({model.num_parameters():,} parameters, "
              f"{model.num_parameters(non_embedding=True):,} non-embedding) on {meta['name']} "
              f"for {tcfg['max_iters']} iterations of {tokens_per_iter:,} tokens -> {run_dir}", flush=True)
    log = _MetricsLog(run_dir / "metrics.jsonl", ctx.is_main, keep_before=start if resume else 0)

    last_good = int(ckpt["step"]) if ckpt is not None else None

    def stopped(what: str) -> TrainingDiverged:
        kept = (f"The last good checkpoint (iteration {last_good}) in {run_dir} is kept. " if last_good is not None
                else "No checkpoint was written yet. ")
        return TrainingDiverged(f"{what}. {kept}Lower optim.lr, raise optim.warmup_iters or check the data, then "
                                "start a new run (another --run-dir, or delete this one)")

    def checkpoint(step: int, summary: dict | None = None) -> None:
        nonlocal last_good
        if fsdp:  # every rank takes part in gathering the shards
            model_state, optim_state = distributed.full_state_dicts(model, optimizer)
        else:
            model_state, optim_state = _unwrap(net).state_dict(), optimizer.state_dict()
        problem = None
        if ctx.is_main:
            try:
                save_checkpoint(ckpt_path, {
                    "model": _clean_state_dict(model_state), "optimizer": optim_state,
                    "step": step, "rng": rng_state(), "sampler": sampler.state(step), "config": cfg,
                    "config_hash": config_hash(cfg, RESUME_MAY_CHANGE), "model_config": cfg["model"],
                    "tokenizer": meta["tokenizer"], "corpus": identity, "threads": torch.get_num_threads(),
                    **({} if summary is None else {"summary": summary}),
                })
            except NonFiniteCheckpoint as err:
                problem = str(err)
        problem = ctx.broadcast_object(problem)  # also the barrier: every rank waits for rank 0's write
        if problem is not None:
            raise stopped(f"the state to checkpoint at iteration {step} is not finite ({problem}) although every "
                          "loss and gradient norm was; the checkpoint was not written")
        last_good = step

    bar = None
    if progress and ctx.is_main:
        from tqdm.auto import tqdm

        bar = tqdm(total=tcfg["max_iters"], initial=start, desc=f"train {cfg['model']['attention']}", unit="it")
    t_start = time.perf_counter()
    val_loss = None
    loss_value = float("nan")
    try:
        net.train()
        for it in range(start, tcfg["max_iters"]):
            if tcfg["eval_interval"] and it > 0 and it % tcfg["eval_interval"] == 0:
                val_loss = estimate_loss(net, val_sampler, tcfg["eval_iters"], ctx.device, autocast)
                log.write({"step": it, "val_loss": val_loss})
            t0 = time.perf_counter()
            lr = learning_rate(it, ocfg, tcfg["max_iters"])
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=ctx.device)
            for j, micro in enumerate(micro_ids):
                x, y = sampler.batch(it, micro, ctx.device)
                sync = contextlib.nullcontext()
                if fsdp:
                    net.set_requires_gradient_sync(j == accum_local - 1)
                elif ctx.enabled and j < accum_local - 1 and hasattr(net, "no_sync"):
                    sync = net.no_sync()
                with sync:
                    with autocast():
                        _, loss = net(x, y)
                    (loss / accum_local).backward()
                loss_sum += loss.detach().float()
            loss_mean = ctx.all_reduce_mean(loss_sum / accum_local)
            clip = ocfg["grad_clip"]
            params = [p for p in net.parameters() if p.grad is not None]
            grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
            if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
                grad_norm = grad_norm.full_tensor()
            # The iteration's one host sync: the loss and the gradient norm together, both checked before the step
            # commits (a finite loss can come with a NaN gradient, which AdamW would write into every weight).
            loss_value, grad_norm_value = torch.stack([loss_mean.float(), grad_norm.float()]).tolist()
            if not math.isfinite(loss_value):
                raise stopped(f"loss became {loss_value} at iteration {it}; the run stopped before applying that step")
            if not math.isfinite(grad_norm_value):
                raise stopped(f"gradient norm became {grad_norm_value} at iteration {it} (the loss, {loss_value:.4f}, "
                              "was finite); the run stopped before applying that step")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            log.write({"step": it, "loss": loss_value, "lr": lr, "grad_norm": grad_norm_value,
                       "tokens_per_s": tokens_per_iter / dt, "elapsed_s": time.perf_counter() - t_start})
            if bar is not None:
                bar.update(1)
                if it % tcfg["log_interval"] == 0:
                    bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{tokens_per_iter / dt:,.0f}")
            done = it + 1
            if tcfg["ckpt_interval"] and done % tcfg["ckpt_interval"] == 0 and done < tcfg["max_iters"]:
                checkpoint(done)
            if interrupt_at is not None and done == interrupt_at:
                raise KeyboardInterrupt(f"interrupted after iteration {done} (test hook)")
            if deadline is not None and done < tcfg["max_iters"] and _past(deadline, ctx):
                checkpoint(done)
                raise TrainingPaused(f"time limit reached after iteration {done} of {tcfg['max_iters']}; the "
                                     f"checkpoint in {run_dir} continues the run (resume=True, `--resume`)")
        val_loss = estimate_loss(net, val_sampler, tcfg["eval_iters"], ctx.device, autocast)
        log.write({"step": tcfg["max_iters"], "val_loss": val_loss})
        elapsed = time.perf_counter() - t_start
        summary = {
            "iterations": tcfg["max_iters"], "resumed_from": start if resume else None,
            "train_loss": loss_value, "val_loss": val_loss, "tokens": tcfg["max_iters"] * tokens_per_iter,
            "elapsed_s": elapsed, "tokens_per_s": (tcfg["max_iters"] - start) * tokens_per_iter / max(elapsed, 1e-9),
            "parameters": model.num_parameters(), "non_embedding_parameters": model.num_parameters(True),
        }
        checkpoint(tcfg["max_iters"], summary)  # carries the summary, should the process stop before writing it
    finally:
        if bar is not None:
            bar.close()
        log.close()
    if ctx.is_main:
        atomic_write_json(run_dir / "summary.json", summary)
        print(f"done: train loss {loss_value:.4f}, val loss {val_loss:.4f}, {elapsed:.1f}s -> {run_dir}", flush=True)
    return run_dir


def _past(deadline: float, ctx: distributed.DistContext) -> bool:
    """Whether any process has passed ``deadline`` (all processes stop at the same iteration)."""
    late = time.monotonic() >= deadline
    if not ctx.enabled:
        return late
    return bool(ctx.all_reduce_mean(torch.tensor(float(late), device=ctx.device)).item() > 0)


def load_run(run_dir, *, device="cpu"):
    """``(model, run_config)`` of a trained run: the model in eval mode with the checkpoint's weights.

    The checkpoint's checksum is verified; when ``ckpt.pt`` is corrupt, ``ckpt.prev.pt`` is used with a
    :class:`~pathlab.training.checkpoint.CheckpointFallbackWarning` (``run_config["checkpoint_step"]`` says which).
    ``run_config["corpus_identity"]`` is what :func:`pathlab.data.corpus.check_corpus` compares a corpus with.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run_dir: {run_dir} is not a directory")
    ckpt = load_checkpoint(run_dir / CKPT_NAME, map_location="cpu")
    model = build_model(ModelConfig.from_dict(ckpt["model_config"]))
    model.load_state_dict(_clean_state_dict(ckpt["model"]))
    model.to(device).eval()
    cfg = dict(ckpt["config"])
    cfg["checkpoint_step"] = ckpt["step"]
    cfg["tokenizer"] = ckpt.get("tokenizer")
    cfg["corpus_identity"] = ckpt.get("corpus")  # for pathlab.data.corpus.check_corpus (None before format 2)
    return model, cfg


# ------------------------------------------------------------------------------------------------ CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="tiny-cpu", help="config name under configs/ or a YAML path")
    parser.add_argument("--attention", default=None, help="attention variant (shortcut for model.attention=...)")
    parser.add_argument("--run-dir", default=None, help="run directory (default runs/<config>/<attention>/)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its checkpoint")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted config overrides, e.g. train.max_iters=100 optim.lr=3e-4")


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.attention:
        overrides.append(f"model.attention={args.attention}")
    try:
        train(args.config, overrides=overrides, run_dir=args.run_dir, resume=args.resume,
              progress=not args.no_progress)
    except (ValueError, RuntimeError) as err:
        print(f"pathlab train: {err}", file=sys.stderr)
        return 1
    return 0
