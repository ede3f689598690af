"""PaTH's short convolution: a causal depthwise convolution over time with SiLU, and the custom op
``pathlab::short_conv_silu`` that runs it on CUDA.

    y_t = silu(Σ_k x_{t−K+1+k} ⊙ f_k),   f = taps ``[C, K]``,   x ``[B, T, C]``

The inputs before the sequence's start are ``tail`` (the last K − 1 inputs while generating), zeros without one.
The arithmetic runs in fp32 at least and y has x's dtype.

Why an op: as K shifted products in PyTorch under ``torch.compile``, Inductor made the padded window, the product
sums and SiLU, and their gradients, in six kernels, three each way, where reading x and writing y, then reading x
and dy and writing dx, is all the work needs. The op is one kernel each way (:mod:`pathlab.kernels.short_conv`:
the backward recomputes z from x and keeps nothing else) and a sum of the per-program parts of d taps. The
kernels are imported when the op first runs, never while ``torch.compile`` traces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _unit_channel_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@torch.library.custom_op("pathlab::short_conv_silu", mutates_args=())
def short_conv_silu(x: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """silu(causal depthwise conv) of ``x [B, T, C]`` (fp32, fp16 or bf16) by ``taps [C, K]`` from zeros before
    t = 0; a contiguous y of x's dtype."""
    from pathlab.kernels.short_conv import short_conv_silu_launch

    return short_conv_silu_launch(_unit_channel_stride(x), taps.contiguous())


@short_conv_silu.register_fake
def _(x, taps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("pathlab::short_conv_silu_backward", mutates_args=())
def short_conv_silu_backward(x: torch.Tensor, taps: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx of x's dtype, d taps of taps' dtype) of :func:`short_conv_silu` given dy."""
    from pathlab.kernels.short_conv import short_conv_silu_backward_launch

    dx, dtaps = short_conv_silu_backward_launch(_unit_channel_stride(x), taps.contiguous(), _unit_channel_stride(dy))
    return dx, dtaps.to(taps.dtype)


@short_conv_silu_backward.register_fake
def _(x, taps, dy):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty_like(taps)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    x, taps = ctx.saved_tensors
    return short_conv_silu_backward(x, taps, dy)


short_conv_silu.register_autograd(_backward, setup_context=_setup)


def supports(x: torch.Tensor, taps: torch.Tensor) -> bool:
    """Whether :func:`short_conv_silu` takes these inputs: a 3-D x and 2-D taps ``[C, K]`` of fp32, fp16 or bf16,
    K ≥ 1, on one device."""
    return (x.dim() == 3 and taps.dim() == 2 and taps.shape[0] == x.shape[-1] and taps.shape[1] >= 1
            and x.dtype in _DTYPES and taps.dtype in _DTYPES and taps.device == x.device)


def _on_cuda(x: torch.Tensor) -> bool:
    return x.is_cuda


def causal_conv_silu(x: torch.Tensor, taps: torch.Tensor, tail: torch.Tensor | None = None) -> torch.Tensor:
    """y_t = silu(Σ_k x_{t−K+1+k} ⊙ taps[:, k]) for ``x [B, T, C]``, ``taps [C, K]``; ``tail [B, K − 1, C]`` holds
    the inputs before t = 0 (zeros if None). Summed in fp32 at least; y has x's dtype.

    On CUDA without a tail this is the custom op :func:`short_conv_silu`; otherwise :func:`conv_silu_expression`."""
    if tail is None and _on_cuda(x) and supports(x, taps):
        return short_conv_silu(x, taps)
    return conv_silu_expression(x, taps, tail)


def conv_silu_expression(x: torch.Tensor, taps: torch.Tensor, tail: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`causal_conv_silu` as K shifted products in PyTorch (the op's reference)."""
    B, T, C = x.shape
    K = taps.shape[1]
    if tail is None:
        tail = x.new_zeros(B, K - 1, C)
    work = torch.promote_types(x.dtype, torch.float32)
    window = torch.cat((tail.to(x.dtype), x), dim=1).to(work)  # [B, T + K − 1, C]
    f = taps.to(work)  # [C, K]
    z = window[:, :T] * f[:, 0]
    for k in range(1, K):
        z = z + window[:, k:k + T] * f[:, k]
    return F.silu(z).to(x.dtype)
