"""A study's config (``configs/studies/<name>.yaml``): its cells, the training config each resolves to, and where
its runs and results live.

A study config names a training config and the overrides every cell shares, the evaluation protocol
(:mod:`pathlab.training.evaluate`), the probe settings (:mod:`pathlab.probes.records`), the cells (an attention
variant, its options and per-cell overrides) and the cells each figure compares (``figures:``). A cell's
*fingerprint* hashes everything its results depend on, so results of an edited cell are never taken for current.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from pathlib import Path

from pathlab.training.config import read_yaml_mapping, repo_root, resolve_config

CELL_KEYS = {"attention", "attention_kwargs", "overrides", "tokens", "group", "note"}
STUDY_KEYS = {"name", "description", "train_config", "results_dir", "overrides", "eval", "probes", "cells",
              "figures", "fast", "reserve_s"}
EVAL_KEYS = {"lengths", "n_windows", "seed"}
PROBE_KEYS = {"lengths", "n_windows", "n_queries", "span", "near", "m2_length", "m2_windows", "angle_lag", "eps",
              "seed"}


def studies_dir() -> Path:
    return (repo_root() or Path.cwd()) / "configs" / "studies"


def available_studies() -> list[str]:
    return sorted(p.stem for p in studies_dir().glob("*.yaml"))


def _check_keys(section: dict, allowed: set, where: str) -> None:
    unknown = sorted(set(section) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; allowed: {sorted(allowed)}")


def load_study(study, *, fast: bool = False) -> dict:
    """A study config by name (``configs/studies/<name>.yaml``), path or dict, checked, with defaults filled.

    ``fast`` applies the study's ``fast`` section (a CI-sized version: its ``overrides``, ``eval`` and ``probes``
    replace the main ones key by key) and names the study ``<name>-fast``, with its own results folder.
    """
    if isinstance(study, dict):
        cfg = copy.deepcopy(study)
        where = f"study {cfg.get('name', '?')!r}"
    else:
        path = Path(study)
        if not path.suffix:
            path = studies_dir() / f"{study}.yaml"
            if not path.is_file():
                raise ValueError(f"study: no study named {study!r}; available: {', '.join(available_studies())}")
        cfg = read_yaml_mapping(path, "study")
        where = str(path)
        cfg.setdefault("name", path.stem)
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: a study config is a mapping")
    _check_keys(cfg, STUDY_KEYS, where)
    for key in ("train_config", "cells"):
        if key not in cfg:
            raise ValueError(f"{where}: missing key {key!r}")
    cfg.setdefault("overrides", {})
    cfg.setdefault("eval", {})
    cfg.setdefault("probes", {})
    cfg.setdefault("figures", {})
    cfg.setdefault("reserve_s", 120)
    _check_keys(cfg["eval"], EVAL_KEYS, f"{where}: eval")
    _check_keys(cfg["probes"], PROBE_KEYS, f"{where}: probes")
    if fast:
        extra = cfg.get("fast")
        if not extra:
            raise ValueError(f"{where}: this study has no 'fast' section, so it has no CI-sized version")
        cfg["overrides"] = {**cfg["overrides"], **extra.get("overrides", {})}
        cfg["eval"] = {**cfg["eval"], **extra.get("eval", {})}
        cfg["probes"] = {**cfg["probes"], **extra.get("probes", {})}
        if "cells" in extra:
            missing = [c for c in extra["cells"] if c not in cfg["cells"]]
            if missing:
                raise ValueError(f"{where}: fast.cells names unknown cells {missing}")
            cfg["cells"] = {c: cfg["cells"][c] for c in extra["cells"]}
        cfg["name"] = f"{cfg['name']}-fast"
        cfg["results_dir"] = str(Path(cfg.get("results_dir", f"build/results/{cfg['name']}")).parent / cfg["name"])
    cfg.pop("fast", None)
    cfg.setdefault("results_dir", f"results/{cfg['name']}")
    if not isinstance(cfg["cells"], dict) or not cfg["cells"]:
        raise ValueError(f"{where}: cells must be a non-empty mapping of cell name -> settings")
    for name, cell in cfg["cells"].items():
        if not isinstance(cell, dict) or "attention" not in cell:
            raise ValueError(f"{where}: cell {name!r} needs at least an 'attention' entry")
        _check_keys(cell, CELL_KEYS, f"{where}: cell {name!r}")
    for figure, cells in cfg["figures"].items():
        unknown = [c for c in cells if c not in cfg["cells"]]
        if unknown and not fast:
            raise ValueError(f"{where}: figure {figure!r} names unknown cells {unknown}")
    return cfg


def results_dir(study: dict) -> Path:
    path = Path(study["results_dir"])
    return path if path.is_absolute() else (repo_root() or Path.cwd()) / path


def cell_results_dir(study: dict, cell: str) -> Path:
    return results_dir(study) / cell


def run_dir(study: dict, cell: str) -> Path:
    from pathlab.training.trainer import runs_root

    return runs_root() / study["name"] / cell


def cell_config(study: dict, cell: str) -> dict:
    """The resolved training config of a cell: the study's training config <- study overrides <- cell's."""
    if cell not in study["cells"]:
        raise ValueError(f"cell: unknown cell {cell!r} of study {study['name']!r}; cells: {', '.join(study['cells'])}")
    spec = study["cells"][cell]
    overrides = {**study["overrides"], **spec.get("overrides", {}), "model.attention": spec["attention"],
                 "name": f"{study['name']}-{cell}"}
    if spec.get("attention_kwargs"):
        overrides["model.attention_kwargs"] = dict(spec["attention_kwargs"])
    cfg = resolve_config(study["train_config"], overrides)
    if "tokens" in spec:
        per_iter = cfg["train"]["batch_size"] * cfg["train"]["grad_accum"] * cfg["data"]["block_size"]
        cfg["train"]["max_iters"] = math.ceil(float(spec["tokens"]) / per_iter)
    for key in ("lengths", "n_windows", "seed"):
        if key in study["eval"]:
            cfg["eval"][key] = study["eval"][key]
    return cfg


def cell_fingerprint(study: dict, cell: str) -> str:
    """What a cell's results depend on: its training config, the evaluation protocol and the probe settings."""
    payload = {"train": cell_config(study, cell), "eval": study["eval"], "probes": study["probes"]}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cell_names(study: dict, cells, what: str = "cells") -> list[str]:
    """The cells named by ``cells`` (a comma-separated string or a list), each checked against the study; a
    ValueError names the argument (``what``: ``cells``, ``variants``, ``--variants``) and the study's cells."""
    if isinstance(cells, str):
        names = [c.strip() for c in cells.split(",") if c.strip()]
    elif isinstance(cells, (list, tuple)):
        names = list(cells)
    else:
        raise ValueError(f"{what}: expected cell names, comma-separated or as a list, got {cells!r}")
    unknown = [c for c in names if c not in study["cells"]]
    if unknown or (isinstance(cells, str) and not names):  # an empty list is no cells; an empty text is a slip
        raise ValueError(f"{what}: unknown {unknown or cells!r}; the study {study['name']!r} has "
                         f"{', '.join(study['cells'])}")
    return names


def figure_cells(study: dict, figure: str, only=None) -> list[str]:
    """The cells a figure compares (the study's ``figures`` section), optionally restricted to ``only``."""
    if figure not in study["figures"]:
        raise ValueError(f"study {study['name']!r} lists no cells for figure {figure!r}; it has "
                         f"{', '.join(study['figures'])}")
    chosen = [c for c in study["figures"][figure] if c in study["cells"]]
    if only is not None:
        wanted = cell_names(study, only, "variants")
        chosen = [c for c in chosen if c in wanted]
    return chosen


def runs_here(study: dict) -> bool:
    """Whether a missing cell may be trained on the spot: studies whose training config runs on the CPU."""
    return resolve_config(study["train_config"])["train"]["device"] == "cpu"
