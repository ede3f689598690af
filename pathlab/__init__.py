"""pathlab: position encodings in attention.

Public API (layout ``[B, T, H, D]`` everywhere, like FlashAttention):

* ops: :func:`path_attention`, :func:`nope_attention`, :func:`rope_attention`, :func:`alibi_attention`,
  :func:`fox_attention`, :func:`rotation_attention`; explicit fp64 ground truths live in :mod:`pathlab.reference`;
* models: :class:`ModelConfig`, :func:`build_model`, :func:`available_attention`.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "path_attention": "pathlab.ops.path",
    "nope_attention": "pathlab.ops.softmax",
    "rope_attention": "pathlab.ops.softmax",
    "alibi_attention": "pathlab.ops.softmax",
    "fox_attention": "pathlab.ops.softmax",
    "rotation_attention": "pathlab.ops.softmax",
    "alibi_slopes": "pathlab.ops.positions",
    "ModelConfig": "pathlab.model",
    "build_model": "pathlab.model",
    "available_attention": "pathlab.attention.registry",
    "build_attention": "pathlab.attention.registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    # Imported on first use: `import pathlab` stays cheap and never touches the GPU.
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in ("reference", "kernels", "probes", "data", "tasks", "attention", "ops"):
        return importlib.import_module(f"pathlab.{name}")
    raise AttributeError(f"module 'pathlab' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
