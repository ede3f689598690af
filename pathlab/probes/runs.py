"""Trained runs for the model-based figures, and the validation windows they are probed on.

Runs live in ``runs/<profile>/<attention>/`` (``runs/<profile>-fast/<attention>/`` for CI-sized runs), written by
the language-model pipeline (:func:`pathlab.train.train`, :func:`pathlab.train.load_run`). For ``tiny-cpu`` a missing
run is trained on the spot (about a minute per variant on 2 CPU cores); for the other profiles the error message gives
the command that produces it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

FAST_OVERRIDES = {"train.max_iters": 30, "train.ckpt_interval": 0, "train.eval_interval": 0, "train.eval_iters": 1,
                  "optim.warmup_iters": 5}

# The variants a fast (CI-sized) run trains: a few dozen steps each.
FAST_VARIANTS = ("rope", "alibi", "rot_random_qk", "rot_random_qkv")

# Variants (and named ablations) the notebooks use: name -> (attention, attention_kwargs)
VARIANTS = {
    "rope": ("rope", {}),
    "alibi": ("alibi", {}),
    "fox": ("fox", {}),
    "path": ("path", {}),
    "path_fox": ("path_fox", {}),
    "rot_random_qk": ("rot_random_qk", {}),
    "rot_random_qkv": ("rot_random_qkv", {}),
    "rot_learned_qk": ("rot_learned_qk", {}),
    "rot_learned_qkv": ("rot_learned_qkv", {}),
    # M8 (a): option B (i.i.d. per position) with dispersion τ; τ = 0 is RoPE
    "rot_iid_tau0.25": ("rot_random_qk", {"table": "position", "dispersion": 0.25}),
    "rot_iid_tau0.5": ("rot_random_qk", {"table": "position", "dispersion": 0.5}),
    "rot_iid_tau1": ("rot_random_qk", {"table": "position", "dispersion": 1.0}),
}


def runs_root() -> Path:
    """The pipeline's runs folder (``$PATHLAB_RUNS`` or ``runs/`` in the repository root)."""
    from pathlab.train import runs_root as pipeline_runs_root

    return pipeline_runs_root()


def run_dir(profile: str, variant: str, fast: bool = False) -> Path:
    """``runs/<profile>[-fast]/<variant>``."""
    _check_variant(variant)
    return runs_root() / (profile + ("-fast" if fast else "")) / variant


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; the notebooks know {', '.join(VARIANTS)}")


def overrides_for(variant: str, fast: bool) -> dict:
    attention, kwargs = VARIANTS[variant]
    out = {"model.attention": attention}
    if kwargs:
        out["model.attention_kwargs"] = dict(kwargs)
    if fast:
        out.update(FAST_OVERRIDES)
    return out


def train_command(profile: str, variant: str, fast: bool = False) -> str:
    """The shell command that produces a missing run."""
    parts = []
    for key, value in overrides_for(variant, fast).items():
        if key == "model.attention_kwargs":
            parts += [f"model.attention_kwargs.{k}={v}" for k, v in value.items()]
        else:
            parts.append(f"{key}={value}")
    folder = run_dir(profile, variant, fast)
    try:
        folder = folder.relative_to(Path.cwd())
    except ValueError:
        pass
    return f"pathlab train --config {profile} --run-dir {folder} {' '.join(parts)}"


def is_complete(path: Path) -> bool:
    """A finished run: the pipeline writes ``summary.json`` (after the final ``ckpt.pt``) when a run completes."""
    path = Path(path)
    return (path / "summary.json").is_file() and (path / "ckpt.pt").is_file()


def ensure_runs(profile: str, variants, *, fast: bool = False, progress: bool = True) -> dict[str, Path]:
    """Make sure every run exists; train the missing ones for ``tiny-cpu``, else raise with the commands."""
    from pathlab.figures import PROFILES

    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {', '.join(PROFILES)}, got {profile!r}")
    dirs = {v: run_dir(profile, v, fast) for v in variants}
    missing = [v for v, d in dirs.items() if not is_complete(d)]
    if missing and profile != "tiny-cpu":
        lines = "\n".join(f"  {train_command(profile, v, fast)}" for v in missing)
        raise FileNotFoundError(f"profile {profile}: no finished run for {', '.join(missing)}. Produce them with\n"
                                f"{lines}\n(or use --profile tiny-cpu, which trains its own)")
    if missing:
        from pathlab import train

        for n, v in enumerate(missing, 1):
            if progress:
                print(f"training {profile}{' (fast)' if fast else ''} run {n}/{len(missing)}: {v} -> {dirs[v]}",
                      file=sys.stderr, flush=True)
            train.train(profile, overrides=overrides_for(v, fast), run_dir=dirs[v], resume=(dirs[v] / "ckpt.pt").is_file(),
                        progress=progress)
    return dirs


def load_models(profile: str, variants, *, fast: bool = False, progress: bool = False) -> dict:
    """``{variant: (model, run_config)}`` with every missing tiny-cpu run trained first."""
    from pathlab import train

    dirs = ensure_runs(profile, variants, fast=fast, progress=progress)
    out = {}
    for v, d in dirs.items():
        model, cfg = train.load_run(d)
        out[v] = (model.eval(), cfg)
    return out


def validation_windows(run_config: dict, length: int, n_windows: int, seed: int = 0) -> torch.Tensor:
    """``[n, L]`` token windows from the run's validation split, identical for every model (seeded by L).

    Non-overlapping when the split is long enough (random starts otherwise).
    """
    from pathlab.data.corpus import load_tokens

    tokens = load_tokens(run_config["data"]["corpus"], "val")
    n_tok = len(tokens)
    if n_tok < length + 1:
        raise ValueError(f"the validation split of {run_config['data']['corpus']!r} has {n_tok} tokens, fewer than "
                         f"one window of {length}; use shorter lengths or a larger corpus")
    rng = np.random.default_rng(seed * 1_000_003 + length)
    slots = n_tok // length
    if slots >= n_windows:
        starts = np.sort(rng.choice(slots, size=n_windows, replace=False)) * length
    else:
        starts = rng.integers(0, n_tok - length, size=n_windows)
    return torch.from_numpy(np.stack([np.asarray(tokens[s:s + length], dtype=np.int64) for s in starts]))
