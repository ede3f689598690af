"""GPU checks of the softmax-family fast paths (SDPA, FlexAttention): run with `pytest -m gpu` on a CUDA machine."""

import pytest
import torch
import torch.nn.functional as F

import pathlab
from pathlab import reference
from pathlab.testing import assert_matches_reference, rel_err

pytestmark = pytest.mark.gpu


def _inputs(B, T, H, D, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, D, generator=gen) for _ in range(3))
    theta = torch.rand(B, T, H, D // 2, generator=gen) * 2
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 3)
    return [t.cuda().to(dtype).requires_grad_() for t in (q, k, v)] + [theta.cuda().requires_grad_(),
                                                                      g.cuda().requires_grad_()]


OPS = {
    "nope": (lambda q, k, v, th, g: pathlab.nope_attention(q, k, v), lambda q, k, v, th, g: reference.nope_attention(q, k, v)),
    "rope": (lambda q, k, v, th, g: pathlab.rope_attention(q, k, v), lambda q, k, v, th, g: reference.rope_attention(q, k, v)),
    "rot_qkv": (lambda q, k, v, th, g: pathlab.rotation_attention(q, k, v, th, rotate_values=True),
                lambda q, k, v, th, g: reference.rotation_attention(q, k, v, th, rotate_values=True)),
    "alibi": (lambda q, k, v, th, g: pathlab.alibi_attention(q, k, v), lambda q, k, v, th, g: reference.alibi_attention(q, k, v)),
    "fox": (lambda q, k, v, th, g: pathlab.fox_attention(q, k, v, g), lambda q, k, v, th, g: reference.fox_attention(q, k, v, g)),
}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", list(OPS))
def test_fast_matches_reference_on_gpu(op, dtype, tol):
    fast, ref = OPS[op]
    assert_matches_reference(fast, ref, _inputs(2, 333, 4, 64, dtype), tol, ("q", "k", "v", "theta", "g"))


@pytest.mark.parametrize("dtype,flex", [(torch.bfloat16, True), (torch.float16, True), (torch.float32, False)],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("op", ["alibi", "fox"])
def test_bias_attention_route(op, dtype, flex, monkeypatch):
    """Half precision runs on FlexAttention; fp32 (the probes' forward) on the chunked SDPA."""
    import pathlab.ops.softmax as softmax_ops

    calls, real_flex = [], softmax_ops._flex
    monkeypatch.setattr(softmax_ops, "_flex_failure", None)
    monkeypatch.setattr(softmax_ops, "_flex", lambda *args: calls.append(1) or real_flex(*args))
    OPS[op][0](*_inputs(1, 300, 2, 64, dtype))
    assert softmax_ops._flex_failure is None, softmax_ops._flex_failure
    assert bool(calls) == flex


@pytest.mark.parametrize("op", list(OPS))
def test_65k_tokens_without_a_txt_matrix(op):
    T, H, D = 65536, 2, 64
    inputs = _inputs(1, T, H, D, torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    out = OPS[op][0](*inputs)
    out.float().square().mean().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - start
    assert bool(torch.isfinite(out).all())
    assert extra < T * T * 2 / 4, f"{op}: {extra / 2**20:.0f} MiB extra looks like a T×T matrix"


@pytest.mark.parametrize("backend", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"])
@pytest.mark.parametrize("rotate_values", [False, True], ids=["qk", "qkv"])
def test_rotation_bf16_gradients_under_each_sdpa_backend(rotate_values, backend):
    """Pins down which SDPA backend gives a wrong bf16 gradient for rotated values (seen once with the default)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    inputs = _inputs(2, 333, 4, 64, torch.bfloat16)
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    with sdpa_kernel([getattr(SDPBackend, backend)]):
        try:
            out = pathlab.rotation_attention(*inputs[:4], rotate_values=rotate_values)
        except RuntimeError as err:
            pytest.skip(f"{backend} cannot run this case here: {err}")
        d_out = torch.randn(out.shape, dtype=torch.float64, device=out.device)
        grads = torch.autograd.grad(out, inputs[:4], d_out.to(torch.bfloat16))
    out_ref = reference.rotation_attention(*ref_inputs[:4], rotate_values=rotate_values)
    grads_ref = torch.autograd.grad(out_ref, ref_inputs[:4], d_out)
    assert rel_err(out, out_ref) < 2e-2
    for name, got, want in zip(("q", "k", "v", "theta"), grads, grads_ref):
        assert rel_err(got, want) < 2e-2, f"{backend}: d{name} {rel_err(got, want):.2e}"


@pytest.mark.parametrize("variant,rotate_values", [("rope", False), ("rotation", False), ("rotation", True)],
                         ids=["rope-qk", "rotation-qk", "rotation-qkv"])  # RoPE rotates queries and keys only
def test_rotation_kernel_matches_the_pytorch_rotation(variant, rotate_values, monkeypatch):
    """RoPE and constant-angle rotations run through ``pathlab::rotate_pairs`` on CUDA; the same call with
    ``ROTATE_BACKEND = "torch"`` (the PyTorch expression) and the fp64 reference agree with it, output and gradients."""
    from pathlab.ops import positions

    q, k, v, theta, _ = _inputs(2, 333, 4, 64, torch.bfloat16)
    theta = theta.detach()  # constant angles, as the random rotations have: the op's case

    def run(backend):
        monkeypatch.setattr(positions, "ROTATE_BACKEND", backend)
        if variant == "rope":
            out = pathlab.rope_attention(q, k, v)
        else:
            out = pathlab.rotation_attention(q, k, v, theta, rotate_values=rotate_values)
        return [out, *torch.autograd.grad(out, (q, k, v), d_out)]

    d_out = torch.randn(2, 333, 4, 64, device="cuda", dtype=torch.bfloat16)
    fast, slow = run("triton"), run("torch")
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    if variant == "rope":
        ref_out = reference.rope_attention(*ref_in)
    else:
        ref_out = reference.rotation_attention(*ref_in, theta.double(), rotate_values=rotate_values)
    ref = [ref_out, *torch.autograd.grad(ref_out, ref_in, d_out.double())]
    for name, a, b, r in zip(("o", "dq", "dk", "dv"), fast, slow, ref):
        assert rel_err(a, b) < 1e-2, f"{name}: kernel vs PyTorch {rel_err(a, b):.2e}"
        assert rel_err(a, r) < 2e-2, f"{name}: kernel vs fp64 {rel_err(a, r):.2e}"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)], ids=["fp32", "bf16"])
def test_short_conv_op_matches_the_fp64_expression(dtype, tol):
    """PaTH's short convolution on CUDA (the op ``pathlab::short_conv_silu``, which :func:`causal_conv_silu` takes
    there) against the PyTorch expression in fp64: steps and channels that are not multiples of the kernels'
    blocks, x a slice of a wider projection. bf16 rounds y and dx (2⁻⁹ relative); d taps are fp32 sums."""
    from pathlab.ops.short_conv import causal_conv_silu, conv_silu_expression

    gen = torch.Generator().manual_seed(7)
    x = (2 * torch.randn(3, 517, 773, generator=gen)).cuda().to(dtype)[..., 1:771].requires_grad_()
    taps = torch.randn(770, 3, generator=gen).cuda().requires_grad_()
    dy = torch.randn(3, 517, 770, generator=gen).cuda().to(dtype)
    x64, taps64 = (t.detach().double().requires_grad_() for t in (x, taps))
    y64 = conv_silu_expression(x64, taps64)
    want = [y64, *torch.autograd.grad(y64, (x64, taps64), dy.double())]
    y = causal_conv_silu(x, taps)
    got = [y, *torch.autograd.grad(y, (x, taps), dy)]
    assert "pathlab_short_conv_silu" in y.grad_fn.name()  # the op, not the expression
    for name, a, b, t in zip(("y", "dx", "dtaps"), got, want, (tol, tol, 1e-5)):
        assert rel_err(a, b) < t, name
