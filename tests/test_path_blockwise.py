"""Blockwise PaTH (and the public dispatcher) against the explicit fp64 reference: output and every gradient."""

import pytest
import torch

import pathlab
from pathlab import reference
from pathlab.ops.path_blockwise import path_attention_blockwise
from pathlab.testing import random_path_inputs, rel_err

NAMES = ("q", "k", "v", "w", "beta", "g")


def _outputs_and_grads(fn, inputs, d_out):
    out = fn(*inputs)
    grads = torch.autograd.grad(out, [t for t in inputs if t is not None], d_out, allow_unused=True,
                                materialize_grads=True)
    return out, grads


CASES = [
    # B, T, H, Hkv, D, Dv, chunk, dtype, gate: awkward lengths, grouped heads, Dv != D, partial chunks
    (1, 1, 2, 2, 8, 8, 16, torch.float64, False),
    (1, 1, 2, 2, 8, 8, 16, torch.float32, True),
    (2, 63, 2, 1, 16, 8, 16, torch.float64, True),
    (2, 63, 2, 1, 16, 8, 16, torch.float32, False),
    (1, 100, 3, 3, 8, 12, 32, torch.float64, False),
    (1, 100, 3, 3, 8, 12, 32, torch.float32, True),
    (1, 257, 2, 2, 16, 16, 64, torch.float64, True),
    (1, 257, 2, 2, 16, 16, 64, torch.float32, False),
]


def _case_id(c):
    return f"B{c[0]}-T{c[1]}-H{c[2]}/{c[3]}-D{c[4]}-Dv{c[5]}-{str(c[7])[6:]}-{'gate' if c[8] else 'nogate'}"


@pytest.mark.parametrize("B,T,H,Hkv,D,Dv,chunk,dtype,gate", CASES, ids=[_case_id(c) for c in CASES])
def test_blockwise_matches_reference(B, T, H, Hkv, D, Dv, chunk, dtype, gate):
    gen = torch.Generator().manual_seed(T * 7 + H)
    inputs = random_path_inputs(B, T, H, D, Hkv=Hkv, Dv=Dv, dtype=dtype, gate=gate, generator=gen,
                                beta_range=(0.05, 1.95), requires_grad=True)
    d_out = torch.randn(B, T, H, Dv, generator=gen, dtype=torch.float64).to(dtype)
    ref_inputs = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    ref_out, ref_grads = _outputs_and_grads(reference.path_attention, ref_inputs, d_out.double())

    def fast(q, k, v, w, beta, g):
        return pathlab.path_attention(q, k, v, w, beta, g, backend="torch", chunk_size=chunk)

    out, grads = _outputs_and_grads(fast, inputs, d_out)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    assert rel_err(out, ref_out) < tol
    names = [n for n, t in zip(NAMES, inputs) if t is not None]
    for name, got, want in zip(names, grads, ref_grads):
        assert rel_err(got, want) < tol, f"d{name}: {rel_err(got, want):.2e}"


@pytest.mark.parametrize("beta_range", [(0.0, 0.02), (1.98, 2.0)], ids=["beta~0", "beta~2"])
def test_extreme_beta_fp32(beta_range):
    gen = torch.Generator().manual_seed(3)
    inputs = random_path_inputs(1, 90, 2, 16, beta_range=beta_range, gate=True, generator=gen)
    out = pathlab.path_attention(*inputs, backend="torch", chunk_size=32)
    assert rel_err(out, reference.path_attention(*[t.double() for t in inputs])) < 1e-5


def test_gradcheck_tiny():
    gen = torch.Generator().manual_seed(1)
    inputs = random_path_inputs(1, 6, 2, 4, Hkv=1, dtype=torch.float64, gate=True, generator=gen,
                                beta_range=(0.2, 1.8), requires_grad=True)

    def fn(*args):
        return path_attention_blockwise(*args, scale=0.5, chunk_size=4)

    # w must be unit-norm for the blockwise op itself; normalise inside the checked function.
    def fn_normalised(q, k, v, w, beta, g):
        return fn(q, k, v, torch.nn.functional.normalize(w, dim=-1), beta, g)

    assert torch.autograd.gradcheck(fn_normalised, tuple(inputs), eps=1e-6, atol=1e-7, fast_mode=True)


def test_reference_gradcheck_tiny():
    gen = torch.Generator().manual_seed(2)
    inputs = random_path_inputs(1, 4, 1, 4, dtype=torch.float64, gate=True, generator=gen,
                                beta_range=(0.2, 1.8), requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: reference.path_attention(*a), tuple(inputs), eps=1e-6, atol=1e-7,
                                    fast_mode=True)


def test_chunk_size_does_not_change_the_result():
    gen = torch.Generator().manual_seed(5)
    inputs = random_path_inputs(2, 70, 2, 8, dtype=torch.float64, gate=True, generator=gen)
    outs = [pathlab.path_attention(*inputs, backend="torch", chunk_size=c) for c in (1, 7, 16, 128)]
    for o in outs[1:]:
        assert rel_err(o, outs[0]) < 1e-12


def test_no_grad_path_skips_checkpointing_and_agrees():
    gen = torch.Generator().manual_seed(6)
    inputs = random_path_inputs(1, 50, 2, 8, gate=True, generator=gen, requires_grad=True)
    with_grad = pathlab.path_attention(*inputs, backend="torch", chunk_size=16)
    with torch.no_grad():
        without = pathlab.path_attention(*inputs, backend="torch", chunk_size=16)
    assert rel_err(without, with_grad) < 1e-6


def test_autocast_does_not_lower_the_precision_of_the_ut_prep():
    """Under bf16 autocast the fp32 products of the blockwise path stay fp32 (autocast is off inside)."""
    q, k, v, w, beta, g = random_path_inputs(1, 100, 2, 16, gate=True, generator=torch.Generator().manual_seed(3))
    plain = pathlab.path_attention(q, k, v, w, beta, g, backend="torch")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = pathlab.path_attention(q, k, v, w, beta, g, backend="torch")
    assert under_autocast.dtype == torch.float32
    assert torch.equal(plain, under_autocast)
