"""Attention variants behind one interface, keyed by name (see :mod:`pathlab.attention.registry`)."""

from pathlab.attention.base import AttentionRecord, PositionalAttention
from pathlab.attention.registry import attention_options, available_attention, build_attention, describe_attention

__all__ = [
    "AttentionRecord",
    "PositionalAttention",
    "attention_options",
    "available_attention",
    "build_attention",
    "describe_attention",
]
