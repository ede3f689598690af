"""PathDecodeCache: prefill + per-token steps reproduce the parallel form (fp64 reference), on the CPU.

The PyTorch step runs in fp64 (exact up to rounding) and in fp32 with an fp16 shadow (within the bound of one
fp16 rounding of the keys); the Triton steps (deferred: prep, attend, merge and fold kernels; immediate: the
fused update kernel) run under the Triton interpreter in fp32 and are compared with the PyTorch step.
"""

import functools
import importlib.util
import math
import os
import pathlib

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the step kernels run interpreted on CPU

from pathlab.decoding import PathDecodeCache, carry_keys_to_end  # noqa: E402
from pathlab.reference import path_attention as reference  # noqa: E402

interpreter_only = pytest.mark.skipif(torch.cuda.is_available(),
                                      reason="CPU interpreter test; on a GPU see test_kernels_gpu.py")


def make(B, T, H, Hkv, D, DV, dtype, gate, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    q, k, v, w = r(B, T, H, D), r(B, T, Hkv, D), r(B, T, Hkv, DV), r(B, T, Hkv, D)
    beta = 2 * torch.rand(B, T, Hkv, generator=gen, dtype=dtype)
    g = F.logsigmoid(1 + r(B, T, H)) if gate else None
    return q, k, v, w, beta, g


@functools.lru_cache(maxsize=None)
def case_fp64(B, T, H, Hkv, D, DV, gate, seed=0):
    """fp64 inputs and their reference output, computed once per shape (the reference is the slow part)."""
    inputs = make(B, T, H, Hkv, D, DV, torch.float64, gate, seed)
    return inputs, reference(*inputs)


def generate(cache, inputs, T0, on_step=None):
    """Prefill T0 tokens (none when T0 = 0), then step through the rest; o ``[B, T − 0, H, Dv]``."""
    q, k, v, w, beta, g = inputs
    sl = lambda t, a, b: None if t is None else t[:, a:b]  # noqa: E731
    outs = [cache.prefill(*(sl(t, 0, T0) for t in (q, k, v, w, beta)), sl(g, 0, T0))] if T0 else []
    for t in range(T0, q.shape[1]):
        outs.append(cache.step(*(sl(x, t, t + 1) for x in (q, k, v, w, beta)), sl(g, t, t + 1)))
        assert len(cache) == t + 1
        if on_step is not None:
            on_step(cache, t + 1)
    return torch.cat(outs, 1)


def fp16_bound(inputs, scale, slack=1e-5):
    """Largest change of o from rounding every base key to fp16 once (relative error u = 2⁻¹¹ per element).

    A score moves by at most δ = scale · u · ‖q_i‖ ‖k_j‖ (carried keys and queries are never longer: ‖H‖ ≤ 1),
    plus the subnormal floor; a softmax whose logits move by ≤ δ changes its probabilities by ≤ e^{2δ} − 1 in
    ℓ1, and o = Σ p_j v_j then by ≤ (e^{2δ} − 1) · (max v − min v) / 2. ``slack`` covers the fp32 arithmetic.
    """
    q, k, v = inputs[:3]
    u = 2.0 ** -11
    qn, kn = float(q.double().norm(dim=-1).max()), float(k.double().norm(dim=-1).max())
    delta = scale * (u * qn * kn + qn * math.sqrt(q.shape[-1]) * 2.0 ** -25)
    return math.expm1(2 * delta) * float(v.max() - v.min()) / 2 + slack


# ------------------------------------------------------------------------------------------- PyTorch step, fp64


@pytest.mark.parametrize("defer", [0, 1, 3, 4, 32])
@pytest.mark.parametrize("gate", [False, True], ids=["path", "path_fox"])
@pytest.mark.parametrize("D", [16, 64])
def test_torch_steps_match_reference_fp64(defer, gate, D):
    B, T, T0, H, Hkv, DV = 2, 90, 19, 4, 2, 8  # 71 steps: two folds at R = 32, 23 at R = 3
    inputs, want = case_fp64(B, T, H, Hkv, D, DV, gate)
    cache = PathDecodeCache(B, Hkv, T, D, DV, n_heads=H, dtype=torch.float64, use_triton=False, defer=defer)
    assert cache.k_shadow is None  # "auto": fp64 caches score from the master
    o = generate(cache, inputs, T0)
    # the prompt goes through pathlab.path_attention, which normalises w in fp32: agreement to ~1e-7
    assert (o[:, :T0] - want[:, :T0]).abs().max() < 1e-6
    assert (o[:, T0:] - want[:, T0:]).abs().max() < 1e-10
    assert cache.pending == (0 if defer == 0 else (T - T0) % defer)


@pytest.mark.parametrize("T0", [0, 1], ids=["empty", "prompt1"])
def test_torch_steps_from_a_short_or_empty_cache(T0):
    B, T, H, Hkv, D, DV = 1, 20, 2, 1, 16, 16
    inputs, want = case_fp64(B, T, H, Hkv, D, DV, True, seed=1)
    cache = PathDecodeCache(B, Hkv, T, D, DV, n_heads=H, dtype=torch.float64, defer=3)
    o = generate(cache, inputs, T0)
    assert (o[:, T0:] - want[:, T0:]).abs().max() < 1e-10


def test_keys_after_each_fold_equal_carry_keys_to_end():
    B, T, T0, H, Hkv, D, DV, R = 1, 40, 9, 4, 2, 16, 8, 4
    inputs = make(B, T, H, Hkv, D, DV, torch.float64, False, seed=2)
    _, k, _, w, beta, _ = inputs
    wn = F.normalize(w, dim=-1)
    folds = []

    def check(cache, n):
        want = carry_keys_to_end(k[:, :n], wn[:, :n], beta[:, :n])  # [B, Hkv, n, D]
        assert (cache.carried_keys() - want).abs().max() < 1e-12  # at every step, pending or not
        if cache.pending == 0:
            folds.append(n)
            assert cache.base == n
            assert (cache.k[:, :, :n] - want).abs().max() < 1e-12
            assert torch.equal(cache.M[0, 0], torch.eye(D, dtype=torch.float64))

    cache = PathDecodeCache(B, Hkv, T, D, DV, n_heads=H, dtype=torch.float64, defer=R)
    generate(cache, inputs, T0, on_step=check)
    assert folds == list(range(T0 + R, T + 1, R))


def test_fp16_shadow_is_the_fp32_master_rounded_after_a_fold():
    B, T, T0, H, Hkv, D, DV = 1, 30, 10, 2, 2, 16, 16
    inputs = make(B, T, H, Hkv, D, DV, torch.float32, False, seed=3)
    cache = PathDecodeCache(B, Hkv, T, D, DV, n_heads=H, defer=5, shadow_dtype=torch.float16)
    assert torch.equal(cache.k_shadow, torch.zeros_like(cache.k_shadow))
    generate(cache, inputs, T0)
    assert cache.pending == 0 and cache.base == T
    assert torch.equal(cache.k_shadow[:, :, :T], cache.k[:, :, :T].half())


# ------------------------------------------------------------------------- PyTorch step, fp32 with fp16 shadow


@pytest.mark.parametrize("defer,gate,D", [(3, True, 16), (32, False, 64), (1, False, 16)])
def test_torch_steps_fp32_with_fp16_shadow_within_rounding_bound(defer, gate, D):
    B, T, T0, H, Hkv, DV = 2, 90, 19, 4, 2, 16
    inputs = make(B, T, H, Hkv, D, DV, torch.float32, gate, seed=4)
    cache = PathDecodeCache(B, Hkv, T, D, DV, n_heads=H, defer=defer, shadow_dtype=torch.float16)
    o = generate(cache, inputs, T0)
    want = reference(*(None if x is None else x.double() for x in inputs))
    err = float((o[:, T0:].double() - want[:, T0:]).abs().max())
    bound = fp16_bound(inputs, D ** -0.5)
    assert err <= bound, (err, bound)
    # and it is the shadow's rounding, not the fp32 master: without a shadow the same steps agree to ~1e-6
    exact = PathDecodeCache(B, Hkv, T, D, DV, n_heads=H, defer=defer, shadow_dtype=None)
    err32 = float((generate(exact, inputs, T0)[:, T0:].double() - want[:, T0:]).abs().max())
    assert err32 < 1e-5, err32


# ----------------------------------------------------------------------------------- Triton steps (interpreter)


@interpreter_only
@pytest.mark.parametrize("defer,gate,D,shadow", [
    (3, True, 16, None), (4, False, 16, torch.float16), (1, True, 16, torch.float16), (32, False, 64, torch.float16),
], ids=["R3-fox-D16-noshadow", "R4-path-D16-fp16", "R1-fox-D16-fp16", "R32-path-D64-fp16"])
def test_triton_deferred_step_matches_torch_step(defer, gate, D, shadow):
    B, H, Hkv, DV = 1, 4, 2, 32  # grouped heads; the base keys span several splits and key blocks
    T0, steps = 70, (defer + 1 if defer > 4 else 9)  # R = 1: 9 folds, 3: 3, 4: 2 and one pending, 32: 1 and one
    T = T0 + steps
    inputs = make(B, T, H, Hkv, D, DV, torch.float32, gate, seed=5)
    caches = [PathDecodeCache(B, Hkv, T, D, DV, n_heads=H, defer=defer, shadow_dtype=shadow, use_triton=use)
              for use in (True, False)]
    assert caches[0].use_triton and caches[0].shadow_dtype == shadow
    o_tri, o_torch = (generate(c, inputs, T0) for c in caches)
    assert caches[0].base == caches[1].base > T0  # folded at least once
    tol = 1e-5 if shadow is None else 2e-4  # fp16: rare shadow elements one unit apart (masters differ by ~1e-7)
    err = float((o_tri - o_torch).abs().max())
    assert err < tol, err
    n = caches[0].base
    assert (caches[0].k[:, :, :n] - caches[1].k[:, :, :n]).abs().max() < 1e-5
    assert (caches[0].M - caches[1].M).abs().max() < 1e-6
    if gate:
        assert torch.equal(caches[0].G, caches[1].G)
    want = reference(*(None if x is None else x.double() for x in inputs))
    bound = fp16_bound(inputs, D ** -0.5) if shadow is not None else 1e-5
    assert float((o_tri[:, T0:].double() - want[:, T0:]).abs().max()) <= bound


@interpreter_only
def test_triton_deferred_step_from_an_empty_cache_with_strided_inputs():
    B, T, H, Hkv, D, DV = 2, 9, 2, 2, 16, 16
    inputs = make(B, T, H, Hkv, D, DV, torch.float32, True, seed=6)  # slices of [B, T, …]: batch-strided
    cache = PathDecodeCache(B, Hkv, T, D, DV, n_heads=H, defer=4, use_triton=True)
    assert cache.shadow_dtype == torch.float16  # "auto" on the Triton path
    o = generate(cache, inputs, 0)
    want = reference(*(None if x is None else x.double() for x in inputs))
    assert float((o.double() - want).abs().max()) <= fp16_bound(inputs, D ** -0.5)


@interpreter_only
@pytest.mark.parametrize("gate", [False, True], ids=["path", "path_fox"])
def test_immediate_triton_step_matches_reference(gate):
    B, T, H, Hkv, D, DV = 1, 72, 4, 2, 16, 32  # steps cross a key block of the fused kernel
    inputs = make(B, T, H, Hkv, D, DV, torch.float32, gate)
    cache = PathDecodeCache(B, Hkv, T, D, DV, n_heads=H, use_triton=True, defer=0)
    o = generate(cache, inputs, 60)
    want = reference(*inputs)
    err = float((o.double() - want.double()).abs().max())
    assert err < 1e-5, err


# ------------------------------------------------------------------------------------------------ the rest


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
    for bad in (-1, 2.0, True, "32"):
        with pytest.raises(ValueError, match="defer must be an int"):
            PathDecodeCache(1, 1, 8, 16, 16, defer=bad)
    for bad in (torch.float32, torch.int8, "fp16", "float16"):
        with pytest.raises(ValueError, match="shadow_dtype must be"):
            PathDecodeCache(1, 1, 8, 16, 16, shadow_dtype=bad)
    with pytest.raises(ValueError, match="shadow_dtype needs defer"):
        PathDecodeCache(1, 1, 8, 16, 16, defer=0, shadow_dtype=torch.float16)
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
    assert len(cache) == 0 and cache.base == 0 and cache.pending == 0
    with pytest.raises(ValueError, match=r"k must have shape"):
        cache.step(q[:, :1], k[:, :2], v[:, :1], w[:, :1], beta[:, :1])


def test_bench_decode_smoke_on_cpu():
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_kernels.py"
    spec = importlib.util.spec_from_file_location("bench_kernels", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    (row,) = bench.bench_decode([48], 2, 16, "cpu", defer=3, runs=1)
    assert row["defer"] == 3 and row["shadow"] == "fp16" and row["steps_per_run"] == 6 and not row["fused"]
    assert row["check_max_rel"] < 1e-2 and row["check_rel_rms"] < 2e-3  # fp16 shadow vs immediate fp32 keys
    assert all(row[k] > 0 for k in ("path_step_ms", "path_step_immediate_ms", "plain_step_ms"))
    with pytest.raises(ValueError, match="shadow"):
        bench.bench_decode([48], 2, 16, "cpu", shadow="fp8")
