"""Triton kernel of the block rotation behind the custom op ``pathlab::rotate_pairs``
(:mod:`pathlab.ops.rotate_op`, where the op, its gradient and the reason for it are written out).

    y = R(σφ) x  on each pair (x_b, x_{b+D/2}):  y_b = x_b cos φ − σ x_{b+D/2} sin φ,
                                                 y_{b+D/2} = x_{b+D/2} cos φ + σ x_b sin φ

One program rotates ``ROWS`` rows (b, t, h) of ``x [B, T, H, D]`` (any strides, unit stride inside a head) by fp32
cos/sin broadcast to ``[B, T, H, D/2]`` (stride 0 on broadcast axes), in fp32, into a contiguous y of x's dtype.
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


def rotate_launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: int) -> torch.Tensor:
    """y = R(sign · φ) x; see the module docstring. x ``[B, T, H, D]``, cos/sin broadcastable to ``[B, T, H, D/2]``."""
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
