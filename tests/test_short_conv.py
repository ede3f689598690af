"""PaTH's short convolution op ``pathlab::short_conv_silu`` (``pathlab/ops/short_conv.py``, Triton kernels in
``kernels/short_conv.py``) against the PyTorch expression.

Oracle: :func:`pathlab.ops.short_conv.conv_silu_expression` (the PyTorch expression) in fp64,
differentiated by autograd. Compared by relative RMS error on y, dx and d taps, on fresh random inputs: widths 1 to
4, sequences shorter than the filter, steps and channels that are not multiples of the kernels' blocks (so that
blocks straddle the end of a sequence and of the channels), x a slice of a wider projection, fp32 and fp16.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of the kernels

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter tests run on CPU-only machines"
)

from pathlab.ops import short_conv  # noqa: E402
from pathlab.ops.short_conv import conv_silu_expression, short_conv_silu, supports  # noqa: E402
from pathlab.testing import rel_err  # noqa: E402

CASES = [  # B, T, C, K
    (1, 1, 3, 3),  # one step: only the last tap sees an input
    (2, 2, 5, 4),  # shorter than the filter
    (2, 70, 130, 3),  # 64-step and 128-channel blocks, each with a partial one
    (3, 129, 64, 2),
    (1, 9, 4, 1),  # no convolution, SiLU alone
]


def inputs(B, T, C, K, dtype, gen):
    """x as a slice of a wider projection ``[B, T, C + 3]`` (unit channel stride, not contiguous), taps in fp32 as
    the module holds them, dy."""
    x = (2 * torch.randn(B, T, C + 3, generator=gen)).to(dtype)[..., 1:C + 1]
    taps = torch.randn(C, K, generator=gen)
    return x, taps, torch.randn(B, T, C, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("B,T,C,K", CASES)
def test_op_matches_the_fp64_convolution(B, T, C, K, dtype):
    gen = torch.Generator().manual_seed(hash((B, T, C, K, dtype.itemsize)) % 2**31)
    x, taps, dy = inputs(B, T, C, K, dtype, gen)
    assert not x.is_contiguous() or B * T == 1
    x64, taps64 = (t.detach().double().requires_grad_() for t in (x, taps))  # the same values: only the op's rounding
    y64 = conv_silu_expression(x64, taps64)
    dx64, dtaps64 = torch.autograd.grad(y64, (x64, taps64), dy.double())

    x, taps = x.requires_grad_(), taps.requires_grad_()
    y = short_conv_silu(x, taps)
    dx, dtaps = torch.autograd.grad(y, (x, taps), dy)
    assert y.dtype == dx.dtype == dtype and y.is_contiguous() and dtaps.dtype == torch.float32
    tol = 1e-6 if dtype == torch.float32 else 1e-3  # fp32 arithmetic; fp16 rounds y and dx (2^-11 relative)
    assert rel_err(y, y64) < tol
    assert rel_err(dx, dx64) < tol
    assert rel_err(dtaps, dtaps64) < 1e-5  # fp32 sums of fp16 products: exact inputs, fp32 rounding


def test_the_convolution_is_causal_and_starts_from_zeros():
    """y_t depends on x_{t−K+1} … x_t only; and the PyTorch expression with a tail of zeros is the one without."""
    gen = torch.Generator().manual_seed(5)
    x, taps, _ = inputs(2, 12, 6, 3, torch.float32, gen)
    changed = x.clone()
    changed[:, 7] += 1.0
    before, after = short_conv_silu(x, taps), short_conv_silu(changed, taps)
    assert torch.equal(before[:, :7], after[:, :7])
    assert not torch.equal(before[:, 7:10], after[:, 7:10])
    assert torch.equal(before[:, 10:], after[:, 10:])
    tail = torch.zeros(2, 2, 6)
    assert torch.equal(conv_silu_expression(x, taps, tail), conv_silu_expression(x, taps))


def test_empty_sequences_give_empty_outputs_and_zero_tap_gradients():
    x = torch.randn(2, 0, 5, requires_grad=True)
    taps = torch.randn(5, 3, requires_grad=True)
    y = short_conv_silu(x, taps)
    assert y.shape == (2, 0, 5)
    dx, dtaps = torch.autograd.grad(y, (x, taps), torch.zeros(2, 0, 5))
    assert dx.shape == (2, 0, 5) and torch.equal(dtaps, torch.zeros(5, 3))


def test_op_opcheck():
    """Schema, fake (meta) shapes, autograd registration and AOT dispatch, as ``torch.compile`` uses them."""
    gen = torch.Generator().manual_seed(2)
    x, taps, dy = inputs(2, 7, 5, 3, torch.float32, gen)
    torch.library.opcheck(torch.ops.pathlab.short_conv_silu.default, (x.requires_grad_(), taps.requires_grad_()))
    torch.library.opcheck(torch.ops.pathlab.short_conv_silu_backward.default, (x.detach(), taps.detach(), dy))


def test_compiled_op_equals_eager():
    gen = torch.Generator().manual_seed(3)
    x, taps, _ = inputs(2, 11, 6, 3, torch.float32, gen)
    x, taps = x.requires_grad_(), taps.requires_grad_()

    def f(x, taps):
        return short_conv_silu(x, taps).square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    eager = torch.autograd.grad(f(x, taps), (x, taps))
    again = torch.autograd.grad(compiled(x, taps), (x, taps))
    for got, want in zip(again, eager):
        assert torch.equal(got, want)


def test_supports():
    x, taps = torch.randn(1, 4, 6), torch.randn(6, 3)
    assert supports(x, taps)
    assert not supports(x.double(), taps)  # fp64 stays in PyTorch
    assert not supports(x, taps[:5])  # one filter per channel
    assert not supports(x[0], taps)  # 3-D x
    assert not supports(x, torch.randn(6, 0))


def test_path_module_uses_the_op_where_cuda_would(monkeypatch):
    """The route CUDA takes, forced on the CPU: PaTH's w (projection, convolution, SiLU) and its gradients equal
    the PyTorch expression's, and the op runs once each way; with a tail (generation) the expression runs."""
    import pathlab
    from pathlab.kernels import short_conv as kernels

    torch.manual_seed(0)
    model = pathlab.build_model(pathlab.ModelConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=64, attention="path"))
    attention = next(m for m in model.modules() if type(m).__name__ == "PaTH")
    x = torch.randn(2, 70, 32)

    def w_and_grads():
        model.zero_grad(set_to_none=True)
        w = attention.path_inputs(x)[0]
        (w.square() * torch.arange(w.shape[1]).view(1, -1, 1, 1)).sum().backward()
        return [w.detach(), attention.w_conv.grad] + [p.grad for p in attention.w_proj.parameters()]

    expression = w_and_grads()
    calls = []
    for name in ("short_conv_silu_launch", "short_conv_silu_backward_launch"):
        launch = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _launch=launch, _name=name: calls.append(_name) or _launch(*a))
    monkeypatch.setattr(short_conv, "_on_cuda", lambda x: True)
    through_op = w_and_grads()
    assert calls == ["short_conv_silu_launch", "short_conv_silu_backward_launch"]
    for got, want in zip(through_op, expression):
        assert rel_err(got, want) < 1e-6
    calls.clear()
    attention.path_inputs(x, conv_tail=torch.zeros(2, 2, 32))
    assert calls == []


def test_every_tile_gives_the_same_convolution():
    """``KernelConfig.short_conv_tile`` changes only how the work is cut: y and dx are the same bit for bit, d taps
    the same sums in another order; a tile that is not three powers of two is refused."""
    from pathlab.kernels import KernelConfig
    from pathlab.kernels.short_conv import short_conv_silu_backward_launch, short_conv_silu_launch

    gen = torch.Generator().manual_seed(6)
    x, taps, dy = inputs(2, 37, 20, 3, torch.float32, gen)

    def run(config=None):
        return [short_conv_silu_launch(x, taps, config), *short_conv_silu_backward_launch(x, taps, dy, config)]

    default = run()
    other = run(KernelConfig(short_conv_tile=(4, 8, 1)))
    assert torch.equal(other[0], default[0]) and torch.equal(other[1], default[1])
    assert rel_err(other[2], default[2]) < 1e-6
    for bad in ((3, 8, 1), (8, 8)):
        with pytest.raises(ValueError, match="short_conv_tile must be three powers of two"):
            KernelConfig(short_conv_tile=bad)
