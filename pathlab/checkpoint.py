"""Atomic checkpoints: written to a temporary file in the same folder, then moved over the old one.

A checkpoint is one ``torch.save`` dict::

    {"model": state_dict, "optimizer": state_dict, "step": int, "rng": {...}, "sampler": {...},
     "config": resolved run config, "config_hash": str, "model_config": ModelConfig dict, "format": 1}

A crash while saving leaves the previous checkpoint untouched (``os.replace`` is atomic on POSIX and Windows).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from pathlab.atomic import atomic_output

CKPT_NAME = "ckpt.pt"
FORMAT = 1


def rng_state() -> dict:
    """Every random number generator a training step may touch."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: str | Path, payload: dict) -> Path:
    """Write ``payload`` atomically to ``path`` (temp file + fsync + ``os.replace``)."""
    path = Path(path)
    with atomic_output(path) as f:
        torch.save({**payload, "format": FORMAT}, f)
    return path


def load_checkpoint(path: str | Path, map_location="cpu") -> dict:
    """Load a checkpoint written by :func:`save_checkpoint`; a clear ``ValueError`` when it is missing/corrupt."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"checkpoint {path} does not exist (was the run trained, and is this its run directory?)")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as err:  # noqa: BLE001 - any unpickling error means the same thing here
        raise ValueError(f"checkpoint {path} cannot be read ({type(err).__name__}: {err}); it is corrupt") from err
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT or "model" not in ckpt:
        raise ValueError(f"checkpoint {path} is not a pathlab training checkpoint (format {FORMAT})")
    return ckpt
