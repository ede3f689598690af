"""Attention variants behind one interface, keyed by name (see :mod:`pathlab.attention.registry`)."""

from pathlab.attention.base import AttentionRecord, PositionalAttention, ScoreTerms
from pathlab.attention.registry import (attention_class, attention_options, attention_settings, available_attention,
                                        build_attention, describe_attention, register_attention)

__all__ = [
    "AttentionRecord",
    "PositionalAttention",
    "ScoreTerms",
    "attention_class",
    "attention_options",
    "attention_settings",
    "available_attention",
    "build_attention",
    "describe_attention",
    "register_attention",
]
