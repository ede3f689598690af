"""Settings of a task run: one flat dict, resolved in four layers (later wins)::

    COMMON defaults  <-  the task's defaults  <-  a preset of configs/tasks/<task>.yaml  <-  key=value overrides

Every key is known in advance and typed by its default (``TYPES`` for keys whose default is None); an unknown key
or a value of the wrong type is a ``ValueError`` that names the key and lists the valid ones.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, Mapping

import yaml

from pathlab.tasks.specs import get_task

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "tasks"

COMMON: dict[str, Any] = dict(
    # model (the positional variant is chosen by the attention argument)
    n_layer=1, n_head=2, n_embd=64, mlp_ratio=4, attention_kwargs={},
    # optimisation: AdamW, linear warmup then cosine decay to min_lr_ratio * lr
    steps=1000, batch_size=32, lr=1e-3, min_lr_ratio=0.1, warmup=100, weight_decay=0.1, grad_clip=1.0,
    beta1=0.9, beta2=0.98,
    # budget and evaluation: the run stops at `steps`, after `max_seconds`, or when the quick evaluation of the
    # task's primary metric reaches `stop_at` (None = never)
    max_seconds=None, stop_at=None, eval_every=100, eval_batch_size=64,
    # reproducibility and placement
    seed=0, device="auto", precision="fp32",
    # torch.compile of the training step's model: none, inductor (fuses PaTH's per-chunk UT preparation, which
    # otherwise launches dozens of small kernels per layer), aot_eager (traces without code generation) or
    # cudagraphs (Inductor plus CUDA graphs: no per-kernel launch cost; CUDA only)
    compile="none",
)
TYPES = {"max_seconds": float, "stop_at": float}
CHOICES = {"device": ("auto", "cpu", "cuda"), "precision": ("fp32", "tf32", "bf16"),
           "compile": ("none", "inductor", "aot_eager", "cudagraphs"),
           "loss": ("clean", "full"), "variant": ("tagging", "identity")}


def defaults(task: str) -> dict[str, Any]:
    return {**COMMON, **get_task(task).defaults}


def load_preset(task: str, preset: str | None, config_dir: str | Path | None = None) -> dict[str, Any]:
    """The settings of ``preset`` in ``configs/tasks/<task>.yaml`` (``{}`` for None)."""
    if preset is None:
        return {}
    path = Path(config_dir or CONFIG_DIR) / f"{task}.yaml"
    if not path.exists():
        raise ValueError(f"no task config {path}")
    with open(path, encoding="utf-8") as f:
        doc = yaml.safe_load(f) or {}
    presets = doc.get("presets", {})
    if preset not in presets:
        raise ValueError(f"preset must be one of {sorted(presets)} (from {path.name}), got {preset!r}")
    return dict(presets[preset] or {})


def sweep_preset(task: str, preset: str, config_dir: str | Path | None = None) -> dict[str, Any]:
    """The ``sweep:`` section of configs/tasks/<task>.yaml for ``preset`` (for a5: lengths and layers; for
    mqrar: the n_back values), or ``{}`` when the file has none for that preset."""
    path = Path(config_dir or CONFIG_DIR) / f"{task}.yaml"
    if not path.exists():
        raise ValueError(f"no task config {path}")
    with open(path, encoding="utf-8") as f:
        doc = yaml.safe_load(f) or {}
    return dict((doc.get("sweep") or {}).get(preset) or {})


def parse_overrides(items) -> dict[str, Any]:
    """``["lr=3e-4", "n_layer=2", "attention_kwargs={'x': 1}"]`` -> dict, values parsed as Python literals when
    they are one (numbers, None, True, dicts), else kept as strings."""
    out = {}
    for item in items or ():
        if "=" not in item:
            raise ValueError(f"overrides must be key=value, got {item!r}")
        key, raw = item.split("=", 1)
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        out[key.strip()] = value
    return out


def _coerce(key: str, value: Any, default: Any) -> Any:
    kind = TYPES.get(key, type(default) if default is not None else None)
    if value is None:
        if key in TYPES:
            return None
        raise ValueError(f"{key} cannot be None")
    if kind is bool and not isinstance(value, bool):
        raise ValueError(f"{key} must be True or False, got {value!r}")
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ValueError(f"{key} must be an int, got {value!r}")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key} must be a number, got {value!r}")
        return float(value)
    if kind is dict and not isinstance(value, Mapping):
        raise ValueError(f"{key} must be a mapping, got {value!r}")
    if kind is str and not isinstance(value, str):
        raise ValueError(f"{key} must be a string, got {value!r}")
    return dict(value) if kind is dict else value


def resolve_settings(task: str, *, preset: str | None = None, overrides: Mapping[str, Any] | None = None,
                     config_dir: str | Path | None = None) -> dict[str, Any]:
    """The full settings dict of one run, validated."""
    base = defaults(task)
    merged = dict(base)
    for layer in (load_preset(task, preset, config_dir), dict(overrides or {})):
        for key, value in layer.items():
            if key not in base:
                raise ValueError(f"unknown setting {key!r} for task {task!r}; valid settings: "
                                 f"{', '.join(sorted(base))}")
            merged[key] = _coerce(key, value, base[key])
    for key, choices in CHOICES.items():
        if key in merged and merged[key] not in choices:
            raise ValueError(f"{key} must be one of {choices}, got {merged[key]!r}")
    for key in ("n_layer", "n_head", "n_embd", "steps", "batch_size", "eval_every", "eval_batch_size"):
        if merged[key] < 1:
            raise ValueError(f"{key} must be >= 1, got {merged[key]!r}")
    if merged["n_embd"] % merged["n_head"]:
        raise ValueError(f"n_embd ({merged['n_embd']}) must be a multiple of n_head ({merged['n_head']})")
    if not merged["lr"] > 0:
        raise ValueError(f"lr must be > 0, got {merged['lr']!r}")
    if merged["max_seconds"] is not None and not merged["max_seconds"] > 0:
        raise ValueError(f"max_seconds must be > 0 or None, got {merged['max_seconds']!r}")
    get_task(task).train_batch({**merged, "batch_size": 1}, 0)  # the generators check the task settings
    return merged
