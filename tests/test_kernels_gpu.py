"""GPU tests of the Triton PaTH kernel (bf16, long sequences) and of decoding on CUDA. Run with ``pytest -m gpu``.

Tolerances are relative RMS errors against an fp64 oracle (the explicit reference for T ≤ 512, the blockwise
PyTorch algorithm in fp64 beyond), as the public kernel passes them with bf16 inputs and β ∈ [1.5, 2]:
o ≤ 5e-3, dq/dk/dv ≤ 8e-3, dw ≤ 1.5e-2, dβ/dg ≤ 2e-2.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from pathlab.kernels.config import KernelConfig
from pathlab.testing import grads_of, random_path_inputs

pytestmark = pytest.mark.gpu

TOL = {"o": 5e-3, "dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dw": 1.5e-2, "dbeta": 2e-2, "dg": 2e-2}


def rel_rms(a, b):
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


@pytest.fixture(autouse=True)
def _nan_filled_outputs(monkeypatch):
    """PATHLAB_DEBUG=1: the kernels' output buffers start as NaN (as under the interpreter), so an element a
    kernel fails to write shows in the comparisons."""
    monkeypatch.setenv("PATHLAB_DEBUG", "1")


def inputs(B, T, H, Hkv, D, *, beta_range=(1.5, 2.0), gate=True, seed=0, w_dtype=torch.float32):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q, k, v = r(B, T, H, D).bfloat16(), r(B, T, Hkv, D).bfloat16(), r(B, T, Hkv, D).bfloat16()
    w = r(B, T, Hkv, D).to(w_dtype)
    lo, hi = beta_range
    beta = lo + (hi - lo) * torch.rand(B, T, Hkv, device="cuda", generator=gen)
    g = F.logsigmoid(3.0 + r(B, T, H)) if gate else None
    return q, k, v, w, beta, g


def bf16_case(T, H, Hkv, D, gate, w_dtype=torch.float32, ut=None, config=None):
    """Leaves (q, k, v bf16, w in ``w_dtype``, β[, g] fp32) for B = 1, an output gradient, and the Triton op:
    through ``pathlab.path_attention(backend="triton")`` by default, else the kernel with route ``ut`` and the
    :class:`KernelConfig` ``config``."""
    import pathlab
    from pathlab.kernels import path_attention_triton

    q, k, v, w, beta, g = inputs(1, T, H, Hkv, D, gate=gate, w_dtype=w_dtype)
    leaves = [q, k, v, w, beta] + ([g] if gate else [])
    do = torch.randn(1, T, H, D, device="cuda").bfloat16()

    def fast(*xs):
        if ut is None and config is None:
            return pathlab.path_attention(*xs[:5], xs[5] if gate else None, backend="triton")
        return path_attention_triton(*xs[:4], xs[4].float(), xs[5].float() if gate else None, ut=ut, config=config)

    return leaves, do, fast


@pytest.mark.parametrize("T,oracle", [(300, "reference"), (4096, "torch"), (16384, "torch")],
                         ids=["T300-ref", "T4096-blockwise64", "T16384-blockwise64"])
@pytest.mark.parametrize("gate", [False, True], ids=["path", "path_fox"])
@pytest.mark.parametrize("ut", ["torch", "triton", "triton_saved"], ids=["ut-torch", "ut-triton", "ut-triton-saved"])
def test_bf16_against_oracle(T, oracle, gate, ut):
    # the per-chunk UT transform: PyTorch ops or the fused kernels
    _check_bf16_against_oracle(T, oracle, gate, f"ut={ut}", ut=ut)


@pytest.mark.parametrize("D", [16, 32])
@pytest.mark.parametrize("gate", [False, True], ids=["path", "path_fox"])
@pytest.mark.parametrize("ut", ["triton", "triton_saved"], ids=["ut-triton", "ut-triton-saved"])
def test_bf16_small_head_dims(D, gate, ut):
    """Head dims 16 and 32 (a small model's, e.g. width 64 with 2 heads) compile to other tiles than 64 and 128."""
    _check_bf16_against_oracle(300, "reference", gate, f"ut={ut} D={D}", D=D, ut=ut)


@pytest.mark.parametrize("T,D", [(300, 64), (4096, 64), (4096, 128)], ids=["T300-D64", "T4096-D64", "T4096-D128"])
@pytest.mark.parametrize("gate", [False, True], ids=["path", "path_fox"])
def test_bf16_w_as_the_model_passes_it(T, D, gate):
    """w in bf16, as the language model's PaTH layers pass it: the inverse kernel forms W Wᵀ in one pass on the
    bf16 rows (``ut_common.gram_on_16_bit_rows``); the other tests pass fp32 w, which takes the 3-pass route."""
    _check_bf16_against_oracle(T, "reference" if T <= 300 else "torch", gate, f"w=bf16 D={D}", D=D,
                               w_dtype=torch.bfloat16)


def test_inverse_on_bf16_rows_of_any_scale():
    """The inverse kernel's one-pass Gram product on bf16 rows scales each row by a power of two first, so rows
    from 1e-30 to 1e30 (and zero rows) give the fp64 inverse at fp32 accuracy; unscaled, their products would
    leave fp32's range. (Under the interpreter, whose bf16 products are wrong, this runs only on a GPU.)"""
    from pathlab.kernels import ut_common as _triton_ut
    from pathlab.kernels.layout import build_layout, slot_tokens, to_chunks

    T, BT = 300, 64
    gen = torch.Generator(device="cuda").manual_seed(3)
    scales = torch.tensor([1e-30, 1e-3, 1.0, 1e30, 0.0], device="cuda").repeat(T)[:T, None, None]
    w = (torch.randn(1, T, 2, 64, device="cuda", generator=gen) * scales).bfloat16()
    beta = 1.9 + 0.1 * torch.rand(1, T, 2, device="cuda", generator=gen)
    assert _triton_ut.gram_on_16_bit_rows(w.dtype)
    layout = build_layout(1, T, BT, "cuda")
    got = _triton_ut._inverse(w, beta, slot_tokens(layout, 1, T), T, BT)
    wc = to_chunks(F.normalize(w.double(), dim=-1), layout)
    lower = torch.eye(BT, dtype=torch.float64, device="cuda") + (
        to_chunks(beta.double(), layout)[..., :, None] * (wc @ wc.transpose(-1, -2))).tril(-1)
    assert rel_rms(got, torch.linalg.inv(lower)) < 1e-6


@pytest.mark.parametrize("ut", ["triton", "triton_saved"], ids=["ut-triton", "ut-triton-saved"])
def test_inputs_addressed_beyond_2_31_elements(ut):
    """64-bit offsets: q, k, v, w as views into one buffer whose second sequence starts 2³¹ elements in (8.6 GB of
    bf16) give the output and gradients of the same inputs copied to small contiguous tensors. The kernels read
    q, k, w, β (and v, at this length) where they lie, so a 32-bit offset would read the wrong rows or fault."""
    from pathlab.kernels import path_attention_triton

    B, T, H, D = 2, 300, 4, 64
    n = T * H * D
    gen = torch.Generator(device="cuda").manual_seed(5)
    buf = torch.empty(B, 2**31 + 4 * n, device="cuda", dtype=torch.bfloat16)
    for b in range(B):
        buf[b, :4 * n] = torch.randn(4 * n, device="cuda", generator=gen).bfloat16()
    far = [buf[:, i * n:(i + 1) * n].view(B, T, H, D) for i in range(4)]  # q, k, v, w
    assert far[0].stride(0) > 2**31 and far[0][1].data_ptr() - buf.data_ptr() >= 2**31 * buf.element_size()
    beta = 0.5 + torch.rand(B, T, H, device="cuda", generator=gen)
    do = torch.randn(B, T, H, D, device="cuda", generator=gen).bfloat16()

    def run(xs):
        leaves = [x.detach().requires_grad_() for x in xs] + [beta.detach().requires_grad_()]
        o = path_attention_triton(*leaves, None, ut=ut)
        return [o.detach()] + [g.detach() for g in torch.autograd.grad(o, leaves, do)]

    got = run(far)
    want = run([x.contiguous() for x in far])
    del buf, far
    for name, a, b in zip(["o", "dq", "dk", "dv", "dw", "dbeta"], got, want):
        assert torch.isfinite(a).all(), name
        assert rel_rms(a, b) <= 1e-3, f"{name}: {rel_rms(a, b):.3g}"


@pytest.mark.parametrize("states", [True, False], ids=["forward-states", "replayed-states"])
@pytest.mark.parametrize("gate", [False, True], ids=["path", "path_fox"])
def test_bf16_saving_route_with_and_without_the_forward_states(states, gate):
    """The saving route's backward reading the carried states the forward kept (the default up to 16 chunks,
    pinned here at 4096 tokens as well) or replaying them (``KernelConfig.forward_states``)."""
    config = KernelConfig(forward_states=states)
    _check_bf16_against_oracle(300, "reference", gate, f"states={states}", ut="triton_saved", config=config)
    _check_bf16_against_oracle(4096, "torch", gate, f"states={states}", ut="triton_saved", config=config)


@pytest.mark.parametrize("launch", ["by-query-chunk", "default", (1, 4, 1), (2, 8, 2)],
                         ids=["by-query-chunk", "by-sequence", "by-sequence-one-stage", "by-sequence-R2"])
@pytest.mark.parametrize("gate", [False, True], ids=["path", "path_fox"])
def test_bf16_backward_by_sequence(launch, gate):
    """The saving route's backward with the forward's states by query chunk or by sequence, pinned on (too few
    sequences here for the default), with its default launch, one stage, or two query chunks to a tile
    (``KernelConfig.by_sequence_launch``), against the oracles."""
    config = KernelConfig(forward_states=True, by_sequence=launch != "by-query-chunk",
                          by_sequence_launch=launch if isinstance(launch, tuple) else None)
    _check_bf16_against_oracle(300, "reference", gate, f"by-sequence={launch}", ut="triton_saved", config=config)
    _check_bf16_against_oracle(1024, "torch", gate, f"by-sequence={launch}", ut="triton_saved", config=config)


@pytest.mark.parametrize("half", [True, False], ids=["fp16", "tf32"])
@pytest.mark.parametrize("gate", [False, True], ids=["path", "path_fox"])
def test_bf16_ut_product_operands(half, gate):
    """The UT kernels' products on scaled fp16 operands (the default for 16-bit inputs) or tf32 ones (fp32
    inputs' route, pinned here for bf16 ones), on the saving route."""
    config = KernelConfig(ut_half=half)
    _check_bf16_against_oracle(300, "reference", gate, f"ut-half={half}", ut="triton_saved", config=config)
    _check_bf16_against_oracle(4096, "torch", gate, f"ut-half={half}", ut="triton_saved", config=config)


@pytest.mark.parametrize("scratch", [True, False], ids=["fp16-scratch", "fp32-scratch"])
@pytest.mark.parametrize("gate", [False, True], ids=["path", "path_fox"])
def test_bf16_ut_backward_scratch(scratch, gate):
    """The three-kernel UT backward with its scratch in scaled fp16 (``KernelConfig.ut_scratch16``, the default
    for fp16 operands) and in fp32, at head dim 64 and 32 (where its last kernel runs at 8 warps)."""
    config = KernelConfig(ut_scratch16=scratch)
    for D in (64, 32):
        _check_bf16_against_oracle(300, "reference", gate, f"scratch16={scratch} D={D}", D=D, ut="triton_saved",
                                   config=config)
    _check_bf16_against_oracle(4096, "torch", gate, f"scratch16={scratch}", ut="triton_saved", config=config)


@pytest.mark.parametrize("gate", [False, True], ids=["path", "path_fox"])
@pytest.mark.parametrize("ut", ["triton", "triton_saved"], ids=["ut-triton", "ut-triton-saved"])
def test_bf16_fused_ut_at_head_dim_128(gate, ut):
    """At D = 128 the fused UT backward runs split in five kernels (the three-kernel form needs more shared memory
    than an H200 has)."""
    _check_bf16_against_oracle(4096, "torch", gate, f"ut={ut} D=128", D=128, ut=ut)


def test_recomputing_backward_in_head_groups():
    """The recomputing backward head group by head group: with one kv head per group (a 1 MiB budget) against the
    oracle; at T = 16384, 16×128 with the default budget (6 groups of at most 3 kv heads) a peak below 0.8× that of
    all heads at once (predicted about 0.67×: the scan's scratch is not split)."""
    _check_bf16_against_oracle(4096, "torch", True, "ut=triton D=128 head groups of one", D=128, ut="triton",
                               config=KernelConfig(group_mib=1))
    peaks = {}
    for budget in (0, None):  # never split; the default budget
        leaves, do, fast = bf16_case(16384, 16, 16, 128, gate=False, ut="triton", config=KernelConfig(group_mib=budget))
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        got = grads_of(fast, leaves, do)
        torch.cuda.synchronize()
        peaks[budget] = (torch.cuda.max_memory_allocated() - base) / 2**20
        assert all(torch.isfinite(x).all() for x in got)
        del leaves, do, got
    print(f"peak MiB, all heads at once (0) / in head groups (default): {peaks}")
    assert peaks[None] < 0.8 * peaks[0], peaks


def _check_bf16_against_oracle(T, oracle, gate, label, D=64, w_dtype=torch.float32, ut=None, config=None):
    import pathlab
    from pathlab.reference import path_attention as reference

    H, Hkv = (4, 2) if T <= 4096 else (2, 1)
    leaves, do, fast = bf16_case(T, H, Hkv, D, gate, w_dtype, ut=ut, config=config)

    def slow(*xs):
        xs = [x.double() for x in xs]
        if oracle == "reference":
            return reference(*xs[:5], xs[5] if gate else None)
        return pathlab.path_attention(*xs[:5], xs[5] if gate else None, backend="torch", chunk_size=256)

    got = grads_of(fast, leaves, do)
    want = grads_of(slow, leaves, do.double())
    names = ["o", "dq", "dk", "dv", "dw", "dbeta"] + (["dg"] if gate else [])
    errs = {n: rel_rms(a, b) for n, a, b in zip(names, got, want)}
    print(f"T={T} gate={gate} {label} errors: {errs}")
    for n, e in errs.items():
        assert e <= TOL[n], f"{n}: relative RMS error {e:.3g} > {TOL[n]} (all: {errs})"


@pytest.mark.parametrize("ut, D", [("torch", 128), ("triton", 64), ("triton_saved", 64), ("triton", 128)],
                         ids=["ut-torch-D128", "ut-triton-D64", "ut-triton-saved-D64", "ut-triton-D128"])
def test_long_sequence_beta_near_two_is_finite(ut, D):
    """65,536 tokens, β near 2: finite output and gradients (at D = 128 the fused UT backward runs split)."""
    from pathlab.kernels import path_attention_triton

    q, k, v, w, beta, g = inputs(1, 65536, 4, 4, D, beta_range=(1.9, 1.999), gate=True)
    leaves = [t.requires_grad_() for t in (q, k, v, w, beta, g)]
    o = path_attention_triton(*leaves, ut=ut)
    o.backward(torch.randn_like(o))
    assert torch.isfinite(o).all()
    for name, t in zip("q k v w beta g".split(), leaves):
        assert torch.isfinite(t.grad).all(), f"d{name} has NaN/inf"


def test_three_kernel_ut_backward_at_head_dim_128_says_it_does_not_fit():
    """Pinned to three kernels at D = 128 (``KernelConfig(ut_split=False)``) with tf32 products
    (``ut_half=False``; fp16 operands take half the shared memory, and fit), the fused UT backward needs
    more shared memory than an H200 has: a clear error naming the way out, not a raw Triton exception. (If a GPU
    ever fits it, this test fails and the split default can be revisited.)"""
    from pathlab.kernels import path_attention_triton

    q, k, v, w, beta = (t.requires_grad_() for t in inputs(1, 256, 2, 2, 128, gate=False)[:5])
    o = path_attention_triton(q, k, v, w, beta, ut="triton", config=KernelConfig(ut_split=False, ut_half=False))
    assert torch.isfinite(o).all()
    with pytest.raises(RuntimeError, match=r"do not fit this GPU for head dim 128.*ut='torch'"):
        o.float().square().sum().backward()


@pytest.mark.parametrize("gate", [False, True], ids=["path", "path_fox"])
def test_prefill_then_512_steps_match_parallel_form(gate):
    import pathlab
    from pathlab.decoding import PathDecodeCache

    T0, N, H, Hkv, D = 1024, 512, 4, 2, 64
    q, k, v, w, beta, g = inputs(2, T0 + N, H, Hkv, D, beta_range=(0.0, 2.0), gate=gate)
    full = pathlab.path_attention(q.float(), k.float(), v.float(), w, beta, g, backend="torch")
    cache = PathDecodeCache(2, Hkv, T0 + N, D, D, n_heads=H, device="cuda")
    sl = lambda t, a, b: None if t is None else t[:, a:b]  # noqa: E731
    outs = [cache.prefill(*(sl(t, 0, T0).float() if t.dtype == torch.bfloat16 else sl(t, 0, T0)
                            for t in (q, k, v, w, beta)), sl(g, 0, T0))]
    for t in range(T0, T0 + N):
        outs.append(cache.step(*(sl(x, t, t + 1).float() for x in (q, k, v, w, beta)), sl(g, t, t + 1)))
    o = torch.cat(outs, 1)
    err = (o - full).abs().max().item() / full.abs().max().item()
    assert err <= 2e-3, f"decode vs parallel form: max error {err:.3g} relative to max |o|"


@pytest.mark.parametrize("gate", [False, True], ids=["path", "path_fox"])
@pytest.mark.parametrize("ut", ["torch", "triton"], ids=["ut-torch", "ut-triton"])
def test_compiled_kernel_bf16_matches_eager_and_oracle(gate, ut):
    """``torch.compile`` (Inductor, ``fullgraph=True``) of the Triton op in bf16, forward and backward.

    The scan is the opaque custom op pair ``pathlab::path_scan_fwd``/``bwd``, so Inductor neither breaks the graph
    nor tries to precompile ``_path_fwd_kernel`` (which failed on torch 2.11 / triton 3.6). The compiled result
    meets the fp64 oracle's tolerances and stays within half of them of eager (Inductor fuses the fp32 UT prep,
    whose rounding differs)."""
    from pathlab.reference import path_attention as reference

    torch._dynamo.reset()
    leaves, do, fast = bf16_case(300, 4, 2, 64, gate, ut=ut)

    def slow(*xs):
        xs = [x.double() for x in xs]
        return reference(*xs[:5], xs[5] if gate else None)

    eager = grads_of(fast, leaves, do)
    compiled = grads_of(torch.compile(fast, fullgraph=True), leaves, do)
    want = grads_of(slow, leaves, do.double())
    names = ["o", "dq", "dk", "dv", "dw", "dbeta"] + (["dg"] if gate else [])
    vs_oracle = {n: rel_rms(a, b) for n, a, b in zip(names, compiled, want)}
    vs_eager = {n: rel_rms(a, b) for n, a, b in zip(names, compiled, eager)}
    print(f"compiled gate={gate}: vs fp64 {vs_oracle}; vs eager {vs_eager}")
    for n in names:
        assert vs_oracle[n] <= TOL[n], f"{n}: compiled vs fp64 {vs_oracle[n]:.3g} > {TOL[n]} (all: {vs_oracle})"
        assert vs_eager[n] <= TOL[n] / 2, f"{n}: compiled vs eager {vs_eager[n]:.3g} > {TOL[n] / 2} ({vs_eager})"
    torch._dynamo.reset()


@pytest.mark.parametrize("attention", ["path", "path_fox"])
@pytest.mark.parametrize("ut", ["torch", "triton", "triton_saved"], ids=["ut-torch", "ut-triton", "ut-triton-saved"])
def test_compiled_model_bf16_matches_eager(attention, ut, monkeypatch):
    """A small PaTH model under bf16 autocast, compiled whole with ``fullgraph=True`` as ``pathlab train`` does by
    default on CUDA (``backend="auto"`` is the Triton kernel here): loss and parameter gradients match eager. The
    model takes the kernel's own route; each route is pinned here by replacing its choice."""
    import pathlab
    from pathlab.kernels import path as kernel_path

    monkeypatch.setattr(kernel_path, "_ut_name", lambda name, q: ut)
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = pathlab.ModelConfig(n_layer=2, n_head=4, n_embd=256, vocab_size=512, attention=attention)
    model = pathlab.build_model(cfg).cuda()
    idx = torch.randint(0, 512, (2, 256), device="cuda")
    targets = torch.randint(0, 512, (2, 256), device="cuda")

    def run(net):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = net(idx, targets)
        loss.backward()
        return [loss.detach()] + [p.grad.detach().clone() for p in model.parameters()]

    eager = run(model)
    compiled = run(torch.compile(model, fullgraph=True))
    names = ["loss"] + [n for n, _ in model.named_parameters()]
    errs = {n: rel_rms(a, b) for n, a, b in zip(names, compiled, eager) if b.abs().max() > 0}
    print(f"compiled {attention} model vs eager: max {max(errs.values()):.3g}; loss {float(eager[0]):.5f}")
    bad = {n: e for n, e in errs.items() if not e <= 5e-2}  # bf16 roundings differ; a wrong kernel gives O(1)
    assert not bad, f"compiled model differs from eager (relative RMS > 5e-2): {bad}"
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------------------
# Poisoned sequences and saturated softmax rows (the CPU versions: test_path_isolation.py, test_kernels.py)

POISONS = [(name, float("nan")) for name in ("q", "k", "v", "w", "beta", "g")] + [("g", -1e12)]
POISON_IDS = [f"nan-{name}" for name in ("q", "k", "v", "w", "beta", "g")] + ["g-minus-1e12"]


def _poison_run(dtype, ut, layout, poison):
    """(clean, poisoned, rows of the other sequences): [o, dq, dk, dv, dw, dβ, dg] of the Triton op with sequence 1
    (``layout="batch"``: B = 3 × T = 300; ``"packed"``: ``cu_seqlens`` segments of 100, 257, 64 tokens) poisoned
    at two positions, and the rows ``(b, t)`` (a boolean ``[B, T]``) of the sequences that must not move."""
    from pathlab.kernels import path_attention_triton

    B, T = (3, 300) if layout == "batch" else (1, 421)
    cu = None if layout == "batch" else torch.tensor([0, 100, 357, 421], dtype=torch.int32, device="cuda")
    q, k, v, w, beta, g = inputs(B, T, 4, 2, 64, gate=True, seed=11)
    leaves = [x.to(dtype) if x.dtype == torch.bfloat16 else x for x in (q, k, v, w, beta, g)]
    do = torch.randn(B, T, 4, 64, device="cuda", generator=torch.Generator(device="cuda").manual_seed(12)).to(dtype)
    fn = lambda *xs: path_attention_triton(*xs, cu_seqlens=cu, ut=ut)  # noqa: E731 (no value checks: NaN on purpose)
    keep = torch.ones(B, T, dtype=torch.bool, device="cuda")
    if layout == "batch":
        b, pos, keep[1] = 1, torch.tensor([5, 170]), False
    else:
        b, pos = 0, torch.tensor([103, 290])
        keep[0, 100:357] = False
    name, value = poison
    dirty = [x.clone() for x in leaves]
    dirty[("q", "k", "v", "w", "beta", "g").index(name)][b, pos] = value
    return grads_of(fn, leaves, do), grads_of(fn, dirty, do), keep


@pytest.mark.parametrize("poison", POISONS, ids=POISON_IDS)
@pytest.mark.parametrize("layout", ["batch", "packed"])
@pytest.mark.parametrize("ut", ["torch", "triton", "triton_saved"], ids=["ut-torch", "ut-triton", "ut-triton-saved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_poisoned_sequence_leaves_the_others_alone(dtype, ut, layout, poison):
    """A NaN in one sequence's q, k, v, w, β or g (or a gate of −1e12) changes no other sequence of the batch or
    segment of ``cu_seqlens``: o bit for bit (the forward has no atomics), the gradients up to the order of the
    backward's fp32 atomics (1e-4 of each tensor's largest element in fp32; in bf16 a rounding step, 1e-2)."""
    clean, dirty, keep = _poison_run(dtype, ut, layout, poison)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    for name, a, b in zip(["o", "dq", "dk", "dv", "dw", "dbeta", "dg"], clean, dirty):
        a, b = a[keep].float(), b[keep].float()
        assert torch.isfinite(a).all() and torch.isfinite(b).all(), f"{name} not finite in the other sequences"
        if name == "o":
            assert torch.equal(a, b), f"o of the other sequences changed ({poison})"
        else:
            err = float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))
            assert err <= tol, f"{name} of the other sequences changed by {err:.3g} of its largest element"


@pytest.mark.parametrize("norm", [50, 200], ids=["x50", "x200"])
@pytest.mark.parametrize("ut", ["triton", "triton_saved"], ids=["ut-triton", "ut-triton-saved"])
def test_bf16_large_query_and_key_norms(ut, norm):
    """bf16 q, k scaled ×50 and ×200 (PaTH-FoX, B = 2 so the saving route's backward runs by sequence), o and every
    gradient against the fp64 reference, each error as a fraction of max(the true value's RMS, its RMS at norm 1),
    over six input draws. Logits of |q|·|k|/√D ≈ 2500 and 4·10⁴ nats are resolved by the carried states' 16-bit
    significand, so no route is exact, and at ×200 every row saturates except a few near-ties (top two logits a few
    nats apart) that carry all of the gradients: one query row holds all of dq's error in each fp16 draw on the CPU
    (``benchmarks/large_norm_errors.py`` reports that share), and how large it is on each route depends on how that
    row's rounding falls. The fused routes' error over the PyTorch UT route's (fp32 products) so spans 0.2 to 1.8
    across draws, both ways: one draw cannot separate a bias from that spread, the geometric mean over draws can.
    The fused UT routes must add nothing systematic: for each tensor, the geometric mean over the draws of
    (error + 0.005) / (the PyTorch route's error + 0.005) at most 1.5. The control that must fail it: 16-bit UT
    products in every chunk (``ut_split_logits=False``), which left dq, dk, dw, dβ at 0.9 of their scale at ×50 and
    dw at 11 at ×200 (the intra-chunk logits S_d off by some 10 nats)."""

    from pathlab.kernels import path_attention_triton
    from pathlab.reference import path_attention as reference

    B, T, H, Hkv, D = 2, 128, 4, 2, 64
    names = ["o", "dq", "dk", "dv", "dw", "dbeta", "dg"]
    routes = {"fused": dict(ut=ut), "torch": dict(ut="torch"),
              "16-bit": dict(ut="triton", config=KernelConfig(ut_split_logits=False))}
    log_ratios = {"fused": {n: [] for n in names}, "16-bit": {n: [] for n in names}}
    for seed in range(7, 13):
        q, k, v, w, beta, g = inputs(B, T, H, Hkv, D, gate=True, seed=seed)
        gen = torch.Generator(device="cuda").manual_seed(seed + 100)
        do = torch.randn(B, T, H, D, device="cuda", generator=gen).bfloat16()
        big = [(q.float() * norm).bfloat16(), (k.float() * norm).bfloat16(), v, w, beta, g]
        want = grads_of(reference, [x.double() for x in big], do.double())
        unit = grads_of(reference, [x.double() for x in (q, k, v, w, beta, g)], do.double())
        errors = {}
        for route, kwargs in routes.items():
            got = grads_of(lambda *xs: path_attention_triton(*xs, **kwargs), big, do)
            errors[route] = {}
            for name, a, b, u in zip(names, got, want, unit):
                assert torch.isfinite(a).all(), (route, name, seed)
                scale = max(u.double().pow(2).mean().sqrt(), b.double().pow(2).mean().sqrt())
                errors[route][name] = float((a.double() - b).pow(2).mean().sqrt() / scale)
        print(f"bf16 ×{norm} ut={ut} draw {seed}: " + " ".join(
            f"{n} {errors['fused'][n]:.2e} (torch {errors['torch'][n]:.2e}, 16-bit {errors['16-bit'][n]:.2e})"
            for n in names))
        for route, ratios in log_ratios.items():
            for n in names:
                ratios[n].append(math.log((errors[route][n] + 5e-3) / (errors["torch"][n] + 5e-3)))

    def mean_ratios(route):
        return {n: math.exp(sum(r) / len(r)) for n, r in log_ratios[route].items()}

    fused, control = mean_ratios("fused"), mean_ratios("16-bit")
    print(f"geometric means over the draws of (error + 0.005) / (PyTorch route's + 0.005): fused {fused}, "
          f"16-bit {control}")
    assert all(r <= 1.5 for r in fused.values()), f"fused route above 1.5 × the PyTorch UT route's error: {fused}"
    assert not all(r <= 1.5 for r in control.values()), f"the 16-bit control passed the same check: {control}"


@pytest.mark.parametrize("gate", [False, True], ids=["path", "path_fox"])
def test_fp32_scan_forward_at_fp32_accuracy(gate):
    """fp32 inputs through the PyTorch UT route (exact fp32 products there): the scan's forward products (3-pass
    tf32, on the tensor cores) keep the output at fp32 level against the fp64 reference. One-pass tf32 products
    would leave errors near 2⁻¹¹ ≈ 5e-4; exact fp32 ones give about 2e-7. (The fused UT routes take 1-pass tf32
    products for fp32 inputs; ``test_ops_gpu`` holds them to 2e-3.)"""
    from pathlab.kernels import path_attention_triton
    from pathlab.reference import path_attention as reference

    q, k, v, w, beta, g = random_path_inputs(2, 777, 4, 64, Hkv=2, device="cuda", gate=gate)
    with torch.no_grad():
        got = path_attention_triton(q, k, v, w, beta, g, ut="torch")
        want = reference(*(x.double() for x in (q, k, v, w, beta)), None if g is None else g.double())
    err = rel_rms(got, want)
    print(f"fp32 forward, ut=torch, gate={gate}: {err:.2e}")
    assert got.dtype == torch.float32 and err <= 1e-5, f"relative RMS error {err:.3g} > 1e-5"
