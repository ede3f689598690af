"""PathDecodeCache: prefill + per-token steps reproduce the parallel form (fp64 reference), on the CPU.

The PyTorch step runs in fp64 here; the fused Triton step runs under the Triton interpreter in fp32.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused step kernel runs interpreted on CPU

from pathlab.decoding import PathDecodeCache, carry_keys_to_end  # noqa: E402
from pathlab.reference import path_attention as reference  # noqa: E402


def make(B, T, H, Hkv, D, DV, dtype, gate):
    q = torch.randn(B, T, H, D, dtype=dtype)
    k = torch.randn(B, T, Hkv, D, dtype=dtype)
    v = torch.randn(B, T, Hkv, DV, dtype=dtype)
    w = torch.randn(B, T, Hkv, D, dtype=dtype)
    beta = 2 * torch.rand(B, T, Hkv, dtype=dtype)
    g = torch.nn.functional.logsigmoid(1 + torch.randn(B, T, H, dtype=dtype)) if gate else None
    return q, k, v, w, beta, g


def generate(cache, inputs, T0):
    q, k, v, w, beta, g = inputs
    sl = lambda t, a, b: None if t is None else t[:, a:b]  # noqa: E731
    outs = [cache.prefill(*(sl(t, 0, T0) for t in (q, k, v, w, beta)), sl(g, 0, T0))]
    for t in range(T0, q.shape[1]):
        outs.append(cache.step(*(sl(x, t, t + 1) for x in (q, k, v, w, beta)), sl(g, t, t + 1)))
        assert len(cache) == t + 1
    return torch.cat(outs, 1)


@pytest.mark.parametrize("gate", [False, True], ids=["path", "path_fox"])
@pytest.mark.parametrize("T0", [1, 19], ids=["prompt1", "prompt19"])
def test_torch_steps_match_reference_fp64(gate, T0):
    B, T, H, Hkv, D, DV = 2, 40, 4, 2, 16, 8
    inputs = make(B, T, H, Hkv, D, DV, torch.float64, gate)
    cache = PathDecodeCache(B, Hkv, T, D, DV, n_heads=H, dtype=torch.float64, use_triton=False)
    o = generate(cache, inputs, T0)
    want = reference(*inputs)
    # the prompt goes through pathlab.path_attention, which normalises w in fp32: agreement to ~1e-7
    assert (o - want).abs().max() < 1e-6
    assert (o[:, T0:] - want[:, T0:]).abs().max() < 1e-6


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test; on a GPU see test_kernels_gpu.py")
@pytest.mark.parametrize("gate", [False, True], ids=["path", "path_fox"])
def test_fused_triton_step_matches_reference(gate):
    B, T, H, Hkv, D, DV = 1, 90, 4, 2, 16, 32  # steps cross several key blocks of the step kernel
    inputs = make(B, T, H, Hkv, D, DV, torch.float32, gate)
    cache = PathDecodeCache(B, Hkv, T, D, DV, n_heads=H, use_triton=True)
    o = generate(cache, inputs, 30)
    want = reference(*inputs)
    err = float((o.double() - want.double()).abs().max())
    assert err < 1e-5, err


def test_carry_keys_to_end_matches_explicit_product():
    B, T, Hkv, D = 1, 45, 2, 8  # T not a multiple of the chunk
    k = torch.randn(B, T, Hkv, D, dtype=torch.float64)
    w = torch.nn.functional.normalize(torch.randn(B, T, Hkv, D, dtype=torch.float64), dim=-1)
    beta = 2 * torch.rand(B, T, Hkv, dtype=torch.float64)
    got = carry_keys_to_end(k, w, beta, chunk=16)  # [B, Hkv, T, D]
    eye = torch.eye(D, dtype=torch.float64)
    for h in range(Hkv):
        for j in (0, 7, 16, 44):
            x = k[0, j, h]
            for t in range(j + 1, T):
                x = (eye - beta[0, t, h] * torch.outer(w[0, t, h], w[0, t, h])) @ x
            assert torch.allclose(got[0, h, j], x, atol=1e-12)


def test_errors_are_clear():
    with pytest.raises(ValueError, match="n_heads"):
        PathDecodeCache(1, 2, 8, 16, 16, n_heads=3)
    with pytest.raises(ValueError, match="dtype"):
        PathDecodeCache(1, 2, 8, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim"):
        PathDecodeCache(1, 2, 8, 0, 16)
    with pytest.raises(ValueError, match="use_triton"):
        PathDecodeCache(1, 1, 8, 24, 16, use_triton=True)
    cache = PathDecodeCache(1, 1, 4, 16, 16, dtype=torch.float64, use_triton=False)
    q, k, v, w, beta, _ = make(1, 5, 1, 1, 16, 16, torch.float64, False)
    with pytest.raises(ValueError, match="cache full"):
        cache.prefill(q, k, v, w, beta)
    cache.prefill(q[:, :4], k[:, :4], v[:, :4], w[:, :4], beta[:, :4])
    with pytest.raises(ValueError, match="cache full"):
        cache.step(q[:, 4:], k[:, 4:], v[:, 4:], w[:, 4:], beta[:, 4:])
    with pytest.raises(ValueError, match="empty cache"):
        cache.prefill(q[:, :1], k[:, :1], v[:, :1], w[:, :1], beta[:, :1])
    cache.reset()
    with pytest.raises(ValueError, match=r"k must have shape"):
        cache.step(q[:, :1], k[:, :2], v[:, :1], w[:, :1], beta[:, :1])
