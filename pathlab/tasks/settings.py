"""Settings of a task run: one flat dict, resolved in four layers (later wins)::

    COMMON defaults  <-  the task's defaults  <-  a preset of configs/tasks/<task>.yaml  <-  key=value overrides

Every key is known in advance and typed by its default (``TYPES`` for keys whose default is None); an unknown key
or a value of the wrong type is a ``ValueError`` that names the key and lists the valid ones. A value out of its
range (:func:`check_ranges`), which would crash the run after its training or spoil it without a word, is one that
names the key and the range.
"""

from __future__ import annotations

import ast
import math
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
        if not math.isfinite(value):  # the result JSON cannot hold it, and no setting means it
            raise ValueError(f"{key} must be a finite number, got {value!r}")
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
    check_ranges(merged)
    get_task(task).train_batch({**merged, "batch_size": 1}, 0)  # the generators check the task settings
    return merged


# (key, test, the rule in words): a value outside its range crashes a run after training (an empty evaluation set)
# or spoils it without a word (negative learning rates, a target no accuracy reaches), so it is refused up front
RANGES = (
    ("lr", lambda v: v > 0, "> 0"),
    ("min_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1] (the final learning rate as a fraction of lr)"),
    ("warmup", lambda v: v >= 0, ">= 0"),
    ("weight_decay", lambda v: v >= 0, ">= 0"),
    ("grad_clip", lambda v: v >= 0, ">= 0 (0: no clipping)"),
    ("beta1", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("beta2", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("seed", lambda v: v >= 0, ">= 0"),
    ("max_seconds", lambda v: v is None or v > 0, "> 0 or None"),
    ("stop_at", lambda v: v is None or 0 < v <= 1, "in (0, 1] (an accuracy) or None"),
    # a length is solved when the sequence accuracy exceeds solved_at, which no accuracy does at 1
    ("solved_at", lambda v: 0 < v < 1, "in (0, 1) (the sequence accuracy must exceed it)"),
)


def check_ranges(s: Mapping[str, Any]) -> None:
    """Refuse settings outside their ranges (``RANGES``, and at least 1 for the sizes, counts and every
    evaluation set), naming the key."""
    sizes = ["n_layer", "n_head", "n_embd", "mlp_ratio", "steps", "batch_size", "eval_every", "eval_batch_size"]
    for key in sizes + sorted(k for k in s if k.startswith("n_eval")):
        if s[key] < 1:
            raise ValueError(f"{key} must be >= 1, got {s[key]!r}")
    for key, ok, rule in RANGES:
        if key in s and not ok(s[key]):
            raise ValueError(f"{key} must be {rule}, got {s[key]!r}")
    if s["n_embd"] % s["n_head"]:
        raise ValueError(f"n_embd ({s['n_embd']}) must be a multiple of n_head ({s['n_head']})")
