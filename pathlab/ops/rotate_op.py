"""The custom op ``pathlab::rotate_pairs``: block rotations of ``[B, T, H, D]`` tensors on CUDA, opaque to
``torch.compile``, with its own backward.

    y = R(σφ) x  on each pair (x_b, x_{b+D/2}),  σ = +1 (rotate) or −1 (rotate back)
    dx = R(−σφ) dy   (R(σφ)ᵀ = R(−σφ))

cos/sin are fp32 tables broadcastable to ``[B, T, H, D/2]`` (RoPE's ``[1, T, 1, D/2]``, the accumulated
rotations' ``[B, T, H, D/2]``) and get no gradient, so the op serves rotations whose angles are constants (RoPE,
random rotations); learned angles stay PyTorch expressions. The arithmetic runs in fp32 and the result has x's
dtype, as in :func:`pathlab.ops.positions.rotate_cos_sin`. The kernel is :mod:`pathlab.kernels.rotary`, imported
when the op first runs (never while ``torch.compile`` traces, and ``import pathlab`` does not import triton).

Why an op: written in PyTorch under ``torch.compile``, Inductor fused RoPE's back-rotation of dq and dk with the
concatenation of dq, dk, dv into the qkv projection's gradient, a kernel many times slower than the copy alone. As
an op, the rotation is one read and one write of x in either direction, and the concatenation stays a plain copy.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("pathlab::rotate_pairs", mutates_args=())
def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: int) -> torch.Tensor:
    """R(sign · φ) x for ``x [B, T, H, D]`` (last dim unit stride or copied), cos/sin fp32 broadcastable to
    ``[B, T, H, D/2]``; returns a contiguous tensor of x's dtype. ``sign`` is +1 or −1."""
    from pathlab.kernels.rotary import rotate_launch

    return rotate_launch(x, cos, sin, sign)


@rotate_pairs.register_fake
def _(x, cos, sin, sign):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _setup(ctx, inputs, output):
    _, cos, sin, sign = inputs
    ctx.save_for_backward(cos, sin)
    ctx.sign = sign


def _backward(ctx, grad):
    cos, sin = ctx.saved_tensors
    return rotate_pairs(grad, cos, sin, -ctx.sign), None, None, None


rotate_pairs.register_autograd(_backward, setup_context=_setup)


def supports_input(x: torch.Tensor) -> bool:
    """Whether :func:`rotate_pairs` takes this x: 4-D, fp32, fp16 or bf16."""
    return x.dim() == 4 and x.dtype in (torch.float32, torch.float16, torch.bfloat16)


def supports(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether :func:`rotate_pairs` can rotate ``x`` by these tables: a 4-D x of fp32, fp16 or bf16, fp32 tables
    of at most 4 dims that need no gradient, all on one device. (``requires_grad is False`` rather than ``not``:
    under ``torch.compile``, Dynamo cannot apply ``not`` to a tensor attribute it does not know, and broke the graph
    there.)"""
    return (supports_input(x) and cos.dtype == torch.float32 and sin.dtype == torch.float32
            and cos.dim() <= 4 and sin.dim() <= 4
            and cos.requires_grad is False and sin.requires_grad is False
            and cos.device == x.device and sin.device == x.device)
