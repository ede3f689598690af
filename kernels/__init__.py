"""Triton kernels of pathlab, importable as ``pathlab.kernels``.

* :func:`path_attention_triton`: PaTH / PaTH-FoX attention (forward and backward), the ``backend="triton"`` of
  :func:`pathlab.path_attention`.

Importing this package imports triton but touches no GPU. On a CPU the kernels run under the Triton
interpreter: set ``TRITON_INTERPRET=1`` before the first import (slow; meant for tests).
"""

from .path import SUPPORTED_HEAD_DIMS, path_attention_triton

__all__ = ["path_attention_triton", "SUPPORTED_HEAD_DIMS"]
