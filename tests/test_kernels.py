"""The Triton PaTH kernel against the fp64 reference, on the CPU under the Triton interpreter.

Forward and every gradient (dq, dk, dv, dw, dβ, dg) by relative RMS error, at awkward lengths with small chunks
(BT = 16 or 32) so that T crosses several chunks and ends inside one; the kernel's outputs (o, lse, dq̃, dS_d)
are allocated pre-filled with NaN, so an element it never writes shows up as NaN here. bf16 and long
sequences run on a GPU (``test_kernels_gpu.py``).
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
from pathlab.reference import path_attention as reference  # noqa: E402


def rel_rms(a, b, floor=1e-2):
    """RMS(a − b) / max(RMS(b), floor): relative, with a floor for gradients that are exactly 0 in exact
    arithmetic (dq, dk of a one-token sequence) and O(ε) in floating point. Inputs here are O(1)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(floor))


def make(B, T, H, Hkv, D, DV, dtype, *, beta_range=(0.0, 2.0), gate=True, w_dtype=torch.float32):
    q = torch.randn(B, T, H, D).to(dtype)
    k = torch.randn(B, T, Hkv, D).to(dtype)
    v = torch.randn(B, T, Hkv, DV).to(dtype)
    w = torch.randn(B, T, Hkv, D).to(w_dtype)
    lo, hi = beta_range
    beta = lo + (hi - lo) * torch.rand(B, T, Hkv)
    g = torch.nn.functional.logsigmoid(1.0 + torch.randn(B, T, H)) if gate else None
    return q, k, v, w, beta, g


def compare(inputs, *, tol, cu_seqlens=None, block_size=16, programs=3, ut="torch", config=None):
    q, k, v, w, beta, g = inputs
    leaves = [t.detach().requires_grad_() for t in (q, k, v, w, beta) + ((g,) if g is not None else ())]
    o = path_attention_triton(*leaves[:5], leaves[5] if g is not None else None, cu_seqlens=cu_seqlens,
                              block_size=block_size, programs=programs, ut=ut, config=config)
    do = torch.randn_like(o.float())
    got = [o] + list(torch.autograd.grad(o, leaves, do.to(o.dtype)))

    # the oracle: fp64 reference, one sequence at a time
    bounds = [0, q.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
    want = [torch.zeros_like(t, dtype=torch.float64) for t in [o] + leaves]
    for a, b in zip(bounds[:-1], bounds[1:]):
        part = [t[:, a:b].detach().double().requires_grad_() for t in leaves]
        o_ref = reference(*part[:5], part[5] if g is not None else None)
        grads = torch.autograd.grad(o_ref, part, do[:, a:b].double(), allow_unused=True)
        want[0][:, a:b] = o_ref.detach()
        for slot, gr in zip(want[1:], grads):
            if gr is not None:  # w, β of a length-1 sequence do not enter its output
                slot[:, a:b] = gr
    names = ["o", "dq", "dk", "dv", "dw", "dbeta", "dg"]
    errs = {n: rel_rms(x, y) for n, x, y in zip(names, got, want)}
    for n, x in zip(names, got):
        assert torch.isfinite(x).all(), f"{n} has NaN/inf (an element the kernel never wrote?)"
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"relative RMS errors above {tol}: {bad} (all: {errs})"


CASES = [
    # B, T, H, Hkv, D, DV, dtype, gate, beta_range, block
    pytest.param(1, 1, 2, 2, 16, 16, torch.float32, True, (0.0, 2.0), 16, id="B1-T1-H2-D16-fp32-gate"),
    pytest.param(2, 17, 4, 2, 32, 16, torch.float32, False, (0.0, 2.0), 16, id="B2-T17-H4kv2-D32-Dv16-fp32"),
    pytest.param(1, 100, 2, 1, 16, 32, torch.float32, True, (0.0, 2.0), 16, id="B1-T100-H2kv1-D16-Dv32-fp32-gate"),
    pytest.param(1, 200, 2, 2, 64, 64, torch.float32, True, (0.0, 2.0), 32, id="B1-T200-H2-D64-BT32-fp32-gate"),
    pytest.param(1, 33, 1, 1, 128, 128, torch.float32, False, (0.0, 2.0), 16, id="B1-T33-H1-D128-fp32"),
    pytest.param(1, 70, 2, 2, 32, 32, torch.float32, True, (0.0, 1e-3), 16, id="B1-T70-D32-fp32-beta-near-0"),
    pytest.param(1, 70, 2, 2, 32, 32, torch.float32, True, (1.999, 2.0), 16, id="B1-T70-D32-fp32-beta-near-2"),
    pytest.param(2, 100, 2, 1, 32, 32, torch.float16, True, (0.0, 2.0), 16, id="B2-T100-H2kv1-D32-fp16-gate"),
    pytest.param(1, 200, 2, 2, 16, 16, torch.float16, False, (1.5, 2.0), 16, id="B1-T200-D16-fp16-beta-1.5-2"),
]


@pytest.mark.parametrize("B,T,H,Hkv,D,DV,dtype,gate,beta_range,block", CASES)
def test_matches_reference(B, T, H, Hkv, D, DV, dtype, gate, beta_range, block):
    inputs = make(B, T, H, Hkv, D, DV, dtype, beta_range=beta_range, gate=gate)
    compare(inputs, tol=1e-5 if dtype == torch.float32 else 5e-3, block_size=block)


@pytest.mark.parametrize("B,T,H,Hkv,D,DV,dtype,gate,beta_range,block",
                         [CASES[i] for i in (0, 1, 3, 6, 7)])
def test_fused_ut_transform_matches_reference(B, T, H, Hkv, D, DV, dtype, gate, beta_range, block):
    """The whole kernel with the UT transform in Triton (``ut="triton"``) instead of PyTorch ops."""
    inputs = make(B, T, H, Hkv, D, DV, dtype, beta_range=beta_range, gate=gate)
    compare(inputs, tol=1e-5 if dtype == torch.float32 else 5e-3, block_size=block, ut="triton")


@pytest.mark.parametrize("ut", ["triton", "triton_saved"])
def test_fused_ut_transform_with_16_bit_w(ut):
    """w in fp16 (the language model passes w in its autocast dtype): the inverse kernel forms W Wᵀ in one pass
    on the 16-bit rows (``ut_common.gram_on_16_bit_rows``), β near 2."""
    inputs = make(1, 100, 2, 2, 32, 32, torch.float16, beta_range=(1.9, 2.0), w_dtype=torch.float16)
    compare(inputs, tol=5e-3, block_size=32, ut=ut)


V_LAYOUTS = {
    # rows evenly spaced but not contiguous: v as one slice of a fused projection [B, T, 2, Hkv, Dv]
    "fused-projection": lambda v: torch.stack([v, torch.randn_like(v)], dim=2)[:, :, 0],
    # rows not evenly spaced across the batch
    "time-slice": lambda v: torch.cat([v, torch.randn_like(v)], dim=1)[:, : v.shape[1]],
}


@pytest.mark.parametrize("v_rows", [True, False], ids=["v-in-place", "v-chunk-copy"])
@pytest.mark.parametrize("delta_pass", [False, True], ids=["delta-in-kernel", "delta-pass"])
@pytest.mark.parametrize("T,v_layout,packed", [(32, "fused-projection", None), (45, "time-slice", None),
                                               (48, "fused-projection", [16, 32])],
                         ids=["whole-chunks", "padded", "packed-whole-chunks"])
@pytest.mark.parametrize("ut", ["triton", "triton_saved"])
def test_fused_routes_keep_o_and_do_in_place(ut, T, v_layout, packed, delta_pass, v_rows):
    """On the fused routes the scan writes o and reads dO in ``[B, T, H, Dv]``: the chunk layout's rows looked
    up in the token index where the layout has padding, computed where it has none (every sequence a whole number
    of chunks, packed or not); v, not contiguous, read in v's layout too (``v_rows``, the default for short
    sequences at D <= 64) or copied into chunks, dv summed in chunks and copied back; δ formed in the kernel or
    before it."""
    config = KernelConfig(v_rows=v_rows, delta_pass=delta_pass)
    B = 1 if packed else 2
    q, k, v, w, beta, g = make(B, T, 4, 2, 32, 16, torch.float32, gate=True)
    v = V_LAYOUTS[v_layout](v)
    assert not v.is_contiguous()
    cu = None if packed is None else torch.tensor([0] + torch.tensor(packed).cumsum(0).tolist(), dtype=torch.int32)
    compare((q, k, v, w, beta, g), tol=1e-5, block_size=16, cu_seqlens=cu, ut=ut, config=config)


def test_v_rows_policy():
    """v read in its own layout at head dims up to 64 in sequences of fewer than 64 chunks, copied into chunks
    otherwise, unless a config pins it."""
    from pathlab.kernels.scan import v_in_token_rows

    assert v_in_token_rows(64, 64, 8) and v_in_token_rows(16, 32, 63)
    assert not v_in_token_rows(64, 64, 64)
    assert not v_in_token_rows(128, 128, 8) and not v_in_token_rows(64, 128, 8)
    assert v_in_token_rows(128, 128, 256, KernelConfig(v_rows=True))
    assert not v_in_token_rows(64, 64, 8, KernelConfig(v_rows=False))


def test_forward_states_rows_never_overlap():
    """The forward's carried states: chunk c of a sequence keeps c rows from ``state_base(first, c, max_chunks)``;
    over 200 random packings of sequences up to ``max_chunks`` (1 to 12) long the rows of different chunks never
    meet and stay below ``state_rows`` minus its spare row; with equal lengths every row is used."""
    import random

    from pathlab.kernels.layout import state_base, state_rows

    rng = random.Random(0)
    for trial in range(200):
        max_chunks = rng.randint(1, 12)
        lengths = [rng.randint(1, max_chunks) for _ in range(rng.randint(1, 8))]
        lengths[rng.randrange(len(lengths))] = max_chunks
        if trial % 4 == 0:
            lengths = [max_chunks] * len(lengths)
        used, first = [], 0
        for L in lengths:
            for c in range(L):
                used += range(state_base(first, c, max_chunks), state_base(first, c, max_chunks) + c)
            first += L
        assert len(used) == len(set(used)) == sum(L * (L - 1) // 2 for L in lengths), (max_chunks, lengths)
        assert all(0 <= r < state_rows(first, max_chunks) - 1 for r in used), (max_chunks, lengths)
        if len(set(lengths)) == 1:
            assert len(used) == state_rows(first, max_chunks) - 1, (max_chunks, lengths)


def test_forward_states_policy():
    """The forward keeps its carried states when no sequence spans more than 16 chunks, unless a config pins it."""
    from pathlab.kernels.scan import forward_states

    assert forward_states(1) and forward_states(16) and not forward_states(17)
    assert forward_states(1024, KernelConfig(forward_states=True))
    assert not forward_states(2, KernelConfig(forward_states=False))


@pytest.mark.parametrize("states", [True, False], ids=["forward-states", "replayed-states"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_saving_route_with_and_without_the_forward_states(states, dtype):
    """The saving route with the backward reading the forward's carried states or replaying them, on packed
    sequences of different lengths, the last a single chunk (its item reads the spare row), with the gate."""
    lengths = [50, 16, 97, 33, 9]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    inputs = make(1, sum(lengths), 4, 2, 16, 32, dtype, gate=True)
    compare(inputs, tol=1e-5 if dtype == torch.float32 else 5e-3, cu_seqlens=cu, programs=3, ut="triton_saved",
            config=KernelConfig(forward_states=states))


def test_backward_reads_the_forward_states():
    """The scan backward given the forward's states returns what it returns when it replays them, and it does
    read them: zeroed states change dq̃ and dk̃."""
    from pathlab.kernels.layout import build_layout, slot_tokens, state_rows, to_chunks
    from pathlab.kernels.scan import _scan_bwd_impl, _scan_fwd_impl
    from pathlab.kernels.ut_forward import ut_forward

    B, T, H, D, BT = 2, 75, 2, 16, 16
    q, k, v, w, beta, g = make(B, T, H, H, D, D, torch.float32, gate=False)
    layout = build_layout(B, T, BT, q.device)
    qs, ks, m, sd, _ = ut_forward(q, k, w, beta, slot_tokens(layout, B, T), BT, torch.float32)
    meta = (layout.chunk_first, layout.chunk_index, layout.order, layout.max_chunks)
    vc = to_chunks(v, layout).contiguous()
    states = torch.full((H, state_rows(layout.n_chunks, layout.max_chunks), BT, D), float("nan"))
    o, lse = _scan_fwd_impl(qs, ks, vc, m, sd, None, None, *meta, D ** -0.5, 3, states=states)
    do = torch.randn_like(o)
    replayed = _scan_bwd_impl(do, qs, ks, vc, m, sd, None, None, o, lse, *meta, D ** -0.5, 3)
    read = _scan_bwd_impl(do, qs, ks, vc, m, sd, None, None, o, lse, *meta, D ** -0.5, 3, states=states)
    for name, a, b in zip(["dq", "dk", "dv", "dM", "dS_d"], replayed, read):
        assert rel_rms(b, a) <= 1e-6, name
    zeroed = _scan_bwd_impl(do, qs, ks, vc, m, sd, None, None, o, lse, *meta, D ** -0.5, 3,
                            states=torch.zeros_like(states))
    assert rel_rms(zeroed[0], replayed[0]) > 1e-2 and rel_rms(zeroed[1], replayed[1]) > 1e-2
    with pytest.raises(ValueError, match="states must be"):
        _scan_bwd_impl(do, qs, ks, vc, m, sd, None, None, o, lse, *meta, D ** -0.5, 3, states=states[:, 1:])


def test_saving_route_without_gradients_keeps_nothing(monkeypatch):
    """Without a backward to come (no input needs a gradient, or grad mode off, as in evaluation) the saving route
    runs the recomputing route's forward: the same output, and no factors or carried states made. The recomputing
    route's forward keeps no states either; the saving route with gradients does."""
    from pathlab.kernels import fused

    forward_scan, calls = fused._scan_fwd_impl, []

    def watched(*args, **kwargs):  # which route, and whether the scan keeps its carried states
        calls.append(kwargs.get("states") is not None)
        return forward_scan(*args, **kwargs)

    monkeypatch.setattr(fused, "_scan_fwd_impl", watched)
    q, k, v, w, beta, g = make(1, 70, 2, 2, 16, 16, torch.float32, gate=True)
    want = path_attention_triton(q, k, v, w, beta, g, block_size=16, ut="triton")
    for grad_mode, needs_grad in [(False, True), (True, False)]:
        leaves = [t.detach().requires_grad_(needs_grad) for t in (q, k, v, w, beta, g)]
        with torch.set_grad_enabled(grad_mode):
            assert torch.equal(path_attention_triton(*leaves, block_size=16, ut="triton_saved"), want)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, w, beta, g)]
    path_attention_triton(*leaves, block_size=16, ut="triton")
    assert calls == [False] * 4
    path_attention_triton(*leaves, block_size=16, ut="triton_saved")
    assert calls[-1] is True


@pytest.mark.parametrize("ut", ["torch", "triton", "triton_saved"])
def test_backward_fills_no_zero_gradients_for_internal_outputs(ut):
    """The ops' internal outputs (the log-sum-exp; on the saving route the UT factors q̃, k̃, M, S_d, A) get no
    gradient: autograd must not fill a zero tensor for each of them in every backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from pathlab.kernels.layout import state_rows

    class ZeroFills(TorchDispatchMode):
        """Zero fills outside the ops (autograd's, for outputs without a gradient) and the ops called."""

        def __init__(self):
            super().__init__()
            self.shapes, self.ops = [], []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            self.ops.append(f"{func.namespace}::{name}")
            if name in ("zeros", "zeros_like", "new_zeros", "zero_") or (name == "fill_" and args[1] == 0):
                self.shapes.append(tuple(out.shape))
            return out

    B, T, H, Hkv, D, BT = 2, 40, 4, 2, 16, 16
    NC = B * -(-T // BT)
    q, k, v, w, beta, _ = make(B, T, H, Hkv, D, D, torch.float32, gate=False)
    leaves = [t.requires_grad_() for t in (q, k, v, w, beta)]
    o = path_attention_triton(*leaves, block_size=BT, programs=2, ut=ut)
    with ZeroFills() as fills:
        torch.autograd.grad(o, leaves, torch.randn_like(o))
    # lse, q̃, S_d, A, the carried states
    internal = {(H, NC, BT), (H, NC, BT, D), (H, NC, BT, BT), (Hkv, NC, BT, BT), (H, state_rows(NC, 3), BT, D)}
    assert any(op.startswith("pathlab::") and "bwd" in op for op in fills.ops), fills.ops  # the mode saw the backward
    assert not internal & set(fills.shapes), fills.shapes


@pytest.mark.parametrize("B,T,H,Hkv,D,DV,dtype,gate,beta_range,block", [CASES[i] for i in (1, 2, 7)])
def test_backward_without_prefetch(B, T, H, Hkv, D, DV, dtype, gate, beta_range, block):
    """The λ scan without loading the next carried state a pair ahead (``scan.prefetch``: on at D ≤ 64, off at
    D = 128, the route pinned here at small D), on gated and ungated inputs."""
    inputs = make(B, T, H, Hkv, D, DV, dtype, beta_range=beta_range, gate=gate)
    compare(inputs, tol=1e-5 if dtype == torch.float32 else 5e-3, block_size=block,
            config=KernelConfig(prefetch=False))


@pytest.mark.parametrize("T", [16, 17, 100], ids=["one-chunk", "two-chunks", "seven-chunks"])
def test_forward_gate_loaded_a_pair_ahead(T):
    """The forward loads each chunk pair's gate one pair ahead: it matches the fp64 reference from a single chunk
    (no pair) to several."""
    compare(make(2, T, 4, 2, 16, 16, torch.float32, gate=True), tol=1e-5, block_size=16)


@pytest.mark.parametrize("delta_pass", [False, True], ids=["delta-in-kernel", "delta-pass"])
@pytest.mark.parametrize("gate", [False, True], ids=["path", "path_fox"])
def test_delta_inside_or_before_the_backward_scan(delta_pass, gate):
    """δ = rowsum(dO ∘ o) computed by the backward scan from o, or before it by a Triton pass
    (``scan.delta_pass``), with and without the gate: both match the fp64 reference."""
    compare(make(2, 45, 4, 2, 32, 16, torch.float32, gate=gate), tol=1e-5, block_size=16,
            config=KernelConfig(delta_pass=delta_pass))


# Large |q|·|k| saturates the softmax: a row's weight sits on one key (at ×200 the others underflow to exactly 0),
# so the true dq, dk, dw, dβ, dg are ~0. With δ = dO · o summed in an order of its own, dS = P ∘ (dP − δ) kept the
# rounding difference of two equal sums, ε·|dP|, which dq then multiplied by |k|, dk by |q| and dw, dβ (through
# S_d and the UT backward) by |q|·|k|: at ×200 dβ came out at 0.9–1.2 (relative to the floor of ``rel_rms``), dw
# at 0.4, at ×50 dβ at 0.06–0.08. δ as the diagonal of the product that forms dP (``scan_backward_by_chunk``) leaves
# dS = 0 there: at ×200 every gradient but dv is then ~1e-100. What stays at ×50 is the rounding of logits of size
# |q|·|k|/√D ≈ 2500 in rows whose gap to their second key is a few tens of nats (their gradient ~e^{−gap} is
# exact only to that rounding): 0.8–1.9e-2 in dβ, as the blockwise PyTorch path in fp32 (0.3–0.8e-2); in fp16 the
# carried states' 11-bit significand makes that 9e-2 (before the fix 0.11), so fp16 runs at ×200 only. The saving
# route's backward by sequence has dv 2e-3 at ×200: it folds the query rows' gate into the log-sum-exp
# (|lse| ≈ 6e4 there, rounded to 2⁻⁸), so P of a saturated row is 1 only to that rounding.
LARGE_NORMS = [pytest.param(torch.float32, 50, 3e-2, id="fp32-x50"),
               pytest.param(torch.float32, 200, 5e-3, id="fp32-x200"),
               pytest.param(torch.float16, 200, 5e-3, id="fp16-x200")]


@pytest.mark.parametrize("dtype,norm,tol", LARGE_NORMS)
@pytest.mark.parametrize("delta_pass", [False, True], ids=["delta-in-kernel", "delta-pass"])
@pytest.mark.parametrize("ut", ["torch", "triton", "triton_saved"])
def test_large_query_and_key_norms(ut, delta_pass, dtype, norm, tol):
    """q and k scaled ×50 and ×200 (PaTH-FoX, grouped heads, B = 2 so that the saving route's backward runs by
    sequence), the output and every gradient against the fp64 reference by relative RMS error (``rel_rms``)."""
    q, k, v, w, beta, g = make(2, 40, 2, 1, 16, 16, dtype, gate=True)
    compare((q * norm, k * norm, v, w, beta, g), tol=tol, block_size=16, ut=ut,
            config=KernelConfig(delta_pass=delta_pass))


def test_fused_routes_meet_the_pytorch_route_at_large_norms():
    """fp16 q, k × 50 at D = 32 (PaTH-FoX, grouped heads, β ∈ [1.5, 2]; ``benchmarks/large_norm_errors.py``), o and
    every gradient against the fp64 reference as a fraction of max(the true value's RMS, its RMS at norm 1): the
    fused UT routes within twice the PyTorch UT route's error plus 0.002. Without the split products
    (``ut_split_logits=False``: 16-bit UT products in every chunk) the same inputs give dq, dk, dw about 3 and o
    6·10⁻², the defect this guards against, which the check below must see."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "large_norm_errors.py"
    spec = importlib.util.spec_from_file_location("large_norm_errors", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def errors(ut):
        row = script.measure(torch.float16, 50, ut, "cpu", shape=(2, 64, 2, 1, 32))["tensors"]
        return {n: t["error"] / max(t["unit"], t["true"]) for n, t in row.items()}

    want = errors("torch")
    for ut in ("triton", "triton_saved"):
        got = errors(ut)
        assert all(got[n] <= 2 * want[n] + 2e-3 for n in got), (ut, got, want)
    unsplit = errors("triton_16bit")
    assert not all(unsplit[n] <= 2 * want[n] + 2e-3 for n in unsplit), unsplit


def test_delta_policy():
    """δ by a pass before the scan with the gate on sequences of 64 chunks or more, else in the scan, unless a
    config pins it."""
    from pathlab.kernels.scan import delta_pass

    assert not delta_pass(False, 256) and not delta_pass(True, 63) and delta_pass(True, 64)
    assert delta_pass(False, 1, KernelConfig(delta_pass=True))
    assert not delta_pass(True, 256, KernelConfig(delta_pass=False))


def test_delta_pass_matches_its_definition():
    """The Triton δ pass against rowsum(dO ∘ o) in fp64, on o in token rows ``[B, T, H, Dv]`` whose sequences end
    inside a chunk (padded slots: masked rows) and fp16 inputs (summed in fp32)."""
    from pathlab.kernels.layout import build_layout, slot_tokens
    from pathlab.kernels.scan import _delta

    B, T, H, DV, BT = 3, 37, 5, 32, 16
    do, o = torch.randn(B, T, H, DV).half(), torch.randn(B, T, H, DV).half()
    tok = slot_tokens(build_layout(B, T, BT, "cpu"), B, T)
    want = (do.double() * o.double()).sum(-1)
    got = _delta(do, o, tok, B * T, (H * DV, DV), H, tok.numel() // BT, BT, "tf32")
    assert got.shape == want.shape and got.dtype == torch.float32
    assert rel_rms(got, want) < 1e-6


@pytest.mark.parametrize("B,T,H,Hkv,D,DV,dtype,gate,beta_range,block", [CASES[i] for i in (1, 3)])
def test_recomputing_backward_in_head_groups(monkeypatch, B, T, H, Hkv, D, DV, dtype, gate, beta_range, block):
    """The recomputing backward one kv head (and its query heads) at a time, as it runs for long sequences
    (``fused.head_groups``), forced here at short ones: each group's gradients land in their heads."""
    from pathlab.kernels import fused

    monkeypatch.setattr(fused, "GROUPS_FROM_CHUNKS", 1)
    monkeypatch.setattr(fused, "group_budget_bytes", lambda: 1)  # every kv head its own group
    calls = []
    whole = fused._bwd_heads
    monkeypatch.setattr(fused, "_bwd_heads", lambda *a: calls.append(a[2].shape[2]) or whole(*a))
    inputs = make(B, T, H, Hkv, D, DV, dtype, beta_range=beta_range, gate=gate)
    compare(inputs, tol=1e-5, block_size=block, ut="triton")
    assert calls == [1] * Hkv
    calls.clear()
    lengths = [1, 15, 60, 16]  # packed sequences, grouped query heads, gate, fp16
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    compare(make(1, sum(lengths), 4, 2, 16, 32, torch.float16, gate=True), tol=5e-3, cu_seqlens=cu, programs=2,
            ut="triton")
    assert calls == [1, 1]


def test_head_groups_policy():
    """All heads at once for short sequences, under the budget or with the budget 0; otherwise as many heads per
    group as the budget holds, in contiguous near-equal groups; a bad budget is a clear error."""
    from pathlab.kernels.fused import GROUPS_FROM_CHUNKS, backward_bytes_per_kv_head, group_budget_bytes, head_groups

    mib = 2**20
    long = GROUPS_FROM_CHUNKS
    # T = 16384, B = 2 (512 chunks of 64), one query head per kv head, D = Dv = 128, fp16 scan and bf16 v
    assert backward_bytes_per_kv_head(512, 64, 1, 128, 128, 2, 2) == 136 * mib
    assert head_groups(16, 136 * mib, long - 1, 256 * mib) == [slice(0, 16)]
    assert head_groups(16, 136 * mib, long, 0) == [slice(0, 16)]
    assert head_groups(4, 64 * mib, long, 256 * mib) == [slice(0, 4)]
    assert head_groups(16, 136 * mib, long, 256 * mib) == [slice(h, h + 1) for h in range(16)]
    groups = head_groups(16, 136 * mib, long, 512 * mib)  # three heads fit
    assert len(groups) == 6 and groups[0].start == 0 and groups[-1].stop == 16
    assert all(a.stop == b.start for a, b in zip(groups, groups[1:]))
    assert max(g.stop - g.start for g in groups) == 3
    assert head_groups(2, 10 * mib, long, 1) == [slice(0, 1), slice(1, 2)]
    assert group_budget_bytes() == 256 * mib
    assert group_budget_bytes(KernelConfig(group_mib=0)) == 0
    with pytest.raises(ValueError, match="group_mib"):
        KernelConfig(group_mib=-1)


def test_kernel_config():
    """A config pins a route or overrides a leading part of a launch; bad values are clear errors; equal configs
    share one id (the int the custom ops take), the default's is 0."""
    from pathlab.kernels.config import DEFAULT, config_id, config_of, launch, pick

    assert pick(None, True) and not pick(False, True) and pick(True, False)
    assert launch(None, (4, 1, 2, 0)) == (4, 1, 2, 0) and launch((8,), (4, 1, 2, 0)) == (8, 1, 2, 0)
    assert config_id(None) == config_id(DEFAULT) == 0
    a, b = KernelConfig(bwd_launch=(4, 2)), KernelConfig(bwd_launch=(4, 2))
    assert config_id(a) == config_id(b) != 0 and config_of(config_id(a)) == a
    for bad in (dict(bwd_launch=[4, 2]), dict(by_sequence_launch=(3,)), dict(ut_warps=3)):
        with pytest.raises(ValueError):
            KernelConfig(**bad)
    with pytest.raises(ValueError, match="config must be a KernelConfig"):
        config_id("fast")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_varlen_packed_sequences(dtype):
    lengths = [1, 15, 60, 16]  # a single token, one short of a chunk, a long one, exactly one chunk
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    inputs = make(1, sum(lengths), 4, 2, 16, 32, dtype, gate=True)
    compare(inputs, tol=1e-5 if dtype == torch.float32 else 5e-3, cu_seqlens=cu, programs=2)
    compare(inputs, tol=1e-5 if dtype == torch.float32 else 5e-3, cu_seqlens=cu, programs=2, ut="triton")


@pytest.mark.parametrize("ut", ["torch", "triton"])
def test_non_contiguous_inputs(ut):
    B, T, H, D = 1, 40, 2, 16
    q = torch.randn(B, H, T, D).transpose(1, 2)  # [B, T, H, D] view with odd strides
    k = torch.randn(B, T, H, 2 * D)[..., ::2]
    v = torch.randn(B, T, D, H).transpose(2, 3)
    w = torch.randn(B, H, T, D).transpose(1, 2)
    beta = 2 * torch.rand(B, H, T).transpose(1, 2)
    g = torch.nn.functional.logsigmoid(torch.randn(B, H, T)).transpose(1, 2)
    assert not any(t.is_contiguous() for t in (q, k, v, w, beta, g))
    compare((q, k, v, w, beta, g), tol=1e-5, ut=ut)


def test_gate_is_not_scaled():
    """A gate that is huge for far keys must act as −∞ whatever the scale (FoX's convention)."""
    B, T, H, D = 1, 40, 1, 16
    q, k, v, w, beta, _ = make(B, T, H, H, D, D, torch.float32, gate=False)
    g = torch.zeros(B, T, H)
    g[:, 20] = -1e4  # keys before 20 are invisible to queries from 20 on
    o = path_attention_triton(q, k, v, w, beta, g, scale=1e-3, block_size=16)
    o_ref = reference(q[:, 20:], k[:, 20:], v[:, 20:], w[:, 20:], beta[:, 20:], None, scale=1e-3)
    assert rel_rms(o[:, 20:], o_ref) < 1e-5


def test_dispatcher_uses_the_kernel():
    import pathlab

    q, k, v, w, beta, g = make(1, 30, 2, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="CUDA"):
        pathlab.path_attention(q, k, v, w, beta, g, backend="triton")  # CPU tensors to the CUDA backend
    o = path_attention_triton(q, k, v, w, beta, g, block_size=16)
    o_ref = pathlab.path_attention(q, k, v, w, beta, g, backend="reference")
    assert rel_rms(o, o_ref) < 1e-5


def test_bad_inputs_raise_clear_errors(monkeypatch):
    q, k, v, w, beta, g = make(1, 8, 2, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="head dim D"):
        path_attention_triton(*make(1, 8, 2, 2, 48, 16, torch.float32)[:5])
    with pytest.raises(ValueError, match="Dv"):
        path_attention_triton(*make(1, 8, 2, 2, 16, 24, torch.float32)[:5])
    with pytest.raises(ValueError, match="is on meta"):
        path_attention_triton(q, k.to("meta"), v, w, beta)
    with pytest.raises(ValueError, match="multiple"):
        path_attention_triton(*make(1, 8, 3, 2, 16, 16, torch.float32)[:5])
    with pytest.raises(ValueError, match="beta"):
        path_attention_triton(q, k, v, w, beta[..., :1])
    with pytest.raises(ValueError, match="g must be"):
        path_attention_triton(q, k, v, w, beta, g[..., :1])
    with pytest.raises(ValueError, match="B == 1"):
        path_attention_triton(*make(2, 8, 2, 2, 16, 16, torch.float32)[:5],
                              cu_seqlens=torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="block_size"):
        path_attention_triton(q, k, v, w, beta, block_size=24)
    for bad in ([0, 5], [1, 8], [0, 6, 3, 8]):  # ends before T, starts after 0, decreases
        with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
            path_attention_triton(q, k, v, w, beta, cu_seqlens=torch.tensor(bad, dtype=torch.int32))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        path_attention_triton(q, k, v, w, beta)


def test_auto_backend_falls_back_with_one_warning(monkeypatch):
    """On CUDA without a usable kernel, ``backend="auto"`` picks the blockwise path and warns once."""
    import warnings

    import pathlab.ops.path as dispatch

    monkeypatch.setattr(dispatch, "_triton_kernel", lambda: ImportError("no triton here"))
    monkeypatch.setattr(dispatch, "_warned_fallback", False)
    cuda = torch.device("cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert dispatch.resolve_backend("auto", cuda) == "torch"
        assert dispatch.resolve_backend("auto", cuda) == "torch"
    assert len([w for w in caught if "blockwise" in str(w.message)]) == 1
    monkeypatch.setattr(dispatch, "_triton_kernel", lambda: path_attention_triton)
    assert dispatch.resolve_backend("auto", cuda) == "triton"
    assert dispatch.resolve_backend("auto", torch.device("cpu")) == "torch"  # never a T×T path


def test_missing_kernel_package_says_to_install_the_project():
    """A checkout used through PYTHONPATH alone has no ``pathlab.kernels`` (the install maps ``kernels/`` to it):
    the error says so; other import errors pass through unchanged."""
    import pathlab.ops.path as dispatch

    missing = ModuleNotFoundError("No module named 'pathlab.kernels'", name="pathlab.kernels")
    assert "pip install -e ." in str(dispatch._explained(missing))
    other = ModuleNotFoundError("No module named 'triton'", name="triton")
    assert dispatch._explained(other) is other


def test_gate_offsets_keep_precision_over_long_sequences():
    """G_i − G_j from (fp64 chunk offset + fp32 local cumsum) matches an fp64 cumsum at 100K tokens."""
    from pathlab.kernels.layout import build_layout, chunk_gate, to_chunks

    T, BT = 100_003, 64
    g = torch.nn.functional.logsigmoid(3 + torch.randn(1, T, 1, dtype=torch.float64))
    layout = build_layout(1, T, BT, "cpu")
    local, offset = chunk_gate(to_chunks(g.float(), layout), layout)
    G = (offset[..., None] + local.double()).reshape(-1)[:T]
    exact = torch.cumsum(g[0, :, 0], 0)
    i, j = torch.randint(0, T, (2, 1000))
    err = ((G[i] - G[j]) - (exact[i] - exact[j])).abs().max()
    assert err < 1e-5, err  # a plain fp32 cumsum is off by ~4e-4 here (|G| reaches 7.5e3)
