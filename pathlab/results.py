"""Figure and result files, written atomically.

Every notebook ends with two calls::

    save_figure(fig, "far_mass", out_dir)            # -> far_mass.png, far_mass.pdf
    write_results("far_mass", data={...}, claims={"bound_holds": True}, parameters={...}, out_dir=out_dir)

Each file is first written to a temporary file in the destination folder and then moved into place with
``os.replace`` (atomic on POSIX and Windows), so a notebook that fails half-way never leaves a truncated figure or
JSON behind: either the previous file or the complete new one is there.

The JSON sidecar ``<stem>.json`` has the fields ``name, claims, checks, data, parameters, versions, git_revision`` and a
``format`` version; :func:`read_results` refuses a file written in another format with a message naming the fix.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any, Mapping

from pathlab.atomic import atomic_write_bytes, atomic_write_text  # noqa: F401  (part of this module's API)

RESULTS_FORMAT = 2  # bump when the JSON layout changes; read_results checks it


# ----------------------------------------------------------------------------------------------------------------
# figures


def _check_stem(stem: str) -> str:
    if not isinstance(stem, str) or not stem or any(c in stem for c in "/\\") or stem.startswith("."):
        raise ValueError(f"stem must be a plain file name without folder or extension, got {stem!r}")
    return stem


def save_figure(fig, stem: str, out_dir: str | os.PathLike = "figures", *, formats=("png", "pdf"), dpi: int = 150):
    """Save a matplotlib figure as ``<out_dir>/<stem>.png`` and ``.pdf``, each atomically.

    The PDF carries no creation date, so re-running a notebook with the same numbers gives the same file.
    Returns the list of written paths.
    """
    import io

    stem = _check_stem(stem)
    out_dir = Path(out_dir)
    written = []
    for fmt in formats:
        buf = io.BytesIO()
        if fmt == "pdf":
            metadata = {"CreationDate": None}
        elif fmt == "png":
            metadata = {"Software": None}
        else:
            metadata = None
        fig.savefig(buf, format=fmt, dpi=dpi, bbox_inches="tight", metadata=metadata)
        written.append(atomic_write_bytes(out_dir / f"{stem}.{fmt}", buf.getvalue()))
    return written


# ----------------------------------------------------------------------------------------------------------------
# JSON results


def to_jsonable(obj: Any) -> Any:
    """Convert numpy/torch scalars and arrays, tuples, paths and dataclass-like objects to plain JSON values.

    Non-finite floats become ``None`` (strict JSON has no NaN/Infinity).
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    mod = type(obj).__module__
    if mod.startswith("numpy"):
        import numpy as np

        if isinstance(obj, np.ndarray):
            return to_jsonable(obj.tolist())
        if isinstance(obj, np.bool_):
            return bool(obj)
        if isinstance(obj, np.integer):
            return int(obj)
        if isinstance(obj, np.floating):
            return to_jsonable(float(obj))
    if mod.startswith("torch"):
        return to_jsonable(obj.detach().cpu().tolist())
    if hasattr(obj, "to_dict"):
        return to_jsonable(obj.to_dict())
    raise TypeError(f"cannot store a {type(obj).__name__} in a results JSON")


def library_versions() -> dict[str, str]:
    """Versions of python, pathlab and the numerical libraries that produced a result."""
    import importlib.metadata as md

    versions = {"python": platform.python_version()}
    for pkg in ("pathlab", "torch", "numpy", "matplotlib", "triton"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return versions


CODE_PATHS = ("pathlab", "kernels", "notebooks", "configs")  # what makes a result; figures/ and results/ do not


def git_revision(path: str | os.PathLike | None = None) -> str | None:
    """``git rev-parse HEAD`` of the repository holding ``path`` (this package by default), with ``-dirty`` when
    tracked code that makes results (:data:`CODE_PATHS`) was modified. Outside a git checkout, the commit that
    ``git archive`` wrote into ``pathlab/REVISION`` (an export-subst file, see ``.gitattributes``): an archive is
    that commit exactly. ``None`` when neither is known.

    Regenerated figures and result files are tracked too, so counting them would mark every regeneration dirty.
    """
    cwd = Path(path) if path is not None else Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
        if rev.returncode != 0:
            return archived_revision()
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=cwd, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS],
                               cwd=top or cwd, capture_output=True, text=True, timeout=10)
        return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return archived_revision()


def archived_revision() -> str | None:
    """The commit recorded in ``pathlab/REVISION`` by ``git archive`` (40 hex digits), else ``None`` (in a
    checkout the file holds the unexpanded placeholder)."""
    try:
        text = (Path(__file__).resolve().parent / "REVISION").read_text().strip()
    except OSError:
        return None
    return text if re.fullmatch(r"[0-9a-f]{40}", text) else None


def _check_flags(flags: Mapping, what: str, allow_none: bool) -> dict:
    out = {}
    for key, value in dict(flags or {}).items():
        if value is None and allow_none:
            out[str(key)] = None
        elif type(value).__name__ in ("bool", "bool_"):
            out[str(key)] = bool(value)
        else:
            kind = "a bool or None (undefined)" if allow_none else "a bool"
            raise ValueError(f"{what}[{key!r}] must be {kind}, got {value!r}")
    return out


def write_results(stem: str, *, data: Mapping, claims: Mapping[str, bool | None] | None = None,
                  checks: Mapping[str, bool] | None = None, parameters: Mapping | None = None,
                  out_dir: str | os.PathLike = "figures", name: str | None = None) -> Path:
    """Write ``<out_dir>/<stem>.json`` = {name, claims, checks, data, parameters, versions, git_revision, format}.

    ``claims``: what the figure is evidence for, each True (held), False (did not hold) or None (undefined in
    this run, e.g. nothing to predict); ``checks``: consistency checks that hold by construction when the code is
    right (a theorem, an identity), kept apart so that they are never read as evidence. ``data`` holds the plotted
    numbers.
    """
    stem = _check_stem(stem)
    if not isinstance(data, Mapping):
        raise ValueError(f"data must be a mapping of the plotted numbers, got {type(data).__name__}")
    record = {
        "name": name or stem,
        "format": RESULTS_FORMAT,
        "claims": _check_flags(claims, "claims", allow_none=True),
        "checks": _check_flags(checks, "checks", allow_none=False),
        "data": to_jsonable(data),
        "parameters": to_jsonable(dict(parameters or {})),
        "versions": library_versions(),
        "git_revision": git_revision(),
    }
    text = json.dumps(record, indent=1, sort_keys=False, allow_nan=False) + "\n"
    return atomic_write_text(Path(out_dir) / f"{stem}.json", text)


def read_results(path: str | os.PathLike) -> dict:
    """Read a results JSON written by :func:`write_results`, checking its format version."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no results file at {path}; regenerate it with `pathlab figures`")
    with open(path, encoding="utf-8") as f:
        record = json.load(f)
    fmt = record.get("format") if isinstance(record, dict) else None
    if fmt != RESULTS_FORMAT:
        raise ValueError(f"{path} has results format {fmt!r}, this pathlab reads format {RESULTS_FORMAT}; "
                         f"regenerate it with `pathlab figures --only {path.stem}`")
    for key in ("name", "claims", "data"):
        if key not in record:
            raise ValueError(f"{path} lacks the field {key!r}; regenerate it with `pathlab figures`")
    return record


# ----------------------------------------------------------------------------------------------------------------
# benchmark result files


def write_benchmark_result(path: str | os.PathLike, script: str, argv, **payload) -> Path:
    """A benchmark's JSON result file, atomically: ``{"command": "python <script> <argv…>", **payload}``, so that
    the file says how it was made."""
    command = " ".join(["python", script, *argv])
    return atomic_write_text(path, json.dumps(dict(command=command, **to_jsonable(payload)), indent=1))
