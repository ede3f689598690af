"""Attention variants by name: ``build_attention("path", ...)``; :func:`available_attention` lists them.

A new variant is a :class:`~pathlab.attention.base.PositionalAttention` subclass in its own module plus one entry
here (or a :func:`register_attention` call): the model, the probes and the task runner ask the class, never the
name.
"""

from __future__ import annotations

import inspect

from pathlab.attention.alibi import ALiBi
from pathlab.attention.base import PositionalAttention
from pathlab.attention.fox import FoX
from pathlab.attention.nope import NoPE
from pathlab.attention.path import PaTH
from pathlab.attention.rope import RoPE
from pathlab.attention.rotation import RotationAttention

# name -> (class, fixed keyword arguments, one-line description)
REGISTRY: dict[str, tuple[type[PositionalAttention], dict, str]] = {
    "nope": (NoPE, {}, "no positional encoding"),
    "rope": (RoPE, {}, "rotary position embedding, s = qᵀ R^{i−j} k"),
    "alibi": (ALiBi, {}, "linear distance bias −m_h (i − j)"),
    "fox": (FoX, {}, "forgetting attention: cumulative log forget gates"),
    "path": (PaTH, {"use_gate": False}, "PaTH: accumulated Householder transitions I − β w wᵀ"),
    "path_fox": (PaTH, {"use_gate": True}, "PaTH with a FoX forget gate"),
    "rot_random_qk": (RotationAttention, {"mode": "random", "rotate_values": False, "forget_gate": False},
                      "accumulated random SO(2) rotations of q and k"),
    "rot_random_qkv": (RotationAttention, {"mode": "random", "rotate_values": True, "forget_gate": False},
                       "accumulated random SO(2) rotations of q, k and v"),
    "rot_learned_qk": (RotationAttention, {"mode": "learned", "rotate_values": False, "forget_gate": False},
                       "accumulated learned token-dependent rotations of q and k (starts as RoPE)"),
    "rot_learned_qkv": (RotationAttention, {"mode": "learned", "rotate_values": True, "forget_gate": False},
                        "accumulated learned token-dependent rotations of q, k and v (starts as RoPE)"),
    "rot_random_qk_fox": (RotationAttention, {"mode": "random", "rotate_values": False, "forget_gate": True},
                          "accumulated random SO(2) rotations of q and k with a FoX forget gate"),
}

_COMMON = ("n_embd", "n_head", "n_kv_head", "head_dim", "vocab_size", "layer_idx")


def available_attention() -> list[str]:
    """The registered variant names."""
    return list(REGISTRY)


def describe_attention() -> dict[str, str]:
    return {name: entry[2] for name, entry in REGISTRY.items()}


def attention_options(name: str) -> dict[str, object]:
    """The keyword options a variant accepts (``attention_kwargs``) with their defaults."""
    cls, fixed, _ = _lookup(name)
    params = {}
    for klass in cls.__mro__:
        if klass is PositionalAttention or not issubclass(klass, PositionalAttention):
            continue
        for p in inspect.signature(klass.__init__).parameters.values():
            if p.kind == p.KEYWORD_ONLY and p.name not in fixed and p.name not in _COMMON:
                params.setdefault(p.name, p.default)
    return params


def _lookup(name: str):
    if name not in REGISTRY:
        raise ValueError(f"unknown attention {name!r}; known: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def attention_class(name: str) -> type[PositionalAttention]:
    """The class of variant ``name`` (its class attributes answer questions asked before a model is built)."""
    return _lookup(name)[0]


def register_attention(name: str, cls: type[PositionalAttention], description: str, **fixed) -> None:
    """Add variant ``name``: ``cls`` built with the keyword options ``fixed`` (those are not user options)."""
    if not (isinstance(cls, type) and issubclass(cls, PositionalAttention)):
        raise ValueError(f"attention {name!r}: {cls!r} is not a PositionalAttention subclass")
    if not isinstance(name, str) or not name or name in REGISTRY:
        raise ValueError(f"attention name {name!r} is empty or already registered")
    REGISTRY[name] = (cls, dict(fixed), description)


def _check_options(name: str, kwargs: dict) -> dict:
    allowed = attention_options(name)
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise ValueError(f"attention {name!r} does not take {unknown}; its options are {sorted(allowed)}")
    return allowed


def attention_settings(name: str, **kwargs) -> dict:
    """Every keyword option variant ``name`` is built with: its options' defaults, overridden by the registry's
    fixed options and by ``kwargs`` (unknown ones raise ``ValueError``). Reads a run's variant from its config
    without building a model, e.g. ``attention_settings("rot_random_qkv")["rotate_values"]``."""
    _, fixed, _ = _lookup(name)
    return {**_check_options(name, kwargs), **fixed, **kwargs}


def build_attention(name: str, *, n_embd: int, n_head: int, n_kv_head: int, head_dim: int, vocab_size: int,
                    layer_idx: int = 0, **kwargs) -> PositionalAttention:
    """Instantiate variant ``name``; unknown options raise ``ValueError`` listing the accepted ones."""
    cls, fixed, _ = _lookup(name)
    _check_options(name, kwargs)
    return cls(n_embd=n_embd, n_head=n_head, n_kv_head=n_kv_head, head_dim=head_dim, vocab_size=vocab_size,
               layer_idx=layer_idx, **fixed, **kwargs)
