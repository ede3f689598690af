"""Length-extrapolation evaluation: ``pathlab eval RUN --lengths 512,1024,...,65536``.

For each length L, the validation split is cut into non-overlapping windows of L + 1 tokens starting at a random
offset, and ``n_windows`` of them are chosen; both choices use ``seed + L`` only, so every model sees the same
windows (docs/theory.md#m7). A window gives L next-token predictions; then

    loss(L) = mean over windows and positions of −log p(x_{t+1} | x_{≤t}),   PPL(L) = exp(loss(L)),
    ratio(L) = PPL(L) / PPL(train length),

and the per-position loss is averaged in log-spaced buckets [0, 1), [1, 2), [2, 4), ..., [2^k, L). Nothing of size
L × L is materialised here; the attention variants' fast paths (SDPA/FlexAttention/Triton on CUDA) keep memory
linear in L. Results go to ``eval.json`` (everything) and ``eval.csv`` / ``eval_positions.csv`` (tables) in the
run directory, written atomically.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from pathlab.data.corpus import corpus_meta, load_tokens
from pathlab.data.tokens import atomic_write_bytes, atomic_write_json


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


def _autocast(device: torch.device, dtype: str):
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    if dtype == "bfloat16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    import contextlib

    return contextlib.nullcontext()


@torch.no_grad()
def per_position_loss(model, windows: torch.Tensor, device, dtype: str = "auto", chunk: int = 8192) -> torch.Tensor:
    """Next-token losses ``[n, L]`` (fp32, on the CPU) of ``windows [n, L + 1]`` one window at a time."""
    out = []
    for w in windows:
        x = w[None, :-1].to(device)
        y = w[None, 1:].to(device)
        with _autocast(device, dtype):
            logits, _ = model(x)
        losses = torch.empty(y.shape[1], dtype=torch.float32, device=device)
        for s in range(0, y.shape[1], chunk):  # fp32 cross-entropy in chunks: no full fp32 copy of the logits
            losses[s : s + chunk] = torch.nn.functional.cross_entropy(
                logits[0, s : s + chunk].float(), y[0, s : s + chunk], reduction="none")
        del logits
        out.append(losses.cpu())
    return torch.stack(out)


def evaluate(run_dir, lengths, *, n_windows: int | None = None, seed: int | None = None, device=None,
             out=None, dtype: str = "auto", progress: bool = True) -> dict:
    """Perplexity of a trained run at each of ``lengths`` on fixed held-out windows; writes eval.json/eval.csv.

    ``n_windows``/``seed`` default to the run config's ``eval`` section; ``device`` defaults to CUDA when
    available; ``out`` is the output folder (default: the run directory). Returns the eval.json dict.
    """
    from pathlab.train import load_run

    run_dir = Path(run_dir)
    if isinstance(lengths, str):
        lengths = [int(v) for v in lengths.split(",") if v.strip()]
    lengths = [int(v) for v in lengths]
    if not lengths or any(v < 2 for v in lengths):
        raise ValueError(f"lengths: expected integers >= 2, got {lengths}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, cfg = load_run(run_dir, device=device)
    n_windows = int(n_windows if n_windows is not None else cfg["eval"]["n_windows"])
    seed = int(seed if seed is not None else cfg["eval"]["seed"])
    if n_windows < 1:
        raise ValueError(f"n_windows must be >= 1, got {n_windows}")
    corpus = cfg["data"]["corpus"]
    meta = corpus_meta(corpus)
    trained_with = (cfg.get("tokenizer") or {}).get("name")
    if trained_with is not None and trained_with != meta["tokenizer"]["name"]:
        raise ValueError(f"tokenizer mismatch: the run was trained with {trained_with!r} tokens but corpus {corpus!r} "
                         f"now holds {meta['tokenizer']['name']!r} tokens; prepare the run's corpus again")
    val = load_tokens(corpus, "val")
    train_len = int(cfg["data"]["block_size"])
    all_lengths = sorted(set(lengths) | {train_len})
    results = {}
    for L in all_lengths:
        starts = window_starts(len(val), L, n_windows, seed)
        windows = torch.from_numpy(np.stack([np.asarray(val[s : s + L + 1], dtype=np.int64) for s in starts]))
        t0 = time.perf_counter()
        losses = per_position_loss(model, windows, device, dtype)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t0
        if not torch.isfinite(losses).all():
            raise RuntimeError(f"non-finite loss at length {L}: the model or its attention backend overflowed")
        mean = float(losses.double().mean())
        buckets = [{"start": a, "stop": b, "loss": float(losses[:, a:b].double().mean())}
                   for a, b in position_buckets(L)]
        results[L] = {"loss": mean, "ppl": math.exp(mean), "n_windows": int(len(starts)),
                      "tokens": int(losses.numel()), "seconds": elapsed, "window_starts": starts.tolist(),
                      "buckets": buckets}
        if progress:
            print(f"  L={L:>6}: loss {mean:.4f}  ppl {math.exp(mean):10.3f}  ({len(starts)} windows, "
                  f"{elapsed:.1f}s)", flush=True)
    base = results[train_len]["ppl"]
    for r in results.values():
        r["ratio"] = r["ppl"] / base
    report = {
        "run": run_dir.name, "attention": cfg["model"]["attention"], "corpus": meta["name"],
        "tokenizer": meta["tokenizer"]["name"], "train_length": train_len, "checkpoint_step": cfg["checkpoint_step"],
        "protocol": "non-overlapping windows of L+1 tokens from the validation split, chosen with seed + L",
        "n_windows": n_windows, "seed": seed, "device": str(device), "dtype": dtype,
        "lengths": {str(L): results[L] for L in all_lengths if L in lengths or L == train_len},
    }
    out = Path(out) if out is not None else run_dir
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "eval.json", report)
    table = io.StringIO()
    w = csv.writer(table)
    w.writerow(["length", "loss", "ppl", "ratio", "n_windows", "tokens"])
    for L in all_lengths:
        r = results[L]
        w.writerow([L, f"{r['loss']:.6f}", f"{r['ppl']:.6f}", f"{r['ratio']:.6f}", r["n_windows"], r["tokens"]])
    atomic_write_bytes(out / "eval.csv", table.getvalue().encode())
    table = io.StringIO()
    w = csv.writer(table)
    w.writerow(["length", "start", "stop", "loss"])
    for L in all_lengths:
        for b in results[L]["buckets"]:
            w.writerow([L, b["start"], b["stop"], f"{b['loss']:.6f}"])
    atomic_write_bytes(out / "eval_positions.csv", table.getvalue().encode())
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run directory (runs/<config>/<attention>/)")
    parser.add_argument("--lengths", default=None, help="comma-separated, e.g. 512,1024,2048 (default: the config's)")
    parser.add_argument("--n-windows", type=int, default=None, help="windows per length (default: the config's)")
    parser.add_argument("--seed", type=int, default=None, help="window seed (default: the config's)")
    parser.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when available)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--out", default=None, help="output folder (default: the run directory)")


def run(args: argparse.Namespace) -> int:
    try:
        lengths = args.lengths
        if lengths is None:
            from pathlab.train import load_run

            lengths = load_run(args.run)[1]["eval"]["lengths"]
        report = evaluate(args.run, lengths, n_windows=args.n_windows, seed=args.seed, device=args.device,
                          out=args.out, dtype=args.dtype)
    except (ValueError, RuntimeError) as err:
        print(f"pathlab eval: {err}", file=sys.stderr)
        return 1
    print(f"{'length':>8} {'ppl':>10} {'ratio':>8}")
    for L, r in report["lengths"].items():
        print(f"{L:>8} {r['ppl']:>10.3f} {r['ratio']:>8.3f}")
    return 0
