"""The rotation op ``pathlab::rotate_pairs`` (``pathlab/ops/rotate_op.py``, Triton kernel in ``kernels/rotary.py``)
against the PyTorch rotation.

Oracle: :func:`pathlab.ops.positions.rotate_cos_sin` in fp64 (its CPU path is the PyTorch expression),
differentiated by autograd. Compared by relative RMS error on the output and on dx, on fresh random inputs:
RoPE-shaped tables ``[1, T, 1, D/2]`` and per-head tables ``[B, T, H, D/2]``, odd half widths, partial row
blocks, non-contiguous x (a slice of a fused qkv tensor) and fp32/fp16 inputs, both directions.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of the kernels

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter tests run on CPU-only machines"
)

from pathlab.ops.rotate_op import rotate_pairs, supports  # noqa: E402
from pathlab.ops.positions import rotate_cos_sin  # noqa: E402
from pathlab.testing import rel_err  # noqa: E402


def tables(shape, gen):
    phase = torch.rand(shape, generator=gen, dtype=torch.float64) * 2 * torch.pi
    return torch.cos(phase), torch.sin(phase)


def qkv_slice(B, T, H, D, dtype, gen):
    """q as the first third of a fused projection ``[B, T, 3·H·D]``: non-contiguous, unit last stride."""
    qkv = torch.randn(B, T, 3 * H * D, generator=gen).to(dtype)
    return qkv[..., : H * D].unflatten(-1, (H, D))


CASES = [  # B, T, H, D, per-head tables
    (1, 1, 1, 2, False),
    (2, 17, 3, 6, False),  # half width 3: padded columns
    (2, 33, 5, 64, False),  # rows not a multiple of the block
    (3, 7, 4, 16, True),  # cos/sin per batch, token and head (accumulated rotations)
    (1, 100, 2, 128, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("B,T,H,D,per_head", CASES)
def test_rotation_op_matches_the_fp64_rotation(B, T, H, D, per_head, inverse, dtype):
    gen = torch.Generator().manual_seed(hash((B, T, H, D, per_head, inverse)) % 2**31)
    x = qkv_slice(B, T, H, D, dtype, gen).requires_grad_()
    assert not x.is_contiguous() or T * H == 1
    cos, sin = tables((B, T, H, D // 2) if per_head else (1, T, 1, D // 2), gen)
    dy = torch.randn(B, T, H, D, generator=gen).to(dtype)
    x64 = x.detach().double().requires_grad_()  # the same values: only the op's own rounding is measured
    y64 = rotate_cos_sin(x64, cos, sin, inverse=inverse)
    (dx64,) = torch.autograd.grad(y64, x64, dy.double())

    y = rotate_pairs(x, cos.float(), sin.float(), -1 if inverse else 1)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert y.dtype == dtype and y.is_contiguous() and dx.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-3  # fp32 arithmetic; fp16 rounds the result (2^-11 relative)
    assert rel_err(y, y64) < tol
    assert rel_err(dx, dx64) < tol


def test_rotating_back_undoes_the_rotation():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, 3, 32, generator=gen)
    cos, sin = (t.float() for t in tables((1, 9, 1, 16), gen))
    there = rotate_pairs(x, cos, sin, 1)
    assert rel_err(there, x) > 0.1  # it did rotate
    assert rel_err(rotate_pairs(there, cos, sin, -1), x) < 1e-6


def test_rotation_op_opcheck():
    """Schema, fake (meta) shapes, autograd registration and AOT dispatch, as ``torch.compile`` uses them."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, 3, 8, generator=gen, requires_grad=True)
    cos, sin = (t.float() for t in tables((1, 5, 1, 4), gen))
    torch.library.opcheck(torch.ops.pathlab.rotate_pairs.default, (x, cos, sin, -1))


def test_compiled_rotation_equals_eager():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 11, 2, 16, generator=gen, requires_grad=True)
    cos, sin = (t.float() for t in tables((1, 11, 1, 8), gen))

    def f(x):
        return rotate_pairs(x, cos, sin, -1).square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    (g_eager,) = torch.autograd.grad(f(x), x)
    (g_compiled,) = torch.autograd.grad(compiled(x), x)
    assert torch.equal(g_eager, g_compiled)


def test_supports_only_constant_fp32_tables():
    x = torch.randn(1, 4, 2, 8)
    cos, sin = torch.ones(1, 4, 1, 4), torch.zeros(1, 4, 1, 4)
    assert supports(x, cos, sin)
    assert not supports(x, cos.double(), sin.double())  # fp64 rotations stay in PyTorch
    assert not supports(x, cos.requires_grad_(), sin)  # learned angles need d cos, d sin
    assert not supports(x[0], cos.detach(), sin)  # 3-D x


@pytest.mark.parametrize("attention", ["rope", "rot_random_qk", "rot_random_qkv", "rot_learned_qkv"])
def test_whole_model_compiles_through_the_op_without_a_graph_break(attention, monkeypatch):
    """The op path that CUDA takes, forced on the CPU: the whole model compiles in one graph (the cached RoPE table
    and the op together), every rotation by constant angles is a call of the op (learned angles, which need
    gradients, stay PyTorch), and loss and gradients equal eager."""
    import pathlab
    from pathlab.kernels import rotary
    from pathlab.ops import positions

    monkeypatch.setattr(positions, "_on_cuda", lambda x: True)
    launches = []
    launch = rotary.rotate_launch

    def counted(*args):
        launches.append(args[-1])
        return launch(*args)

    monkeypatch.setattr(rotary, "rotate_launch", counted)
    torch.manual_seed(0)
    model = pathlab.build_model(pathlab.ModelConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64,
                                                    attention=attention))
    idx = torch.randint(0, 64, (2, 16))

    def loss_and_grads(fn):
        model.zero_grad(set_to_none=True)
        loss = fn(idx, idx)[1]
        loss.backward()
        return [loss.detach()] + [p.grad for p in model.parameters() if p.grad is not None]

    eager = loss_and_grads(model)
    values = attention.endswith("qkv")  # also v, and o rotated back
    rotations = 0 if attention.startswith("rot_learned") else 2 * (3 if values else 2) + 2 * values
    assert len(launches) == 2 * rotations  # each rotation once forward, once backward
    torch._dynamo.reset()
    launches.clear()
    compiled = loss_and_grads(torch.compile(model, backend="aot_eager", fullgraph=True))
    assert len(launches) == 2 * rotations
    assert len(compiled) == len(eager)
    for got, want in zip(compiled, eager):
        assert rel_err(got, want) < 1e-5


def test_rotation_op_takes_expanded_kv_heads():
    """Grouped kv heads reach the rotation expanded (stride 0 over the head axis); the op reads them in place and
    autograd sums the gradient back over the group."""
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(2, 9, 1, 16, generator=gen, requires_grad=True)
    cos, sin = (t.float() for t in tables((2, 9, 3, 8), gen))
    expanded = k.expand(2, 9, 3, 16)
    assert expanded.stride(2) == 0
    dy = torch.randn(2, 9, 3, 16, generator=gen)
    (dk,) = torch.autograd.grad(rotate_pairs(expanded, cos, sin, -1), k, dy)
    k64 = k.detach().double().requires_grad_()
    y64 = rotate_cos_sin(k64.expand(2, 9, 3, 16), cos.double(), sin.double(), inverse=True)
    (dk64,) = torch.autograd.grad(y64, k64, dy.double())
    assert rel_err(rotate_pairs(expanded, cos, sin, -1), y64) < 1e-6
    assert rel_err(dk, dk64) < 1e-6
