"""PathDecodeCache: prefill + per-token steps reproduce the parallel form (fp64 reference), on the CPU.

The PyTorch step runs in fp64 (exact up to rounding) and in fp32 with an fp16 shadow (within the bound of one
fp16 rounding of the keys); the Triton steps (deferred: prep, attend, merge and fold kernels; immediate: the
fused update kernel) run under the Triton interpreter in fp32 and are compared with the PyTorch step. The deferred
step's kernels read the step counters from the device and launch alike at every step (what a CUDA graph of the
step needs); the graph itself is tested on a GPU (``pytest -m gpu``).
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
@pytest.mark.parametrize("dot", [1, 2], ids=["tensor-cores-tf32", "tensor-cores-native"])
def test_triton_deferred_step_matches_torch_step(defer, gate, D, shadow, dot):
    # the split-K attention's products in 3-pass TF32 or in the caches' dtype (2: fp16 shadow keys native, fp32
    # values TF32); the other launch settings at their defaults
    from pathlab.kernels import KernelConfig

    config = KernelConfig(decode_native=dot == 2)
    B, H, Hkv, DV = 1, 4, 2, 32  # grouped heads; the base keys span several splits and key blocks
    T0, steps = 70, (defer + 1 if defer > 4 else 9)  # R = 1: 9 folds, 3: 3, 4: 2 and one pending, 32: 1 and one
    T = T0 + steps
    inputs = make(B, T, H, Hkv, D, DV, torch.float32, gate, seed=5)
    caches = [PathDecodeCache(B, Hkv, T, D, DV, n_heads=H, defer=defer, shadow_dtype=shadow, use_triton=use,
                              kernel_config=config) for use in (True, False)]
    assert caches[0].use_triton and caches[0].shadow_dtype == shadow and caches[0]._ws.attend_dot == dot
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


class _LaunchLog:
    """Stands in for a Triton kernel: records each launch (grid, every argument; tensors by address, dtype, shape
    and strides) and runs it. The deferred merge kernel's output O is left out: a graph allocates it once."""

    def __init__(self, kernel, log):
        self.kernel, self.log = kernel, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            def key(x):
                if isinstance(x, torch.Tensor):
                    return ("tensor", x.data_ptr(), x.dtype, tuple(x.shape), x.stride())
                return x

            named = dict(zip(self.kernel.arg_names, args), **kwargs)
            named.pop("O", None)
            self.log.append((tuple(grid), tuple((k, key(x)) for k, x in sorted(named.items()))))
            return self.kernel[grid](*args, **kwargs)

        return launch


@interpreter_only
@pytest.mark.parametrize("defer,gate,T0", [(1, True, 0), (3, False, 5), (32, True, 3)],
                         ids=["R1-fox-empty", "R3-path-prompt5", "R32-fox-prompt3"])
def test_triton_step_counters_on_device_launch_alike_at_every_step(defer, gate, T0, monkeypatch):
    """The step kernels take n and base from the device (``ws.pos``) and their grids from max_len: with the inputs
    in fixed buffers, as a CUDA graph replays them, every step's launches are identical, across 2R + 1 steps (two
    folds) from an empty or short prompt, with most attention splits past the live keys; the outputs still match
    the PyTorch step."""
    from pathlab.kernels import decode

    B, H, Hkv, D, DV = 2, 2, 1, 16, 16
    steps = 2 * defer + 1
    T = T0 + steps
    max_len = T + 300  # the split-K grid is sized from max_len: 4 splits, of which at most 2 hold keys here
    inputs = make(B, T, H, Hkv, D, DV, torch.float32, gate, seed=7)
    kernels = ("_deferred_prep_kernel", "_deferred_attend_dot_kernel", "_deferred_merge_kernel")
    logs = {name: [] for name in kernels}
    for name, log in logs.items():
        monkeypatch.setattr(decode, name, _LaunchLog(getattr(decode, name), log))
    tri = PathDecodeCache(B, Hkv, max_len, D, DV, n_heads=H, defer=defer, use_triton=True)
    ref = PathDecodeCache(B, Hkv, max_len, D, DV, n_heads=H, defer=defer, shadow_dtype=torch.float16,
                          use_triton=False)
    ws = tri._ws
    assert ws.max_split == 4
    q, k, v, w, beta, g = inputs
    sl = lambda t, a, b: None if t is None else t[:, a:b]  # noqa: E731
    if T0:
        for c in (tri, ref):
            c.prefill(*(sl(x, 0, T0) for x in (q, k, v, w, beta)), sl(g, 0, T0))
    static = [None if x is None else x[:, :1].clone() for x in inputs]  # the step's inputs live here
    live, errs = [], []
    for t in range(T0, T):
        live.append(ws.live_splits(tri.base))
        x = [None if s is None else s.copy_(y[:, t:t + 1]) for s, y in zip(static, inputs)]
        o_tri = tri.step(*x)
        o_ref = ref.step(*(sl(y, t, t + 1) for y in inputs))
        errs.append(float((o_tri - o_ref).abs().max()))
        assert ws.pos.tolist() == [tri.length, tri.base] == [t + 1, ref.base]
    assert tri.base == ref.base == T0 + steps // defer * defer  # R = 1: 2R + 1 folds; else two and one pending
    assert min(live) < ws.max_split and max(live) >= 1  # splits past the live keys, and splits with keys
    if T0 == 0:
        assert live[0] == 0  # the first step has no base keys at all: every split is empty
    for name, log in logs.items():
        assert len(log) == steps, name
        assert len(set(log)) == 1, f"{name}: {len(set(log))} different launches over {steps} steps"
    assert max(errs) < 2e-4, max(errs)  # fp16 shadow on both sides (rare elements one unit apart)


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


# ---------------------------------------------------------------------------------- CUDA graph of the step (GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("defer", [3, 32])
@pytest.mark.parametrize("gate", [False, True], ids=["path", "path_fox"])
def test_cuda_graph_step_matches_eager_triton_step(defer, gate):
    """``cuda_graph=True``: one captured step replayed over 2R + 1 steps (two folds, eager between replays), then
    again after reset() and a prefill of another length, equals the eager Triton step: outputs and cache state.
    The graph's static buffers are other memory than the eager step's inputs, so Triton may pick other layouts:
    agreement to fp32 rounding, not bit for bit."""
    B, H, Hkv, D, DV = 2, 4, 2, 64, 64
    steps = 2 * defer + 1
    T = 300 + steps
    max_len = T + 4096  # most attention splits past the live keys
    inputs = [None if x is None else x.cuda() for x in make(B, T, H, Hkv, D, DV, torch.float32, gate, seed=8)]
    q, k, v, w, beta, g = inputs
    inputs[:3] = [x.bfloat16() for x in (q, k, v)]  # bf16 queries, keys and values as a model passes them
    opts = dict(n_heads=H, device="cuda", defer=defer, value_dtype=torch.bfloat16)
    eager = PathDecodeCache(B, Hkv, max_len, D, DV, **opts)
    graphed = PathDecodeCache(B, Hkv, max_len, D, DV, cuda_graph=True, **opts)
    assert eager.use_triton and graphed.use_triton and graphed.cuda_graph
    sl = lambda t, a, b: None if t is None else t[:, a:b]  # noqa: E731
    for T0 in (300, 37):  # the second pass reuses the graph after reset() and a shorter prompt
        for c in (eager, graphed):
            c.reset()
            c.prefill(*(sl(x, 0, T0) for x in inputs[:5]), sl(inputs[5], 0, T0))
        for t in range(T0, T0 + steps):
            x = [sl(y, t, t + 1) for y in inputs]
            o_e, o_g = eager.step(*x), graphed.step(*x)
            assert o_g.dtype == torch.bfloat16 and o_g.shape == (B, 1, H, DV)
            err = float((o_g.float() - o_e.float()).abs().max())
            assert err <= 1e-2 * float(o_e.float().abs().max()), (t, err)  # bf16 outputs: a unit or so apart
        assert graphed.length == eager.length == T0 + steps and graphed.base == eager.base
        assert graphed._ws.pos.tolist() == eager._ws.pos.tolist() == [graphed.length, graphed.base]
        n = graphed.base
        for name in ("k", "M", "rk"):
            a, b = getattr(graphed, name), getattr(eager, name)
            assert (a - b).abs().max() <= 1e-5, name
        assert torch.equal(graphed.k_shadow[:, :, :n], graphed.k[:, :, :n].half())  # rewritten at each fold
        if gate:
            assert torch.equal(graphed.G, eager.G)
    assert len(graphed._graphs) == 1  # one graph served every step of both passes
    # writing the inputs into the graph's own buffers skips the copies and gives the same step
    static = graphed.graph_inputs(*(sl(y, 0, 1) for y in inputs))
    assert static is not None and len(static) == 6 and (static[5] is None) == (not gate)
    t = T0 + steps
    if t < T:
        for s_, y in zip(static, inputs):
            if s_ is not None:
                s_.copy_(y[:, t:t + 1])
        o_g = graphed.step(*static)
        o_e = eager.step(*(sl(y, t, t + 1) for y in inputs))
        assert float((o_g.float() - o_e.float()).abs().max()) <= 1e-2 * float(o_e.float().abs().max())


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
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda_graph=True needs a CUDA device"):
            PathDecodeCache(1, 1, 8, 16, 16, cuda_graph=True, use_triton=True)
    else:
        with pytest.raises(ValueError, match="cuda_graph=True needs the deferred Triton step"):
            PathDecodeCache(1, 1, 8, 16, 16, device="cuda", defer=0, cuda_graph=True)
        with pytest.raises(ValueError, match="cuda_graph=True needs the deferred Triton step"):
            PathDecodeCache(1, 1, 8, 16, 16, device="cuda", use_triton=False, cuda_graph=True)
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
    assert "CUDA device" in row["graph_skipped"] and "path_step_graph_ms" not in row  # said, not silent
    (row,) = bench.bench_decode([8], 2, 16, "cpu", defer=1, runs=1, graph=False)
    assert row["graph_skipped"].startswith("not requested")
    with pytest.raises(ValueError, match="shadow"):
        bench.bench_decode([48], 2, 16, "cpu", shadow="fp8")


def test_attend_sweep_checks_every_config_on_cpu():
    """``benchmarks/sweep_decode_attend.py`` runs the split-K attention kernel under each launch config and checks
    it against the softmax over the same keys (on the CPU: the interpreter, no times)."""
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "sweep_decode_attend.py"
    spec = importlib.util.spec_from_file_location("sweep_decode_attend", path)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    result = sweep.sweep(150, 2, 16, [32, 64], [4], [1], [2, 4], dots=[1], device="cpu")
    assert [(r["dot"], r["block"], r["splits"]) for r in result["rows"]] == [
        (1, block, splits) for block in (32, 64) for splits in (1, 2)]
    assert all(r["rel_err"] < 1e-5 for r in result["rows"])
    # products in the caches' own dtype, query and P in two parts: fp16 here (the interpreter's bf16 tl.dot is wrong)
    (row,) = sweep.sweep(150, 2, 16, [32], [4], [1], [2], dots=[2], device="cpu", value_dtype=torch.float16)["rows"]
    assert row["rel_err"] < 1e-5


def test_attend_config_takes_the_kernel_config():
    from pathlab.kernels import KernelConfig
    from pathlab.kernels.decode import attend_config

    cpu = torch.device("cpu")
    assert attend_config(64, cpu) == (64, 4, 3, 8, 1) and attend_config(128, cpu)[0] == 32  # TF32 on the CPU
    assert attend_config(64, cpu, KernelConfig(decode_attend=(128, 8))) == (128, 8, 3, 8, 1)
    assert attend_config(64, cpu, KernelConfig(decode_native=True)) == (64, 4, 3, 8, 2)
    for bad in ((96,), (64, 0), (1, 2, 3, 4, 3)):
        with pytest.raises(ValueError, match="decode_attend must be"):
            KernelConfig(decode_attend=bad)
