"""Triton kernels of pathlab, importable as ``pathlab.kernels``.

* :func:`path_attention_triton`: PaTH / PaTH-FoX attention (forward and backward), the ``backend="triton"`` of
  :func:`pathlab.path_attention`; :class:`KernelConfig` its launch tunables and pinned routes.
* ``decode``: the decoding step kernels of :class:`pathlab.decoding.PathDecodeCache`.
* ``short_conv``, ``rotary``: the kernels of :mod:`pathlab.ops.short_conv` and :mod:`pathlab.ops.rotate_op`.

One module per stage of the PaTH op: ``layout`` (chunking), ``ut_torch`` / ``ut_common`` + ``ut_forward`` +
``ut_backward`` (the per-chunk UT transform), ``scan`` (the scan's custom ops and launch choices) with
``scan_forward``, ``scan_backward_by_chunk``, ``scan_backward_by_sequence`` (its kernels), ``fused`` (UT + scan in
one op), ``path`` (the public op). This package imports nothing from ``pathlab``.

Importing this package imports triton but touches no GPU. On a CPU the kernels run under the Triton
interpreter: set ``TRITON_INTERPRET=1`` before the first import (slow; meant for tests).
"""

from .config import KernelConfig
from .path import SUPPORTED_HEAD_DIMS, path_attention_triton

__all__ = ["path_attention_triton", "KernelConfig", "SUPPORTED_HEAD_DIMS"]
