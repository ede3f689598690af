"""Run configuration for language-model training: a nested dict with a fixed schema.

A config has five sections (``model``, ``data``, ``optim``, ``train``, ``eval``) and a ``name``. It comes from a
YAML file under ``configs/`` (``"tiny-cpu"``), a YAML path, or a dict; overrides are dotted ``key=value`` strings
(``train.max_iters=100``, ``model.attention=path``) or a dict of dotted keys. Every key is checked against the
schema below (unknown key or wrong type -> ``ValueError`` naming the key), so a typo never trains silently.
``model.*`` is :class:`pathlab.ModelConfig` (checked by ``ModelConfig.from_dict``); ``model.attention_kwargs`` is
the variant's free-form options dict (checked by the variant).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
import re
from pathlib import Path

import yaml

from pathlab.model import ModelConfig

_ANY = object()

# dotted key -> (allowed types, default). None in the types tuple means "may be null".
SCHEMA: dict[str, tuple[tuple, object]] = {
    "name": ((str,), "custom"),
    # data
    "data.corpus": ((str,), "debian"),          # corpus name (see pathlab.data.corpus) or a prepared folder
    "data.tokenizer": ((str, None), None),      # expected tokenizer name; checked against the corpus
    "data.block_size": ((int,), 512),           # training context
    # optimiser (nanoGPT's defaults)
    "optim.lr": ((float,), 6e-4),
    "optim.min_lr": ((float,), 6e-5),
    "optim.warmup_iters": ((int,), 2000),
    "optim.lr_decay_iters": ((int, None), None),  # None = max_iters
    "optim.weight_decay": ((float,), 0.1),
    "optim.beta1": ((float,), 0.9),
    "optim.beta2": ((float,), 0.95),
    "optim.grad_clip": ((float,), 1.0),         # 0 disables clipping
    # training loop
    "train.max_iters": ((int,), 1000),
    "train.batch_size": ((int,), 12),           # sequences per micro-step per process
    "train.grad_accum": ((int,), 1),            # micro-steps per iteration, over all processes together
    "train.seed": ((int,), 1337),
    "train.device": ((str,), "auto"),           # auto | cpu | cuda | cuda:N
    "train.dtype": ((str,), "auto"),            # auto (bf16 autocast on CUDA, fp32 on CPU) | float32 | bfloat16
    "train.compile": ((str, bool), "auto"),     # auto (on CUDA only) | true | false
    "train.distributed": ((str,), "ddp"),       # ddp | fsdp (only used under torchrun)
    "train.log_interval": ((int,), 10),
    "train.eval_interval": ((int,), 250),       # 0 = only at the end
    "train.eval_iters": ((int,), 20),
    "train.ckpt_interval": ((int,), 250),       # 0 = only at the end
    "train.threads": ((int, None), None),       # torch.set_num_threads on CPU (None = leave as is)
    # evaluation defaults for `pathlab eval` (overridable on its command line)
    "eval.lengths": ((list,), [512, 1024, 2048, 4096]),
    "eval.n_windows": ((int,), 8),
    "eval.seed": ((int,), 1234),
}
_CHOICES = {
    "train.dtype": ("auto", "float32", "bfloat16"),
    "train.distributed": ("ddp", "fsdp"),
    "train.compile": ("auto", True, False),
}
_POSITIVE = {"data.block_size", "train.max_iters", "train.batch_size", "train.grad_accum", "train.log_interval",
             "train.eval_iters", "eval.n_windows"}
_MODEL_FIELDS = {f.name: f for f in dataclasses.fields(ModelConfig)}
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def repo_root() -> Path | None:
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() else None


def config_search_path() -> list[Path]:
    roots = [r / "configs" for r in (repo_root(), Path.cwd()) if r is not None]
    return list(dict.fromkeys(roots))


def available_configs() -> list[str]:
    return sorted({p.stem for d in config_search_path() if d.is_dir() for p in d.glob("*.yaml")})


def _read_config_source(config) -> dict:
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if not isinstance(config, (str, Path)):
        raise ValueError(f"config: expected a config name, a YAML path or a dict, got {type(config).__name__}")
    path = Path(config)
    if not path.suffix and not path.exists():
        for folder in config_search_path():
            if (folder / f"{config}.yaml").is_file():
                path = folder / f"{config}.yaml"
                break
        else:
            raise ValueError(f"config: no config named {config!r}; available: {', '.join(available_configs())}")
    data = read_yaml_mapping(path, "config")
    data.setdefault("name", path.stem)
    return data


def read_yaml_mapping(path: Path, what: str) -> dict:
    """The mapping a YAML config file holds; a missing file, invalid YAML (with its line and column) or another
    top level is a ValueError that starts with ``what`` and names the file."""
    if not path.is_file():
        raise ValueError(f"{what}: file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"{what}: {path} is not valid YAML: {_yaml_problem(err)}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what}: {path} must hold a mapping at the top level")
    return data


def _yaml_problem(err: yaml.YAMLError) -> str:
    """``"<problem> (line L, column C)"`` from a YAML error (lines and columns counted from 1)."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err)
    context = getattr(err, "context", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return f"{problem}{where}" + (f", {context}" if context else "")


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in d.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict) and full not in ("model.attention_kwargs",) and (
            prefix == "" and key in ("model", "data", "optim", "train", "eval")
        ):
            out.update(_flatten(value, f"{full}."))
        else:
            out[full] = value
    return out


def _unknown_key(key: str) -> ValueError:
    known = list(SCHEMA) + [f"model.{k}" for k in _MODEL_FIELDS]
    close = difflib.get_close_matches(key, known, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return ValueError(f"unknown config key {key!r}{hint} (sections: model, data, optim, train, eval)")


def _coerce(key: str, value, types: tuple):
    """Check (and gently convert: ints to floats, '1e-3' to a float, 'a,b' to a list) one value."""
    if value is None:
        if None in types:
            return None
        raise ValueError(f"config key {key!r} may not be null")
    if float in types and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    if float in types and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if list in types and isinstance(value, (str, int)) and not isinstance(value, bool):
        try:
            value = [int(v) for v in str(value).split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"config key {key!r} must be a comma-separated list of integers, got {value!r}") from None
    for t in types:
        if t is None:
            continue
        if t is int and isinstance(value, bool):
            continue
        if isinstance(value, t):
            return value
    names = " or ".join("null" if t is None else t.__name__ for t in types)
    raise ValueError(f"config key {key!r} must be {names}, got {value!r} ({type(value).__name__})")


def _model_type_check(key: str, value):
    name = key.split(".", 1)[1]
    if name == "attention_kwargs" or name.startswith("attention_kwargs."):
        return value
    if name not in _MODEL_FIELDS:
        raise _unknown_key(key)
    default = _MODEL_FIELDS[name].default
    if default is dataclasses.MISSING or default is None:
        return value
    return _coerce(key, value, (type(default),) if not isinstance(default, float) else (float,))


def parse_overrides(overrides) -> dict:
    """``["train.max_iters=10", ...]`` or ``{"train.max_iters": 10}`` -> flat dict of dotted keys (values via YAML)."""
    if overrides is None:
        return {}
    if isinstance(overrides, dict):
        return dict(overrides)
    if isinstance(overrides, str):
        overrides = [overrides]
    out = {}
    for item in overrides:
        if not isinstance(item, str) or "=" not in item:
            raise ValueError(f"overrides: expected 'key=value', got {item!r}")
        key, raw = item.split("=", 1)
        try:
            out[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as err:
            raise ValueError(f"overrides: the value of {item!r} is not valid YAML: {_yaml_problem(err)}") from None
    return out


def resolve_config(config, overrides=None) -> dict:
    """The full, validated, nested run config: schema defaults <- config <- overrides."""
    flat = {k: copy.deepcopy(v) for k, (_, v) in SCHEMA.items()}
    source = _flatten(_read_config_source(config))
    for key, value in list(source.items()) + list(parse_overrides(overrides).items()):
        if key.startswith("model."):
            if key.startswith("model.attention_kwargs."):
                flat.setdefault("model.attention_kwargs", {})
                flat["model.attention_kwargs"] = dict(flat["model.attention_kwargs"])
                flat["model.attention_kwargs"][key.split(".", 2)[2]] = value
                continue
            flat[key] = _model_type_check(key, value)
        elif key in SCHEMA:
            flat[key] = _coerce(key, value, SCHEMA[key][0])
        else:
            raise _unknown_key(key)
    for key, choices in _CHOICES.items():
        value = flat[key]
        if isinstance(value, str) and key == "train.compile" and value.lower() in ("true", "false"):
            value = flat[key] = value.lower() == "true"
        if value not in choices:
            raise ValueError(f"config key {key!r} must be one of {list(choices)}, got {value!r}")
    for key in (*_POSITIVE, "optim.lr_decay_iters", "train.threads"):  # the last two may also be null
        if flat[key] is not None and flat[key] < 1:
            raise ValueError(f"config key {key!r} must be >= 1, got {flat[key]}")
    for key in ("train.eval_interval", "train.ckpt_interval", "optim.warmup_iters", "optim.weight_decay",
                "optim.grad_clip"):
        if flat[key] < 0:
            raise ValueError(f"config key {key!r} must be >= 0, got {flat[key]}")
    for key in ("optim.beta1", "optim.beta2"):
        if not 0 <= flat[key] < 1:
            raise ValueError(f"config key {key!r} must lie in [0, 1), got {flat[key]}")
    if not _DEVICE.fullmatch(flat["train.device"]):
        raise ValueError(f"config key 'train.device' must be auto, cpu, cuda or cuda:N, got {flat['train.device']!r}")
    if not all(isinstance(L, int) and L > 1 for L in flat["eval.lengths"]):
        raise ValueError(f"config key 'eval.lengths' must be a list of integers > 1, got {flat['eval.lengths']}")
    if not 0 <= flat["optim.min_lr"] <= flat["optim.lr"]:
        raise ValueError(f"optim.min_lr must lie in [0, optim.lr]; got {flat['optim.min_lr']} and {flat['optim.lr']}")
    nested: dict = {}
    for key, value in flat.items():
        parts = key.split(".")
        node = nested
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    nested.setdefault("model", {})
    # Validate the model section now (vocab_size is filled from the corpus later when missing).
    probe = {k: v for k, v in nested["model"].items()}
    probe.setdefault("vocab_size", 64)
    ModelConfig.from_dict(probe)
    return nested


def config_hash(cfg: dict, ignore: tuple[str, ...] = ()) -> str:
    flat = _flatten(cfg)
    flat = {k: v for k, v in flat.items() if k not in ignore}
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()


def config_diff(a: dict, b: dict, ignore: tuple[str, ...] = ()) -> list[str]:
    fa, fb = _flatten(a), _flatten(b)
    keys = sorted((set(fa) | set(fb)) - set(ignore))
    return [f"{k}: {fa.get(k)!r} -> {fb.get(k)!r}" for k in keys if fa.get(k) != fb.get(k)]
