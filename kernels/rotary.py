"""Block rotations of ``[B, T, H, D]`` tensors in Triton, as one opaque custom op with its own backward.

    y = R(σφ) x  on each pair (x_b, x_{b+D/2}):  y_b = x_b cos φ − σ x_{b+D/2} sin φ,
                                                 y_{b+D/2} = x_{b+D/2} cos φ + σ x_b sin φ

with σ = +1 (rotate) or −1 (rotate back, ``inverse``). R(σφ)ᵀ = R(−σφ), so the gradient is the same kernel with
σ negated: dx = R(−σφ) dy. cos/sin are fp32 tables broadcastable to ``[B, T, H, D/2]`` (RoPE's ``[1, T, 1, D/2]``,
the accumulated rotations' ``[B, T, H, D/2]``); they get no gradient, so this op serves rotations whose angles
are constants (RoPE, random rotations). The arithmetic runs in fp32 and the result has x's dtype, as in
:func:`pathlab.ops.positions.rotate_cos_sin`.

Why a kernel: written in PyTorch under ``torch.compile``, Inductor fused the back-rotation of dq and dk with the
concatenation of dq, dk, dv into the qkv projection's gradient, and that fused kernel took 0.63 ms per layer of
the ``owt16`` model on an H200 (NoPE's concatenation alone: 0.07 ms), about 10 ms of an 83 ms training step.
As a custom op the rotation is one read and one write of x in either direction, and the concatenation stays a
plain copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_kernel(
    X, COS, SIN, Y,
    n_rows, T, H,
    sxb, sxt, sxh, scb, sct, sch,
    SIGN: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr, ROWS: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # rows (b, t, h) in y's order
    col = tl.arange(0, HALF_P)
    live = (r < n_rows)[:, None] & (col < HALF)[None, :]  # [ROWS, HALF_P]
    h = r % H
    t = (r // H) % T
    b = r // (H * T)
    xo = (b * sxb + t * sxt + h * sxh)[:, None] + col[None, :]
    co = (b * scb + t * sct + h * sch)[:, None] + col[None, :]
    x1 = tl.load(X + xo, mask=live, other=0.0).to(tl.float32)
    x2 = tl.load(X + xo + HALF, mask=live, other=0.0).to(tl.float32)
    c = tl.load(COS + co, mask=live, other=0.0)
    s = tl.load(SIN + co, mask=live, other=0.0) * SIGN
    yo = r[:, None] * (2 * HALF) + col[None, :]
    tl.store(Y + yo, (x1 * c - x2 * s).to(Y.dtype.element_ty), mask=live)
    tl.store(Y + yo + HALF, (x2 * c + x1 * s).to(Y.dtype.element_ty), mask=live)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: int) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    B, T, H, D = x.shape
    shape = (B, T, H, D // 2)
    cos, sin = cos.expand(shape), sin.expand(shape)
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    y = torch.empty(B, T, H, D, dtype=x.dtype, device=x.device)
    n_rows = B * T * H
    if n_rows == 0:
        return y
    half = D // 2
    rows = max(1, 2048 // triton.next_power_of_2(half))
    _rotate_kernel[(triton.cdiv(n_rows, rows),)](
        x, cos, sin, y, n_rows, T, H,
        x.stride(0), x.stride(1), x.stride(2), cos.stride(0), cos.stride(1), cos.stride(2),
        SIGN=sign, HALF=half, HALF_P=triton.next_power_of_2(half), ROWS=rows,
    )
    return y


@torch.library.custom_op("pathlab::rotate_pairs", mutates_args=())
def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: int) -> torch.Tensor:
    """R(sign · φ) x for ``x [B, T, H, D]`` (last dim unit stride or copied), cos/sin fp32 broadcastable to
    ``[B, T, H, D/2]``; returns a contiguous tensor of x's dtype. ``sign`` is +1 or −1."""
    return _launch(x, cos, sin, sign)


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


def supports(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether :func:`rotate_pairs` can rotate ``x`` by these tables: a 4-D x of fp32, fp16 or bf16, fp32 tables
    that need no gradient, all on one device."""
    return (x.dim() == 4 and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and cos.dtype == torch.float32 and sin.dtype == torch.float32
            and cos.dim() <= 4 and sin.dim() <= 4
            and not cos.requires_grad and not sin.requires_grad
            and cos.device == x.device and sin.device == x.device)
