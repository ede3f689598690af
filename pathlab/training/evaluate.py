"""Length-extrapolation evaluation (M7), one protocol for the CLI, the study and the notebooks.

``pathlab eval RUN --lengths 512,1024,...,65536``; the library calls are :func:`evaluate` (a run directory) and
:func:`evaluate_model` (a model and a token split).

Protocol. For each length L the validation split is cut into non-overlapping windows of L + 1 tokens from a
random offset, and ``n_windows`` of them are chosen (all that fit when fewer do); both choices depend on
``seed + L`` only, so every model sees the same windows. A window gives L next-token losses ℓ_t. The same L
targets are scored twice:

* with the whole window as context: loss(L) = mean_t ℓ_t;
* with the context cut every L_train tokens (the window read as L / L_train independent training-length
  chunks): loss_train(L), the in-distribution loss of exactly the same tokens;

and the perplexity ratio is

    r(L) = PPL(L) / PPL_train(L) = exp(loss(L) − loss_train(L)),

so r(L) compares the same predicted tokens with long and with training-length context, free of the variance
between texts that a separate PPL(L_train) measurement would add. Its 95% interval comes from a bootstrap over
windows (windows resampled with replacement, r recomputed). The per-position loss is averaged in log-spaced
buckets [0, 1), [1, 2), [2, 4), …, for both contexts. Nothing of size L × L is materialised, and the vocabulary
projection runs in position chunks, so memory stays linear in L.

NTK-scaled RoPE (M8 c) evaluates a RoPE model with base · s^{D/(D−2)}, s = L / L_train, at every length.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from pathlab.atomic import atomic_write_bytes
from pathlab.attention.registry import attention_class
from pathlab.attention.rope import RoPE
from pathlab.data.corpus import check_corpus, corpus_meta, load_tokens
from pathlab.data.tokens import atomic_write_json
from pathlab.intervals import bootstrap_ratio
from pathlab.training.distributed import resolve_device
from pathlab.training.trainer import load_run

PROTOCOL = ("non-overlapping windows of L + 1 validation tokens chosen with seed + L; the same targets scored with "
            "the whole window and with the context cut every training length; r = exp(loss - loss_train)")


def window_starts(n_tokens: int, length: int, n_windows: int, seed: int) -> np.ndarray:
    """Starts of ``n_windows`` non-overlapping windows of ``length + 1`` tokens (fixed by ``seed + length``)."""
    span = length + 1
    available = n_tokens // span
    if available < 1:
        raise ValueError(f"lengths: {length} needs {span} validation tokens, the split has only {n_tokens}")
    rng = np.random.default_rng(seed + length)
    offset = int(rng.integers(0, n_tokens - available * span + 1))
    chosen = np.sort(rng.choice(available, size=min(n_windows, available), replace=False))
    return offset + chosen * span


def position_buckets(length: int) -> list[tuple[int, int]]:
    """Log-spaced position buckets [0,1), [1,2), [2,4), ..., the last one ending at ``length``."""
    edges = [0, 1]
    while edges[-1] < length:
        edges.append(min(edges[-1] * 2, length))
    return list(zip(edges[:-1], edges[1:]))


def autocast(device: torch.device, dtype: str = "auto"):
    """bf16 autocast on CUDA ("auto"), none on the CPU; ``dtype`` "float32" or "bfloat16" forces one."""
    if dtype not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"dtype must be auto, float32 or bfloat16, got {dtype!r}")
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    if dtype == "bfloat16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def token_losses(model, windows: torch.Tensor, *, dtype: str = "auto", batch_tokens: int = 65536,
                 vocab_chunk: int = 8192) -> torch.Tensor:
    """Next-token losses ``[n, L]`` (fp32, CPU) of ``windows [n, L + 1]``: ℓ_t = −log p(x_{t+1} | x_{≤t}).

    Windows are batched up to ``batch_tokens`` tokens per forward; the vocabulary projection and the
    cross-entropy run ``vocab_chunk`` positions at a time, so no [B, L, V] fp32 logits are ever formed.
    """
    if windows.ndim != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be [n, L + 1] token ids with L >= 1, got shape {tuple(windows.shape)}")
    model.eval()
    device = next(model.parameters()).device
    n, L = windows.shape[0], windows.shape[1] - 1
    per_batch = max(1, batch_tokens // L)
    out = []
    for b0 in range(0, n, per_batch):
        w = windows[b0:b0 + per_batch].to(device)
        idx, targets = w[:, :-1], w[:, 1:]
        with autocast(device, dtype):
            x = model.drop(model.wte(idx))
            for block in model.blocks:
                x = block(x, idx)
            x = model.ln_f(x)
            losses = torch.empty(idx.shape, dtype=torch.float32, device=device)
            for s in range(0, L, vocab_chunk):
                logits = model.lm_head(x[:, s:s + vocab_chunk]).float()
                losses[:, s:s + vocab_chunk] = F.cross_entropy(
                    logits.transpose(1, 2), targets[:, s:s + vocab_chunk], reduction="none")
        out.append(losses.cpu())
    return torch.cat(out)


def train_context_losses(model, windows: torch.Tensor, train_length: int, **kwargs) -> torch.Tensor:
    """The losses of :func:`token_losses` with the context cut every ``train_length`` tokens: ``[n, L]``.

    Chunk c of a window holds its tokens c·L_train … (c + 1)·L_train, so it predicts the window's targets
    c·L_train … (c + 1)·L_train − 1 from the chunk's own prefix. L must be a multiple of L_train.
    """
    n, L = windows.shape[0], windows.shape[1] - 1
    if L % train_length:
        raise ValueError(f"length {L} must be a multiple of the training length {train_length}")
    chunks = torch.stack([windows[:, c:c + train_length + 1] for c in range(0, L, train_length)], dim=1)
    losses = token_losses(model, chunks.reshape(-1, train_length + 1), **kwargs)  # [n · L/L_train, L_train]
    return losses.reshape(n, L)


def ntk_base(base: float, scale: float, head_dim: int) -> float:
    """NTK-aware RoPE base for a length scale s ≥ 1: base · s^{D/(D−2)}."""
    return float(base * max(scale, 1.0) ** (head_dim / (head_dim - 2)))


@contextlib.contextmanager
def rope_base(model, base: float):
    """Temporarily set the base of every RoPE layer of ``model``."""
    mods = [b.attn.positional for b in model.blocks if isinstance(b.attn.positional, RoPE)]
    if not mods:
        raise ValueError("rope_base needs a model with RoPE layers")
    old = [m.base for m in mods]
    try:
        for m in mods:
            m.base = float(base)
        yield model
    finally:
        for m, b in zip(mods, old):
            m.base = b


def _length_result(losses: torch.Tensor, losses_train: torch.Tensor, starts, seconds: float, seed: int) -> dict:
    long_w = losses.double().mean(1).numpy()
    train_w = losses_train.double().mean(1).numpy()
    loss, loss_train = float(long_w.mean()), float(train_w.mean())
    L = losses.shape[1]
    buckets = [{"start": a, "stop": b, "loss": float(losses[:, a:b].double().mean()),
                "loss_train_context": float(losses_train[:, a:b].double().mean())} for a, b in position_buckets(L)]
    return {"loss": loss, "loss_train_context": loss_train, "ppl": math.exp(loss),
            "ppl_train_context": math.exp(loss_train), "ratio": math.exp(loss - loss_train),
            "ratio_ci95": list(bootstrap_ratio(long_w, train_w, seed=seed + L)),
            "n_windows": int(len(starts)), "tokens": int(losses.numel()), "seconds": seconds,
            "window_starts": [int(s) for s in starts], "window_loss": long_w.tolist(),
            "window_loss_train_context": train_w.tolist(), "buckets": buckets}


def evaluate_model(model, val_tokens, lengths, train_length: int, *, n_windows: int, seed: int,
                   dtype: str = "auto", ntk: bool = False, progress: bool = True) -> dict:
    """r(L) and per-position losses of ``model`` at each of ``lengths`` (the protocol in the module docstring).

    ``val_tokens``: the validation split (a 1-d token array); ``lengths``: multiples of ``train_length``.
    Returns ``{"lengths": {L: result}}`` and, with ``ntk`` (RoPE models), ``{"ntk": {L: result}}`` for the
    NTK-scaled base, whose training-context loss is the unscaled model's (s = 1 on a training-length chunk).
    """
    lengths = check_lengths(lengths, train_length)
    if not isinstance(n_windows, int) or n_windows < 1:
        raise ValueError(f"n_windows must be a positive integer, got {n_windows!r}")
    device = next(model.parameters()).device
    head_dim = model.config.n_embd // model.config.n_head
    out = {"lengths": {}, **({"ntk": {}} if ntk else {})}
    starts_at = {L: window_starts(len(val_tokens), L, n_windows, seed) for L in lengths}  # every length checked first
    for L in lengths:
        starts = starts_at[L]
        windows = torch.from_numpy(np.stack([np.asarray(val_tokens[s:s + L + 1], dtype=np.int64) for s in starts]))
        t0 = time.perf_counter()
        losses_train = train_context_losses(model, windows, train_length, dtype=dtype)
        losses = losses_train if L == train_length else token_losses(model, windows, dtype=dtype)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        for name, t in (("long-context", losses), ("training-context", losses_train)):
            if not torch.isfinite(t).all():
                raise RuntimeError(f"non-finite {name} loss at length {L}: the model or its attention backend "
                                   "overflowed")
        result = _length_result(losses, losses_train, starts, time.perf_counter() - t0, seed)
        out["lengths"][L] = result
        if ntk:
            base = model.blocks[0].attn.positional.base
            with rope_base(model, ntk_base(base, L / train_length, head_dim)):
                scaled = token_losses(model, windows, dtype=dtype) if L > train_length else losses
            out["ntk"][L] = _length_result(scaled, losses_train, starts, 0.0, seed)
        if progress:
            lo, hi = result["ratio_ci95"]
            print(f"  L={L:>6}: loss {result['loss']:.4f} (training context {result['loss_train_context']:.4f})  "
                  f"r = {result['ratio']:.3f} [{lo:.3f}, {hi:.3f}]  ({len(starts)} windows, "
                  f"{result['seconds']:.1f}s)", flush=True)
    return out


def check_lengths(lengths, train_length: int) -> list[int]:
    """Evaluation lengths as sorted distinct integers, each a multiple of the training length (which is added)."""
    if isinstance(lengths, str):
        try:
            lengths = [int(v) for v in lengths.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"lengths: expected comma-separated integers, got {lengths!r}") from None
    try:
        values = [int(v) for v in lengths]
    except (TypeError, ValueError):
        raise ValueError(f"lengths: expected integers, got {lengths!r}") from None
    bad = [v for v in values if v < train_length or v % train_length]
    if not values or bad:
        raise ValueError(f"lengths: expected multiples of the training length {train_length} (>= it), got {lengths}")
    return sorted(set(values) | {train_length})


def write_tables(report: dict, out: Path) -> None:
    """``eval.csv`` (one row per length, and per NTK length) and ``eval_positions.csv`` (per position bucket)."""
    table = io.StringIO()
    w = csv.writer(table)
    w.writerow(["scaling", "length", "loss", "loss_train_context", "ratio", "ratio_lo", "ratio_hi", "n_windows",
                "tokens"])
    positions = io.StringIO()
    p = csv.writer(positions)
    p.writerow(["scaling", "length", "start", "stop", "loss", "loss_train_context"])
    for scaling in ("lengths", "ntk"):
        for L, r in report.get(scaling, {}).items():
            name = "none" if scaling == "lengths" else "ntk"
            w.writerow([name, L, f"{r['loss']:.6f}", f"{r['loss_train_context']:.6f}", f"{r['ratio']:.6f}",
                        f"{r['ratio_ci95'][0]:.6f}", f"{r['ratio_ci95'][1]:.6f}", r["n_windows"], r["tokens"]])
            for b in r["buckets"]:
                p.writerow([name, L, b["start"], b["stop"], f"{b['loss']:.6f}", f"{b['loss_train_context']:.6f}"])
    atomic_write_bytes(out / "eval.csv", table.getvalue().encode())
    atomic_write_bytes(out / "eval_positions.csv", positions.getvalue().encode())


def evaluate(run_dir, lengths, *, n_windows: int | None = None, seed: int | None = None, device=None,
             out=None, dtype: str = "auto", ntk: bool | None = None, progress: bool = True) -> dict:
    """Evaluate a trained run (:func:`evaluate_model`) and write ``eval.json``, ``eval.csv``, ``eval_positions.csv``.

    ``n_windows``/``seed`` default to the run config's ``eval`` section; ``device`` to CUDA when available;
    ``out`` to the run directory; ``ntk`` to True for RoPE runs. Returns the eval.json dict.
    """
    run_dir = Path(run_dir)
    device = resolve_device(device or "auto", what="device")
    model, cfg = load_run(run_dir, device=device)
    n_windows = int(n_windows if n_windows is not None else cfg["eval"]["n_windows"])
    seed = int(seed if seed is not None else cfg["eval"]["seed"])
    corpus = cfg["data"]["corpus"]
    meta = corpus_meta(corpus)
    trained_with = (cfg.get("tokenizer") or {}).get("name")
    if trained_with is not None and trained_with != meta["tokenizer"]["name"]:
        raise ValueError(f"tokenizer mismatch: the run was trained with {trained_with!r} tokens but corpus {corpus!r} "
                         f"now holds {meta['tokenizer']['name']!r} tokens; prepare the run's corpus again")
    check_corpus(cfg, meta)  # a rebuilt corpus (other package versions) would change the answer silently
    train_length = int(cfg["data"]["block_size"])
    is_rope = issubclass(attention_class(cfg["model"]["attention"]), RoPE)
    if ntk and not is_rope:
        raise ValueError(f"ntk: NTK scaling applies to RoPE models, this run uses {cfg['model']['attention']!r}")
    val = load_tokens(corpus, "val", vocab_size=meta["tokenizer"]["vocab_size"])
    results = evaluate_model(model, val, lengths, train_length, n_windows=n_windows,
                             seed=seed, dtype=dtype, ntk=is_rope if ntk is None else ntk, progress=progress)
    report = {
        "run": run_dir.name, "attention": cfg["model"]["attention"], "corpus": meta["name"],
        "tokenizer": meta["tokenizer"]["name"], "train_length": train_length,
        "checkpoint_step": cfg["checkpoint_step"], "protocol": PROTOCOL, "n_windows": n_windows, "seed": seed,
        "device": str(device), "dtype": dtype,
        **{k: {str(L): r for L, r in v.items()} for k, v in results.items()},
    }
    out = Path(out) if out is not None else run_dir
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "eval.json", report)
    write_tables(report, out)
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run directory (runs/<config>/<attention>/)")
    parser.add_argument("--lengths", default=None,
                        help="comma-separated multiples of the training length, e.g. 512,1024,2048 (default: the "
                             "config's)")
    parser.add_argument("--n-windows", type=int, default=None, help="windows per length (default: the config's)")
    parser.add_argument("--seed", type=int, default=None, help="window seed (default: the config's)")
    parser.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when available)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--out", default=None, help="output folder (default: the run directory)")


def run(args: argparse.Namespace) -> int:
    try:
        lengths = args.lengths
        if lengths is None:
            lengths = load_run(args.run)[1]["eval"]["lengths"]
        report = evaluate(args.run, lengths, n_windows=args.n_windows, seed=args.seed, device=args.device,
                          out=args.out, dtype=args.dtype)
    except (ValueError, RuntimeError) as err:
        print(f"pathlab eval: {err}", file=sys.stderr)
        return 1
    print(f"{'length':>8} {'loss':>8} {'ratio':>8}  95% interval")
    for L, r in report["lengths"].items():
        print(f"{L:>8} {r['loss']:>8.4f} {r['ratio']:>8.3f}  [{r['ratio_ci95'][0]:.3f}, {r['ratio_ci95'][1]:.3f}]")
    return 0
