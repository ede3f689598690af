"""How the kernels run: under Triton's interpreter or on a GPU, and what that means for their output buffers."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (the kernels run on the CPU, for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def debug_enabled() -> bool:
    """``PATHLAB_DEBUG=1`` (the library's debug switch, read here too: ``kernels`` imports nothing from pathlab)."""
    return os.environ.get("PATHLAB_DEBUG", "0") not in ("", "0", "false", "False")


def unwritten(shape, *, dtype, device) -> torch.Tensor:
    """A buffer that a kernel writes completely: NaN-filled under the interpreter or with ``PATHLAB_DEBUG=1``, so
    that an element the kernel fails to write shows as NaN in the tests; uninitialised otherwise (the fill would
    cost a pass over the buffer in every call)."""
    if interpreting() or debug_enabled():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)
