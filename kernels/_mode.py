"""How the kernels run: under Triton's interpreter or on a GPU, and what that means for their output buffers."""

from __future__ import annotations

import os

import torch

from pathlab._checks import debug_enabled


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (the kernels run on the CPU, for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def unwritten(shape, *, dtype, device) -> torch.Tensor:
    """A buffer that a kernel writes completely: NaN-filled under the interpreter or with ``PATHLAB_DEBUG=1``, so
    an element the kernel fails to write shows as NaN in the tests; uninitialised otherwise (on an H200 the NaN
    fills took about 5 ms of a 187 ms ``owt16`` training step)."""
    if interpreting() or debug_enabled():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


SWITCH_VALUES = ("auto", "0", "1")


def switch(name: str, auto: bool) -> bool:
    """An on/off setting of the kernels from the environment: ``"1"``, ``"0"``, or ``"auto"`` (unset) = ``auto``."""
    value = os.environ.get(name) or "auto"
    if value not in SWITCH_VALUES:
        raise ValueError(f"{name} must be one of {SWITCH_VALUES}, got {value!r}")
    return auto if value == "auto" else value == "1"
