"""The fused Triton UT transform (``kernels/_triton_ut.py``) against the PyTorch one (``kernels/_ut.py``).

Both take the same fp32 chunk layout; the PyTorch version, differentiated by autograd, is the oracle for the four
outputs (q̃, k̃, M, S_d) and the four gradients (dq, dk, dw through the normalisation of w, dβ), by relative RMS
error, on fresh random inputs: grouped heads, β near 0 and near 2, chunk lengths 16 to 64, every head dim, and
chunks padded with zero rows as the layout pads a sequence that ends inside a chunk. The end-to-end kernel with
``ut="triton"`` against the fp64 reference is in ``test_kernels.py``.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of the kernels

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter tests run on CPU-only machines; the GPU runs test_kernels_gpu.py"
)

from pathlab.kernels import path_attention_triton  # noqa: E402
from pathlab.kernels._triton_ut import ut_factors_triton  # noqa: E402
from pathlab.kernels._ut import ut_factors  # noqa: E402


def rel_rms(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-12))


def chunk_inputs(H, Hkv, NC, BT, D, beta_range, pad, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(H, NC, BT, D, generator=gen)
    k = torch.randn(Hkv, NC, BT, D, generator=gen)
    w = torch.randn(Hkv, NC, BT, D, generator=gen)
    lo, hi = beta_range
    beta = lo + (hi - lo) * torch.rand(Hkv, NC, BT, generator=gen)
    if pad:  # the last chunk ends early: its trailing rows are zero, as the layout fills them
        for t in (q, k, w, beta):
            t[:, -1, BT - pad:] = 0
    return [t.requires_grad_() for t in (q, k, w, beta)]


CASES = [
    # H, Hkv, NC, BT, D, beta_range, pad
    pytest.param(1, 1, 1, 16, 16, (0.0, 2.0), 0, id="H1-BT16-D16"),
    pytest.param(4, 2, 3, 16, 32, (0.0, 2.0), 5, id="H4kv2-BT16-D32-padded"),
    pytest.param(3, 1, 2, 32, 64, (0.0, 2.0), 0, id="H3kv1-BT32-D64"),
    pytest.param(2, 2, 2, 64, 128, (0.0, 2.0), 17, id="H2-BT64-D128-padded"),
    pytest.param(2, 1, 2, 32, 32, (0.0, 1e-3), 0, id="H2kv1-BT32-D32-beta-near-0"),
    pytest.param(2, 2, 2, 32, 32, (1.999, 2.0), 0, id="H2-BT32-D32-beta-near-2"),
]


@pytest.mark.parametrize("H, Hkv, NC, BT, D, beta_range, pad", CASES)
def test_matches_the_pytorch_transform(H, Hkv, NC, BT, D, beta_range, pad):
    q, k, w_raw, beta = chunk_inputs(H, Hkv, NC, BT, D, beta_range, pad, seed=H * 1000 + BT + D)
    w = torch.nn.functional.normalize(w_raw, dim=-1)
    want = ut_factors(q, k, w, beta)
    got = ut_factors_triton(q, k, w, beta)
    upstream = [torch.randn_like(t) for t in want]
    leaves = [q, k, w_raw, beta]
    want_grads = torch.autograd.grad(want, leaves, upstream, retain_graph=True)
    got_grads = torch.autograd.grad(got, leaves, upstream)
    names = ["q̃", "k̃", "M", "S_d", "dq", "dk", "dw", "dβ"]
    for name, a in zip(names, list(got) + list(got_grads)):
        assert torch.isfinite(a).all(), f"{name} has NaN/inf (an element the kernel never wrote?)"
    errs = {n: rel_rms(a, b) for n, a, b in zip(names, list(got) + list(got_grads), list(want) + list(want_grads))}
    bad = {n: e for n, e in errs.items() if not e <= 2e-5}
    assert not bad, f"relative RMS errors above 2e-5: {bad} (all: {errs})"


def test_gradient_of_some_outputs_only():
    """Outputs that do not reach the loss give no gradient; the backward then counts them as zero."""
    q, k, w_raw, beta = chunk_inputs(2, 1, 2, 16, 16, (0.0, 2.0), 0, seed=7)
    leaves = [q, k, w_raw, beta]
    for pick in (0, 2):  # q̃ only, M only
        w = torch.nn.functional.normalize(w_raw, dim=-1)
        want = torch.autograd.grad(ut_factors(q, k, w, beta)[pick].square().sum(), leaves, allow_unused=True,
                                   retain_graph=True)
        got = torch.autograd.grad(ut_factors_triton(q, k, w, beta)[pick].square().sum(), leaves)
        for a, b in zip(got, want):
            b = torch.zeros_like(a) if b is None else b
            assert rel_rms(a, b) <= 2e-5 if b.abs().max() > 0 else a.abs().max() == 0


def test_unknown_ut_name_is_a_clear_error():
    x = torch.randn(1, 8, 1, 16)
    with pytest.raises(ValueError, match="ut must be one of"):
        path_attention_triton(x, x, x, x, torch.rand(1, 8, 1), ut="cuda")


def test_environment_variable_selects_the_fused_transform(monkeypatch):
    """``PATHLAB_PATH_UT=triton`` switches the default, for benchmarks of whole models."""
    import pathlab.kernels._triton_ut as fused

    calls = []
    original = fused.ut_factors_triton
    monkeypatch.setattr(fused, "ut_factors_triton", lambda *a: calls.append(1) or original(*a))
    monkeypatch.setenv("PATHLAB_PATH_UT", "triton")
    x = torch.randn(1, 20, 1, 16)
    path_attention_triton(x, x, x, x, torch.rand(1, 20, 1), block_size=16)
    assert calls == [1]
