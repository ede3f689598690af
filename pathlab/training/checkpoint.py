"""Checkpoints that are atomic, checksummed, finite, and backed by the previous one.

A checkpoint file is one header line and one ``torch.save`` dict::

    pathlab-checkpoint/2 sha256:<64 hex digits of everything after this line>\n
    {"model": state_dict, "optimizer": state_dict, "step": int, "rng": {...}, "sampler": {...},
     "config": resolved run config, "config_hash": str, "model_config": ModelConfig dict, "corpus": {...},
     "format": 2}

* **Atomic.** Written to a temporary file in the same folder, fsynced, then moved over the old one
  (``os.replace``). A crash while saving leaves the previous checkpoint untouched; the temporary file a killed
  write leaves behind is removed by the next save.
* **Checksummed.** The SHA-256 covers the serialized payload and is checked on every load, so flipped bytes
  anywhere (``torch.load`` itself checks none of the tensor bytes) are found.
* **Previous copy.** Saving ``ckpt.pt`` first keeps the file it replaces as ``ckpt.prev.pt``; loading falls
  back to it, with a :class:`CheckpointFallbackWarning`, when the latest one is missing or corrupt.
* **Finite.** :func:`save_checkpoint` refuses a payload whose model or optimiser state holds NaN or inf.

Files of format 1 (a bare ``torch.save`` dict, no header) still load, without the checksum.
"""

from __future__ import annotations

import hashlib
import random
import warnings
from pathlib import Path

import numpy as np
import torch

from pathlab.atomic import atomic_output, remove_stale_temporaries

CKPT_NAME = "ckpt.pt"
PREV_NAME = "ckpt.prev.pt"
FORMAT = 2
MAGIC = b"pathlab-checkpoint/2 sha256:"
HEADER_LEN = len(MAGIC) + 64 + 1


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or not a pathlab training checkpoint."""


class NonFiniteCheckpoint(ValueError):
    """The state to be saved holds NaN or inf values; nothing was written."""


class CheckpointFallbackWarning(UserWarning):
    """The latest checkpoint was unusable and the previous one was loaded instead."""


def previous_path(path: str | Path) -> Path:
    """Where the checkpoint that ``path`` replaced is kept: ``ckpt.pt`` -> ``ckpt.prev.pt``."""
    path = Path(path)
    return path.with_name(f"{path.stem}.prev{path.suffix}")


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


def nonfinite_tensors(payload: dict, keys=("model", "optimizer")) -> list[str]:
    """Dotted names of the floating-point tensors under ``payload[key]`` that hold NaN or inf."""
    bad = []

    def walk(node, name):
        if isinstance(node, torch.Tensor):
            if node.is_floating_point() and not bool(torch.isfinite(node).all()):
                bad.append(name)
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{name}.{k}")
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{name}.{i}")

    for key in keys:
        if key in payload:
            walk(payload[key], key)
    return bad


class _HashingWriter:
    """A write-only file that hashes what passes through it (``torch.save`` needs only ``write``/``flush``)."""

    def __init__(self, f):
        self.f, self.hash = f, hashlib.sha256()

    def write(self, data) -> int:
        self.hash.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def save_checkpoint(path: str | Path, payload: dict, *, keep_previous: bool = True) -> Path:
    """Write ``payload`` atomically to ``path`` with its SHA-256; the file it replaces becomes ``ckpt.prev.pt``.

    Raises :class:`NonFiniteCheckpoint` (writing nothing) when the model or optimiser state is not finite.
    """
    path = Path(path)
    bad = nonfinite_tensors(payload)
    if bad:
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise NonFiniteCheckpoint(f"not writing {path}: non-finite values in {', '.join(bad[:5])}{more}")
    prev = previous_path(path)
    remove_stale_temporaries(path.parent, (path.name, prev.name))
    with atomic_output(path, keep_previous=prev if keep_previous else None) as f:
        f.write(MAGIC + b"0" * 64 + b"\n")
        writer = _HashingWriter(f)
        torch.save({**payload, "format": FORMAT}, writer)
        f.seek(len(MAGIC))
        f.write(writer.hash.hexdigest().encode())
    return path


def _sha256_from(f, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    while block := f.read(chunk):
        h.update(block)
    return h.hexdigest()


def read_checkpoint(path: str | Path, map_location="cpu") -> dict:
    """Load and verify exactly ``path`` (no fallback); :class:`CheckpointError` when missing or corrupt."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist (was the run trained, and is this its run directory?)")
    with open(path, "rb") as f:
        header = f.read(HEADER_LEN)
        if header.startswith(MAGIC):
            want = header[len(MAGIC) : len(MAGIC) + 64].decode(errors="replace")
            if _sha256_from(f) != want:
                raise CheckpointError(f"checkpoint {path} does not match its SHA-256 checksum: it is corrupt "
                                      "(damaged or partly copied)")
            f.seek(HEADER_LEN)
        elif header.startswith(b"PK"):  # format 1: a bare torch.save zip, no checksum
            f.seek(0)
        else:
            raise CheckpointError(f"checkpoint {path} is not a pathlab training checkpoint (unknown header)")
        try:
            ckpt = torch.load(f, map_location=map_location, weights_only=False)
        except Exception as err:  # noqa: BLE001 - any unpickling error means the same thing here
            raise CheckpointError(
                f"checkpoint {path} cannot be read ({type(err).__name__}: {err}); it is corrupt"
            ) from err
    if not isinstance(ckpt, dict) or ckpt.get("format") not in (1, FORMAT) or "model" not in ckpt:
        raise CheckpointError(f"checkpoint {path} is not a pathlab training checkpoint (format {FORMAT})")
    return ckpt


def load_checkpoint(path: str | Path, map_location="cpu", *, fallback: bool = True) -> dict:
    """Load a checkpoint written by :func:`save_checkpoint`, verifying its checksum.

    When ``path`` is missing or corrupt and ``fallback`` is set, the previous checkpoint (``ckpt.prev.pt``) is
    loaded instead with a :class:`CheckpointFallbackWarning`; ``ckpt["loaded_from"]`` names the file used.
    Raises :class:`CheckpointError` (a ``ValueError``) when neither is usable.
    """
    path = Path(path)
    try:
        ckpt = read_checkpoint(path, map_location)
    except CheckpointError as err:
        prev = previous_path(path)
        if not fallback or not prev.is_file():
            raise
        try:
            ckpt = read_checkpoint(prev, map_location)
        except CheckpointError as prev_err:
            raise CheckpointError(f"{err}; the previous checkpoint is unusable too: {prev_err}") from None
        warnings.warn(f"{err}; using the previous checkpoint {prev} (iteration {ckpt['step']}) instead",
                      CheckpointFallbackWarning, stacklevel=2)
        ckpt["loaded_from"] = str(prev)
        return ckpt
    ckpt["loaded_from"] = str(path)
    return ckpt
