"""Explicit, obviously-correct fp64 implementations that materialise T×T: the ground truth for tests and probes."""

from pathlab.reference.path import path_attention, path_logits
from pathlab.reference.softmax import (
    alibi_attention,
    causal_softmax_output,
    fox_attention,
    nope_attention,
    rope_attention,
    rotation_attention,
)

__all__ = [
    "path_attention",
    "path_logits",
    "nope_attention",
    "rope_attention",
    "rotation_attention",
    "alibi_attention",
    "fox_attention",
    "causal_softmax_output",
]
