"""The fused Triton UT transform (``kernels/ut_forward.py``, ``ut_backward.py``) against the PyTorch one (``kernels/ut_torch.py``).

The fused kernels read q, k, w, β straight from ``[B, T, heads, ·]`` (any float dtype and strides), gather each
chunk's rows, normalise w and cast to fp32 themselves. The oracle is the PyTorch route, differentiated by
autograd: fp32 casts, ``normalize(w)``, ``to_chunks`` and ``ut_factors``. Compared by relative RMS error: the
four outputs (q̃, k̃, M, S_d) and the four input gradients (dq, dk, dw, dβ), on fresh random inputs: grouped
heads, β near 0 and near 2, chunk lengths 16 to 64, every head dim, sequences that end inside a chunk, packed
sequences (``cu_seqlens``), non-contiguous and fp16 inputs. The end-to-end kernel with ``ut="triton"`` against
the fp64 reference is in ``test_kernels.py``.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of the kernels

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter tests run on CPU-only machines; the GPU runs test_kernels_gpu.py"
)

from pathlab.kernels import KernelConfig, path_attention_triton  # noqa: E402
from pathlab.kernels.layout import build_layout, slot_tokens, to_chunks  # noqa: E402
from pathlab.kernels.ut_backward import ut_factors_triton  # noqa: E402
from pathlab.kernels.ut_torch import ut_factors  # noqa: E402

NAMES = ["q̃", "k̃", "M", "S_d", "dq", "dk", "dw", "dβ"]


def rel_rms(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-12))


def token_inputs(B, T, H, Hkv, D, beta_range, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=gen).to(dtype)
    k = torch.randn(B, T, Hkv, D, generator=gen).to(dtype)
    w = torch.randn(B, T, Hkv, D, generator=gen)
    lo, hi = beta_range
    beta = lo + (hi - lo) * torch.rand(B, T, Hkv, generator=gen)
    return q, k, w, beta


def pytorch_route(q, k, w, beta, layout):
    f32 = torch.float32
    wn = torch.nn.functional.normalize(w.to(f32), dim=-1)
    return ut_factors(*(to_chunks(x, layout) for x in (q.to(f32), k.to(f32), wn, beta.to(f32))))


def compare(inputs, layout, tol=2e-5, seed=0, upstream_scale=1.0, config=None):
    leaves = [x.detach().requires_grad_() for x in inputs]
    want = pytorch_route(*leaves, layout)
    got = ut_factors_triton(*leaves, layout, config)
    gen = torch.Generator().manual_seed(seed)
    upstream = [torch.randn(t.shape, generator=gen) * upstream_scale for t in want]
    want_grads = torch.autograd.grad(want, leaves, upstream, retain_graph=True)
    got_grads = torch.autograd.grad(got, leaves, upstream)
    results = list(got) + list(got_grads)
    for name, a, b in zip(NAMES, results, list(want) + list(want_grads)):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{name}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
        assert torch.isfinite(a).all(), f"{name} has NaN/inf (an element the kernel never wrote?)"
    errs = {n: rel_rms(a, b) for n, a, b in zip(NAMES, results, list(want) + list(want_grads))}
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"relative RMS errors above {tol}: {bad} (all: {errs})"


CASES = [
    # B, T, H, Hkv, D, BT, beta_range
    pytest.param(1, 16, 1, 1, 16, 16, (0.0, 2.0), id="T16-BT16-D16"),
    pytest.param(2, 43, 4, 2, 32, 16, (0.0, 2.0), id="B2-T43-H4kv2-BT16-D32"),
    pytest.param(1, 70, 3, 1, 64, 32, (0.0, 2.0), id="T70-H3kv1-BT32-D64"),
    pytest.param(1, 100, 2, 2, 128, 64, (0.0, 2.0), id="T100-BT64-D128"),
    pytest.param(1, 200, 2, 1, 16, 128, (0.0, 2.0), id="T200-H2kv1-BT128-D16"),  # eight 16×16 blocks in the inverse
    pytest.param(1, 40, 2, 1, 32, 32, (0.0, 1e-3), id="T40-H2kv1-D32-beta-near-0"),
    pytest.param(1, 40, 2, 2, 32, 32, (1.999, 2.0), id="T40-D32-beta-near-2"),
]


BACKWARD_FORMS = {"three-kernel-backward": False, "split-backward": True}  # KernelConfig.ut_split
FIRST_KERNEL = {"three-kernel-backward": "_ut_bwd_heads_kernel", "split-backward": "_ut_bwd_end_kernel"}


class _Spy:
    """Stands in for a Triton kernel: records its launches, then launches it."""

    def __init__(self, kernel, name, log):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        self.log.append(self.name)
        return self.kernel[grid]


def use_backward_form(form, monkeypatch):
    """Spies on the first backward kernels; returns the list of those launched."""
    from pathlab.kernels import ut_backward

    log = []
    for name in FIRST_KERNEL.values():
        monkeypatch.setattr(ut_backward, name, _Spy(getattr(ut_backward, name), name, log))
    return log


@pytest.mark.parametrize("form", list(BACKWARD_FORMS))
@pytest.mark.parametrize("B, T, H, Hkv, D, BT, beta_range", CASES)
def test_matches_the_pytorch_transform(B, T, H, Hkv, D, BT, beta_range, form, monkeypatch):
    """Both forms of the backward: three kernels (the default at D ≤ 64) and split in five (the default at D = 128,
    where the first of the three does not fit an H200's shared memory with tf32 products)."""
    launched = use_backward_form(form, monkeypatch)
    inputs = token_inputs(B, T, H, Hkv, D, beta_range, seed=T * 10 + D)
    compare(inputs, build_layout(B, T, BT, "cpu"), config=KernelConfig(ut_split=BACKWARD_FORMS[form]))
    assert launched == [FIRST_KERNEL[form]]


HALF_CASES = [CASES[1], CASES[2], CASES[6]]  # grouped heads at D = 32, D = 64 with BT = 32, β near 2


@pytest.mark.parametrize("form", list(BACKWARD_FORMS))
@pytest.mark.parametrize("scale", [1e-9, 1.0, 1e6], ids=["grads-1e-9", "grads-1", "grads-1e6"])
@pytest.mark.parametrize("B, T, H, Hkv, D, BT, beta_range", HALF_CASES)
def test_half_operands_keep_their_precision_at_any_gradient_scale(B, T, H, Hkv, D, BT, beta_range, scale, form,
                                                                  monkeypatch):
    """``KernelConfig.ut_half`` (the default for 16-bit inputs, pinned here for fp32 ones): fp16 products on
    operands scaled by powers of two. Their 11-bit significands
    are tf32's, so the errors stay near 2⁻¹¹ (the interpreter's tf32 products are exact fp32, hence the looser
    tolerance than above) with upstream gradients of 1e-9, which unscaled fp16 would flush to zero, and of 1e6,
    with keys of 1e4, whose products would overflow it."""
    launched = use_backward_form(form, monkeypatch)
    q, k, w, beta = token_inputs(B, T, H, Hkv, D, beta_range, seed=T * 10 + D)
    compare((q, k * 1e4, w, beta), build_layout(B, T, BT, "cpu"), tol=3e-3, upstream_scale=scale,
            config=KernelConfig(ut_split=BACKWARD_FORMS[form], ut_half=True))
    assert launched == [FIRST_KERNEL[form]]


def test_half_operands_policy():
    """The UT products take scaled fp16 operands for 16-bit inputs and tf32 ones for fp32 inputs, unless a config
    pins them."""
    from pathlab.kernels.ut_common import FP16, TF32, half_operands

    assert half_operands(torch.bfloat16) == half_operands(torch.float16) == FP16
    assert half_operands(torch.float32) == TF32
    assert half_operands(torch.float32, KernelConfig(ut_half=True)) == FP16
    assert half_operands(torch.bfloat16, KernelConfig(ut_half=False)) == TF32


def test_narrow_scratch_policy():
    """Scaled fp16 scratch in the three-kernel backward with fp16 operands only (the split form adds to its
    scratch by atomics; tf32 products have operands of their own), unless a config turns it off."""
    from pathlab.kernels.ut_backward import narrow_scratch
    from pathlab.kernels.ut_common import FP16, TF32

    assert narrow_scratch(False, FP16)
    assert not narrow_scratch(True, FP16) and not narrow_scratch(False, TF32)
    assert not narrow_scratch(False, FP16, KernelConfig(ut_scratch16=False))
    assert not narrow_scratch(True, FP16, KernelConfig(ut_scratch16=True))


@pytest.mark.parametrize("scale", [1e-9, 1.0, 1e6], ids=["grads-1e-9", "grads-1", "grads-1e6"])
@pytest.mark.parametrize("B, T, H, Hkv, D, BT, beta_range", [CASES[1], CASES[2]])
def test_narrow_scratch_rounds_only_what_passes_through_it(B, T, H, Hkv, D, BT, beta_range, scale):
    """The scratch as scaled fp16 tiles against fp32 scratch, fp16 products in both: dq, which is final in the
    first kernel, bit for bit; dk, dw, dβ, whose partial sums pass through the scratch, within 2⁻¹¹-level
    rounding (and not equal: the narrow scratch was used), at any scale of the gradients."""
    q, k, w, beta = token_inputs(B, T, H, Hkv, D, beta_range, seed=T + D)
    leaves = [x.detach().requires_grad_() for x in (q, k * 1e4, w, beta)]
    layout = build_layout(B, T, BT, "cpu")
    grads = {}
    for narrow in ("0", "1"):
        config = KernelConfig(ut_half=True, ut_split=False, ut_scratch16=narrow == "1")
        factors = ut_factors_triton(*leaves, layout, config)
        gen = torch.Generator().manual_seed(5)
        upstream = [torch.randn(f.shape, generator=gen) * scale for f in factors]
        grads[narrow] = torch.autograd.grad(factors, leaves, upstream)
    (dq32, *rest32), (dq16, *rest16) = grads["0"], grads["1"]
    assert torch.equal(dq16, dq32)
    for name, a, b in zip(["dk", "dw", "dβ"], rest16, rest32):
        assert torch.isfinite(a).all(), name
        assert 0 < rel_rms(a, b) < 1e-3, f"{name}: {rel_rms(a, b)}"


def test_split_backward_by_head_dim():
    from pathlab.kernels.ut_backward import split_backward

    assert [split_backward(d) for d in (16, 32, 64, 128)] == [False, False, False, True]
    assert split_backward(16, KernelConfig(ut_split=True))


def test_warps_by_head_dim():
    from pathlab.kernels.ut_common import num_warps

    assert [num_warps(d) for d in (16, 32, 64, 128)] == [4, 4, 4, 8]
    assert num_warps(64, KernelConfig(ut_warps=8)) == 8
    with pytest.raises(ValueError, match="ut_warps must be"):
        KernelConfig(ut_warps=3)


def test_inverse_gradients_kernel_avoids_four_warps_below_head_dim_64():
    """``_ut_bwd_inverse_kernel`` at 4 warps and D ≤ 32 is miscompiled by Triton 3.6 for an H200 (NaN dw;
    ``benchmarks/ut_inverse_grads_steps.py``), so it runs 8 there, whatever the config says."""
    from pathlab.kernels.ut_backward import inverse_grads_warps

    assert [inverse_grads_warps(d) for d in (16, 32, 64, 128)] == [8, 8, 4, 8]
    assert [inverse_grads_warps(d, KernelConfig(ut_warps=4)) for d in (16, 32, 64)] == [8, 8, 4]


@pytest.mark.parametrize("form", list(BACKWARD_FORMS))
def test_packed_sequences(form, monkeypatch):
    launched = use_backward_form(form, monkeypatch)
    lengths = [1, 15, 40, 16]  # one token, one short of a chunk, a long one, exactly one chunk
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    inputs = token_inputs(1, sum(lengths), 4, 2, 16, (0.0, 2.0), seed=5)
    compare(inputs, build_layout(1, sum(lengths), 16, "cpu", cu), config=KernelConfig(ut_split=BACKWARD_FORMS[form]))
    assert launched == [FIRST_KERNEL[form]]


def test_strided_and_half_inputs():
    """q, k as transposed views and fp16 (cast inside the kernel); gradients come back in each input's dtype."""
    B, T, H, D = 2, 37, 2, 16
    q, k, w, beta = token_inputs(B, T, H, H, D, (0.0, 2.0), seed=9, dtype=torch.float16)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, T, H, D] view with the strides of [B, H, T, D]
    k = k.transpose(1, 2).contiguous().transpose(1, 2)
    assert not q.is_contiguous()
    compare((q, k, w, beta), build_layout(B, T, 16, "cpu"), tol=1e-3)  # dq, dk rounded to fp16


def test_strided_w_and_beta():
    """w with a non-unit stride along D (copied by the wrapper) and β with the strides of ``[B, Hkv, T]``."""
    B, T, H, Hkv, D = 2, 37, 4, 2, 16
    q, k, _, _ = token_inputs(B, T, H, Hkv, D, (0.0, 2.0), seed=1)
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(B, T, Hkv, 2 * D, generator=gen)[..., ::2]
    beta = 2 * torch.rand(B, Hkv, T, generator=gen).transpose(1, 2)
    compare((q, k, w, beta), build_layout(B, T, 16, "cpu"))


@pytest.mark.parametrize("norm", [0.0, 5e-13], ids=["zero", "below-eps"])
def test_direction_below_normalize_eps(norm):
    """A w row with ‖w‖ ≤ F.normalize's ε = 1e-12: w/ε is used as is (no unit vector) and its gradient is dw/ε,
    without the radial projection. That row's gradient is 1e12 times the others, so it is compared on its own."""
    q, k, w, beta = token_inputs(1, 20, 1, 1, 16, (0.0, 2.0), seed=11)
    w[0, 3] = norm / 4  # 16 entries of norm/4: ‖w‖ = norm
    layout = build_layout(1, 20, 16, "cpu")
    leaves = [x.requires_grad_() for x in (q, k, w, beta)]
    want, got = pytorch_route(*leaves, layout), ut_factors_triton(*leaves, layout)
    upstream = [torch.randn(t.shape, generator=torch.Generator().manual_seed(1)) for t in want]
    want_grads = torch.autograd.grad(want, leaves, upstream)
    got_grads = torch.autograd.grad(got, leaves, upstream)
    for name, a, b in zip(NAMES, got, want):
        assert rel_rms(a, b) <= 2e-5, name
    rest = torch.arange(20) != 3
    for name, a, b in zip(NAMES[4:], got_grads, want_grads):
        assert torch.isfinite(a).all(), name
        assert rel_rms(a[:, rest], b[:, rest]) <= 2e-5, name
        assert rel_rms(a[:, 3], b[:, 3]) <= 2e-5 if b[:, 3].abs().max() > 0 else a[:, 3].abs().max() == 0, name


def test_gradient_of_some_outputs_only():
    """Outputs that do not reach the loss give no gradient; the backward then counts them as zero."""
    inputs = [x.requires_grad_() for x in token_inputs(1, 30, 2, 1, 16, (0.0, 2.0), seed=7)]
    layout = build_layout(1, 30, 16, "cpu")
    for pick in (0, 2):  # q̃ only, M only
        want = torch.autograd.grad(pytorch_route(*inputs, layout)[pick].square().sum(), inputs, allow_unused=True)
        got = torch.autograd.grad(ut_factors_triton(*inputs, layout)[pick].square().sum(), inputs)
        for a, b in zip(got, want):
            if b is None:
                assert a.abs().max() == 0
            else:
                assert rel_rms(a, b) <= 2e-5


def test_slot_tokens_cover_every_token_once():
    for layout, n_tokens in ((build_layout(3, 37, 16, "cpu"), 3 * 37),
                             (build_layout(1, 45, 16, "cpu", torch.tensor([0, 7, 30, 45], dtype=torch.int32)), 45)):
        tokens = slot_tokens(layout, layout.batch, layout.length)
        real = tokens[tokens < n_tokens]
        assert tokens.numel() == layout.n_chunks * layout.chunk
        assert sorted(real.tolist()) == list(range(n_tokens))
        assert (tokens[tokens >= n_tokens] == n_tokens).all()


def test_unknown_ut_name_is_a_clear_error():
    x = torch.randn(1, 8, 1, 16)
    with pytest.raises(ValueError, match="ut must be one of"):
        path_attention_triton(x, x, x, x, torch.rand(1, 8, 1), ut="cuda")


def test_auto_picks_the_fused_transform_on_cuda():
    """The fused kernels keeping their factors for the backward (the faster of the two fused routes) up to
    D = 64; at D = 128 the ones recomputing them (the least memory)."""
    from types import SimpleNamespace

    from pathlab.kernels.path import _ut_name

    def on(device, D):
        return SimpleNamespace(device=torch.device(device), shape=(1, 8, 2, D))

    assert [_ut_name("auto", on("cuda", D)) for D in (16, 32, 64, 128)] == ["triton_saved"] * 3 + ["triton"]
    assert [_ut_name("auto", on("cpu", D)) for D in (16, 64)] == ["torch", "torch"]
    assert _ut_name("torch", on("cuda", 64)) == "torch" and _ut_name("triton", on("cpu", 128)) == "triton"
    assert _ut_name(None, on("cuda", 64)) == "triton_saved" and _ut_name(None, on("cpu", 64)) == "torch"


def _graph_nodes(tensor):
    """Names of the autograd nodes behind ``tensor``."""
    names, todo = [], [tensor.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None:
            names.append(fn.name())
            todo.extend(f for f, _ in fn.next_functions)
    return names


@pytest.mark.parametrize("ut, fused", [(None, False), ("auto", False), ("torch", False), ("triton", True)])
def test_ut_argument_selects_the_fused_transform(ut, fused):
    """``ut="triton"`` gives the output of the recomputing op (UT kernels + scan); otherwise (``auto``, the
    default, on a CPU) it comes from the scan op fed by PyTorch's UT transform."""
    x = torch.randn(1, 20, 1, 16, requires_grad=True)
    nodes = " ".join(_graph_nodes(path_attention_triton(x, x, x, x, torch.rand(1, 20, 1), block_size=16, ut=ut)))
    assert ("path_recompute_fwd" in nodes) == fused and ("path_scan_fwd" in nodes) == (not fused), nodes


def test_gather_and_scatter_chunks_invert_each_other():
    """Row r of chunk n holds the token that slot_tokens names for it (zeros for padding); scatter undoes it, also
    casting. With padding and without it (every sequence a whole number of chunks: one copy each way)."""
    from pathlab.kernels.layout import gather_chunks, scatter_chunks

    packed = build_layout(1, 45, 16, "cpu", torch.tensor([0, 7, 30, 45], dtype=torch.int32))
    whole = build_layout(1, 48, 16, "cpu", torch.tensor([0, 16, 48], dtype=torch.int32))
    for B, T, layout in ((3, 37, build_layout(3, 37, 16, "cpu")), (1, 45, packed),
                         (2, 32, build_layout(2, 32, 16, "cpu")), (1, 48, whole)):
        x = torch.randn(B, T, 2, 5)[:, :, :, :4]  # not contiguous
        tokens = slot_tokens(layout, B, T)
        chunks = gather_chunks(x, tokens, 16)
        flat = x.reshape(B * T, 2, 4)
        for slot, tok in enumerate(tokens.tolist()):
            want = flat[tok] if tok < B * T else torch.zeros(2, 4)
            torch.testing.assert_close(chunks[:, slot // 16, slot % 16], want, rtol=0, atol=0)
        if layout.simple:
            torch.testing.assert_close(chunks, to_chunks(x, layout), rtol=0, atol=0)
        torch.testing.assert_close(scatter_chunks(chunks, tokens, B, T), x, rtol=0, atol=0)
        half = scatter_chunks(chunks, tokens, B, T, torch.float16)
        assert half.dtype == torch.float16 and half.is_contiguous()
        torch.testing.assert_close(half, x.half(), rtol=0, atol=0)


def test_kernels_too_large_for_the_gpu_raise_a_clear_error(monkeypatch):
    """A configuration whose tiles exceed the GPU's shared memory (Triton's OutOfResources at launch) names the
    head dim, the grouping and the way out, ut='torch'."""
    from triton.runtime.errors import OutOfResources

    import pathlab.kernels.ut_forward as fused

    class TooLarge:
        def __getitem__(self, grid):
            def launch(*args, **meta):
                raise OutOfResources(360448, 232448, "shared memory")
            return launch

    monkeypatch.setattr(fused, "_ut_fwd_kernel", TooLarge())
    q, k, w, beta = token_inputs(1, 20, 2, 1, 16, (0.0, 2.0), seed=3)
    with pytest.raises(RuntimeError, match=r"head dim 16, 2 query heads per kv head.*ut='torch'"):
        ut_factors_triton(q, k, w, beta, build_layout(1, 20, 16, "cpu"))


def test_ut_transform_benchmark_runs_on_the_cpu():
    """``benchmarks/bench_ut_transform.py`` at one small size under the interpreter, with tf32 products
    (``KernelConfig(ut_half=False)``; the half products are tested above): the fused and PyTorch routes agree to fp32
    rounding there (the interpreter computes tf32 products in fp32) in the fp32 factors and in dw, dβ, and to bf16
    rounding in dq, dk (bf16 like q, k); nothing is NaN, and the times are left out on a CPU."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_ut_transform.py"
    spec = importlib.util.spec_from_file_location("bench_ut_transform", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    row = bench.measure(70, 2, 1, 16, device="cpu", config=KernelConfig(ut_half=False))
    assert set(row["errs"]) == {"out0", "out1", "out2", "out3", "dq", "dk", "dw", "db"}
    errs = row["errs"]
    assert max(errs[n] for n in ("out0", "out1", "out2", "out3", "dw", "db")) < 1e-5, errs
    assert max(errs["dq"], errs["dk"]) < 1e-2, errs  # one bf16 rounding (2⁻⁸ relative) apart at most
    assert not any(row["nans"])
    assert row["fused_fwd_ms"] is None and row["torch_fwdbwd_ms"] is None
    inverse = bench.measure_inverse(200, 2, 16, [1, 4], device="cpu")
    assert inverse["matrices"] == 2 * 4  # 2 kv heads × 4 chunks of 64
    for name in ("triton_warps1", "triton_warps4", "trsm"):
        assert inverse[name]["err"] < 1e-6 and inverse[name]["ms"] is None, inverse


def test_inverse_gradient_steps_script_is_right_under_the_interpreter(tmp_path):
    """``benchmarks/ut_inverse_grads_steps.py`` (the reproducer of Triton 3.6's error at 4 warps, D ≤ 32, on an
    H200) at D = 16 on the CPU: every form of (dG + dGᵀ) W and dβ within fp16-operand rounding of fp64, so that a
    failure it records on a GPU is the GPU build's, not the script's."""
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "ut_inverse_grads_steps.py"
    spec = importlib.util.spec_from_file_location("ut_inverse_grads_steps", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "steps.json"
    script.main(["--dims", "16", "--warps", "4", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert {(r["form"], r["half"]) for r in rows} == {(f, h) for f in script.FORMS for h in (True, False)}
    for r in rows:
        tol = 2e-3 if r["half"] else 1e-5
        assert r["nonfinite"] == 0 and r["db_nonfinite"] == 0 and r["err"] < tol and r["db_err"] < tol, r


def test_large_norm_factor_script_separates_the_routes():
    """``benchmarks/large_norm_errors.py --factors`` at a small size under the interpreter, fp16 inputs. With 16-bit
    products everywhere (``triton_16bit``) the fused factors carry 11-bit products (about 2⁻¹¹ of their size) and
    S_d's error grows with |q|·|k| (×50: over 1000 times its error at norm 1), the defect the split products
    remove; the fused route as it runs takes them at ×50 (q̃, k̃, S_d at fp32 level, as the PyTorch route) and not
    at norm 1 (the same factors as ``triton_16bit``, bit for bit). M does not grow with |q|·|k| and keeps the 16-bit
    products."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "large_norm_errors.py"
    spec = importlib.util.spec_from_file_location("large_norm_errors", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    unit, large = (script.factor_errors(torch.float16, norm, "cpu", shape=(1, 40, 2, 1, 16), chunk=16)["factors"]
                   for norm in (1, 50))
    for name, f in unit.items():
        assert f["torch"]["error"] < 1e-5 * f["true"] < f["triton_16bit"]["error"] < 2e-3 * f["true"], (name, f)
        assert f["triton"] == f["triton_16bit"], (name, f)
    assert large["S_d"]["triton_16bit"]["error"] > 1000 * unit["S_d"]["triton_16bit"]["error"]
    for name in ("q_start", "k_end", "S_d"):
        f = large[name]
        assert f["triton"]["error"] < 1e-5 * f["true"] < f["triton_16bit"]["error"], (name, f)
    assert large["M"]["triton"] == large["M"]["triton_16bit"]


def test_split_products_per_query_head():
    """Grouped heads (two query heads per kv head), fp16, only head 0's q scaled ×100: head 0 gets q̃ and S_d at
    fp32 level and the kv head's k̃ too (one of its heads is large), while head 1 keeps the 16-bit products, bit for
    bit those of ``KernelConfig(ut_split_logits=False)``; pinned on (``True``) every factor but M is at fp32 level
    at norm 1 as well."""
    q, k, w, beta = token_inputs(1, 50, 2, 1, 32, (0.0, 2.0), seed=3, dtype=torch.float16)
    q = torch.cat([(q[:, :, :1].float() * 100).half(), q[:, :, 1:]], dim=2)
    layout = build_layout(1, 50, 16, "cpu")
    with torch.no_grad():
        want = pytorch_route(q, k, w, beta, layout)
        got = ut_factors_triton(q, k, w, beta, layout)
        off = ut_factors_triton(q, k, w, beta, layout, KernelConfig(ut_split_logits=False))
        on_unit = ut_factors_triton(q[:, :, 1:], k, w, beta, layout, KernelConfig(ut_split_logits=True))
        want_unit = pytorch_route(q[:, :, 1:], k, w, beta, layout)
    for i in (0, 3):  # q̃, S_d
        assert rel_rms(got[i][0], want[i][0]) < 1e-6 < rel_rms(off[i][0], want[i][0])
        assert torch.equal(got[i][1], off[i][1])
        assert rel_rms(on_unit[i], want_unit[i]) < 1e-6 < rel_rms(off[i][1:], want[i][1:])
    assert rel_rms(got[1], want[1]) < 1e-6 < rel_rms(off[1], want[1])
    assert torch.equal(got[2], off[2])


@pytest.mark.parametrize("block", [16, 32, 64, 128])
@pytest.mark.parametrize("beta_range", [(0.0, 0.05), (1.9, 2.0)], ids=["beta0", "beta2"])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.float16], ids=["w32", "w16"])
def test_inverse_kernel_matches_the_fp64_inverse(block, beta_range, w_dtype):
    """``_ut_inverse_kernel`` (16×16 blocks, then doubling, in place) against an fp64 inverse of
    I + strictLower(D_β W Wᵀ), on a buffer pre-filled with NaN, with the last chunk padded: fp32 accuracy, every
    element written. fp16 w takes the one-pass Gram product on its rows, here with rows of very different
    scales (1e-6 to 300, and zero rows)."""
    from pathlab.kernels import ut_common

    T = 2 * block + 7
    _, _, w, beta = token_inputs(1, T, 2, 2, 32, beta_range, seed=block)
    if w_dtype == torch.float16:
        w = (w * torch.tensor([1e-6, 1e-3, 1.0, 300.0, 0.0]).repeat(T)[:T, None, None]).half()
        assert ut_common.gram_on_16_bit_rows(w.dtype)
    wn = torch.nn.functional.normalize(w.double(), dim=-1)
    layout = build_layout(1, T, block, "cpu")
    got = torch.full((2, 3, block, block), float("nan"))
    ut_common._inverse(w, beta, slot_tokens(layout, 1, T), T, block, out=got)
    wc, bc = to_chunks(wn, layout), to_chunks(beta.double(), layout)
    lower = torch.eye(block, dtype=torch.float64) + (bc[..., :, None] * (wc @ wc.transpose(-1, -2))).tril(-1)
    want = torch.linalg.inv(lower)
    assert not torch.isnan(got).any()
    assert rel_rms(got, want) < 1e-6, rel_rms(got, want)
    assert torch.equal(got.triu(1), torch.zeros_like(got))


def test_gram_on_16_bit_rows_policy(monkeypatch):
    """The one-pass Gram product for fp16 w, and for bf16 w on a GPU (not under the interpreter, whose bf16
    products are not exact); fp32 w keeps the 3-pass product; ``KernelConfig(gram16=False)`` turns it off."""
    from pathlab.kernels.ut_common import gram_on_16_bit_rows

    assert gram_on_16_bit_rows(torch.float16) and not gram_on_16_bit_rows(torch.float32)
    assert not gram_on_16_bit_rows(torch.bfloat16)  # these tests run under the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert gram_on_16_bit_rows(torch.bfloat16)
    off = KernelConfig(gram16=False)
    assert not gram_on_16_bit_rows(torch.bfloat16, off) and not gram_on_16_bit_rows(torch.float16, off)


def test_output_buffers_are_nan_under_the_interpreter_or_debug_and_unfilled_otherwise(monkeypatch):
    """``runtime.unwritten``: NaN under the interpreter (these tests) and with PATHLAB_DEBUG=1 (the GPU tests);
    on a GPU run without debug no fill kernel is spent on a buffer the kernel overwrites."""
    from pathlab.kernels import runtime as _mode

    assert torch.isnan(_mode.unwritten((3, 4), dtype=torch.float32, device="cpu")).all()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("PATHLAB_DEBUG", "1")
    assert torch.isnan(_mode.unwritten((2,), dtype=torch.bfloat16, device="cpu")).all()
    monkeypatch.delenv("PATHLAB_DEBUG")

    def no_fill(*args, **kwargs):
        raise AssertionError("unwritten filled a buffer outside the interpreter and debug mode")

    monkeypatch.setattr(torch, "full", no_fill)
    out = _mode.unwritten((5, 6), dtype=torch.float16, device="cpu")
    assert out.shape == (5, 6) and out.dtype == torch.float16


def test_fused_route_inverts_twice_per_forward_and_backward(monkeypatch):
    """The recomputing op inverts once in the forward and once in the backward, whose UT backward reuses the A
    of its own UT recomputation (a third inversion would repeat the same work)."""
    from pathlab.kernels import ut_backward, ut_forward

    calls = []
    inverse = ut_forward._inverse
    for module in (ut_forward, ut_backward):
        monkeypatch.setattr(module, "_inverse", lambda *a, **kw: calls.append(1) or inverse(*a, **kw))
    q, k, w, beta = (x.requires_grad_() for x in token_inputs(1, 40, 2, 1, 16, (0.0, 2.0), seed=5))
    v = torch.randn(1, 40, 1, 16, requires_grad=True)
    o = path_attention_triton(q, k, v, w, beta, block_size=16, ut="triton")
    assert len(calls) == 1
    o.square().sum().backward()
    assert len(calls) == 2 and all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v, w, beta))


@pytest.mark.parametrize("gate", [False, True], ids=["path", "path_fox"])
def test_saved_factors_route_equals_the_recomputing_route(gate, monkeypatch):
    """``ut="triton_saved"`` keeps the UT factors and A for the backward: the same output and gradients as
    ``ut="triton"`` (which recomputes them), with one inversion per forward+backward instead of two."""
    from pathlab.kernels import ut_backward, ut_forward

    q, k, w, beta = token_inputs(1, 45, 4, 2, 16, (0.0, 2.0), seed=6)
    gen = torch.Generator().manual_seed(7)
    v = torch.randn(1, 45, 2, 32, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(1, 45, 4, generator=gen)) if gate else None
    do = torch.randn(1, 45, 4, 32, generator=gen)
    results = {}
    for ut in ("triton", "triton_saved"):
        calls = []
        inverse = ut_forward._inverse
        for module in (ut_forward, ut_backward):
            monkeypatch.setattr(module, "_inverse", lambda *a, _inv=inverse, **kw: calls.append(1) or _inv(*a, **kw))
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, w, beta) + ((g,) if gate else ())]
        o = path_attention_triton(*leaves[:5], leaves[5] if gate else None, block_size=16, ut=ut)
        grads = torch.autograd.grad(o, leaves, do)
        results[ut] = (o, grads, len(calls))
        for module in (ut_forward, ut_backward):
            monkeypatch.setattr(module, "_inverse", inverse)
    (o1, g1, n1), (o2, g2, n2) = results["triton"], results["triton_saved"]
    assert (n1, n2) == (2, 1)
    assert rel_rms(o2, o1) < 1e-6
    for a, b in zip(g2, g1):
        assert rel_rms(a, b) < 1e-6


def test_lambda_precision_choice(monkeypatch):
    """λ's products: bf16 operands for 16-bit inputs on a GPU, tf32 under the interpreter (its bf16 products are
    not exact), exact fp32 for fp32 inputs."""
    from pathlab.kernels.scan import lambda_bf16

    assert not lambda_bf16(torch.float16) and not lambda_bf16(torch.float32)  # these tests run interpreted
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert lambda_bf16(torch.float16) and not lambda_bf16(torch.float32)


@pytest.mark.parametrize("half", [False, True], ids=["tf32", "fp16-narrow-scratch"])
@pytest.mark.parametrize("split", [False, True], ids=["three-kernel-backward", "split-backward"])
def test_ut_backward_consuming_its_gradients_gives_the_same_result(split, half):
    """``ut_backward(..., consume=True)`` (what the fused routes call: dk̃'s buffer reused for the partial dk when
    the scratch is fp32, dM freed once read) empties the list it is handed and returns exactly what
    ``consume=False`` returns; the caller's copies are not touched by the non-consuming call."""
    from pathlab.kernels.ut_backward import ut_backward
    from pathlab.kernels.ut_forward import ut_forward

    config = KernelConfig(ut_split=split, ut_half=half)
    q, k, w, beta = token_inputs(1, 37, 4, 2, 16, (0.0, 2.0), seed=11)
    tokens = slot_tokens(build_layout(1, 37, 16, "cpu"), 1, 37)
    factors = ut_forward(q, k, w, beta, tokens, 16, config=config)[:4]
    gen = torch.Generator().manual_seed(12)
    grads = [torch.randn(f.shape, generator=gen) for f in factors]
    kept = [g.clone() for g in grads]
    want = ut_backward(grads, q, k, w, beta, tokens, 16, config=config)
    assert all(torch.equal(a, b) for a, b in zip(grads, kept)), "consume=False changed its inputs"
    handed = [g.clone() for g in kept]
    got = ut_backward(handed, q, k, w, beta, tokens, 16, consume=True, config=config)
    assert handed == []
    for name, a, b in zip(["dq", "dk", "dw", "dβ"], got, want):
        assert torch.equal(a, b), name


def test_scan_backward_into_its_inputs_needs_fp32_factors():
    """``_scan_bwd_impl(..., into_inputs=True)`` writes dq̃ and dS_d over q̃ and S_d, which must be fp32."""
    from pathlab.kernels.scan import _scan_bwd_impl

    H, NC, BT, D = 1, 2, 16, 16
    qs = torch.zeros(H, NC, BT, D, dtype=torch.float16)
    sd = torch.zeros(H, NC, BT, BT)
    with pytest.raises(ValueError, match="into_inputs needs fp32"):
        _scan_bwd_impl(torch.zeros(H, NC, BT, D), qs, qs, torch.zeros(H, NC, BT, D), torch.zeros(H, NC, D, D), sd,
                       None, None, torch.zeros(H, NC, BT, D), torch.zeros(H, NC, BT), None, None, None, NC, 1.0, 0,
                       into_inputs=True)


def test_worst_row_share_finds_the_row_that_holds_the_error():
    """``benchmarks/large_norm_errors.py``'s worst-row share: 1 when one (b, t, head) row holds all of the error,
    1/rows when every row holds the same, per element for ``[B, T, heads]`` tensors (β, g), 0 without error."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "large_norm_errors.py"
    spec = importlib.util.spec_from_file_location("large_norm_errors", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    want = torch.randn(2, 5, 3, 4, dtype=torch.float64)
    one = want.clone()
    one[1, 2, 0] += 1e-3 * torch.randn(4, dtype=torch.float64)
    assert script.worst_row_share(one, want) == pytest.approx(1.0)
    assert script.worst_row_share(want + 1e-3, want) == pytest.approx(1 / 30)
    gates = torch.zeros(2, 5, 3, dtype=torch.float64)
    assert script.worst_row_share(gates + 1.0, gates) == pytest.approx(1 / 30)
    assert script.worst_row_share(want.float(), want.float().double()) == 0.0
