"""PaTH under ``torch.compile`` on the CPU: the Triton scan (under the interpreter) and the blockwise model path.

The Triton forward and backward scans are the custom ops ``pathlab::path_scan_fwd`` / ``path_scan_bwd``
(``kernels/path.py``), so Dynamo must see them as single opaque calls: no graph break (``fullgraph=True``) and no
tracing into the Triton kernels (which is what made Inductor try, and on torch 2.11 / triton 3.6 fail, to
precompile ``_path_fwd_kernel``). The kernel tests compile with Inductor (this machine has a C compiler); the
model tests use ``backend="aot_eager"`` (Dynamo + AOT autograd, the same graphs without Inductor's C++
code generation, which takes minutes on a shared 2-core CPU). On the CPU ``backend="auto"`` gives the model the
blockwise PyTorch path; the compiled model with the Triton kernel runs on the GPU (see docs/kernels.md).
"""

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of the kernels

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter tests run on CPU-only machines; the GPU runs test_kernels_gpu.py"
)

import pathlab  # noqa: E402
from pathlab.kernels import path_attention_triton  # noqa: E402
from pathlab.testing import random_path_inputs  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def make(B, T, H, Hkv, D, DV, *, gate, seed=0):
    return random_path_inputs(B, T, H, D, Hkv=Hkv, Dv=DV, gate=gate, generator=torch.Generator().manual_seed(seed))


def outputs_and_grads(fn, inputs, seed=1):
    """fn's output and the gradients of a random projection of it with respect to every tensor input."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in inputs]
    o = fn(*leaves)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed), dtype=o.dtype)
    wanted = [t for t in leaves if t is not None]
    return [o.detach()] + list(torch.autograd.grad(o, wanted, do))


def assert_same(got, want, names, tol=1e-5):
    for n, a, b in zip(names, got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{n}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
        err = float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-6))
        assert err <= tol, f"{n}: compiled differs from eager by {err:.2e} (relative max error, tol {tol})"


NAMES = ["o", "dq", "dk", "dv", "dw", "dbeta", "dg"]


@pytest.mark.parametrize("gate", [False, True], ids=["nogate", "gate"])
@pytest.mark.parametrize("ut", ["torch", "triton", "triton_saved"])
def test_compiled_kernel_matches_eager_inductor_fullgraph(gate, ut):
    """fp32, T = 37 with BT = 16 (a partial last chunk), grouped heads 4:2, Dv ≠ D: Inductor, one graph; the UT
    transform in PyTorch (traced and fused by Inductor) or fused in Triton (one more opaque op)."""
    inputs = make(2, 37, 4, 2, 16, 32, gate=gate)

    def fn(q, k, v, w, beta, g):
        return path_attention_triton(q, k, v, w, beta, g, block_size=16, programs=3, ut=ut)

    want = outputs_and_grads(fn, inputs)
    got = outputs_and_grads(torch.compile(fn, backend="inductor", fullgraph=True), inputs)
    assert_same(got, want, NAMES)


@pytest.mark.parametrize("ut", ["torch", "triton", "triton_saved"])
def test_compiled_kernel_dynamic_lengths(ut):
    """``dynamic=True``: one graph with a symbolic length serves T = 21 and 50 (layout built from the shapes)."""

    def fn(q, k, v, w, beta, g):
        return path_attention_triton(q, k, v, w, beta, g, block_size=16, programs=2, ut=ut)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    for T in (21, 50):
        inputs = make(1, T, 2, 1, 16, 16, gate=True, seed=T)
        assert_same(outputs_and_grads(compiled, inputs), outputs_and_grads(fn, inputs), NAMES)


def test_compiled_kernel_varlen():
    """Packed sequences: the layout needs the boundaries on the host, so it is built eagerly (a graph break);
    the result equals eager."""
    cu = torch.tensor([0, 7, 30, 45], dtype=torch.int32)
    inputs = make(1, 45, 2, 2, 16, 16, gate=True)

    def fn(q, k, v, w, beta, g):
        return path_attention_triton(q, k, v, w, beta, g, cu_seqlens=cu, block_size=16, programs=2)

    assert_same(outputs_and_grads(torch.compile(fn, backend="aot_eager"), inputs), outputs_and_grads(fn, inputs),
                 NAMES)


def assert_opcheck(fwd, bwd, differentiable, rest, bwd_args):
    """``torch.library.opcheck`` of a forward op (schema, fake shapes, autograd registration, AOT dispatch) on
    ``differentiable + rest``, and of its backward op (schema, fake shapes) on ``bwd_args(forward outputs)``."""
    report = torch.library.opcheck(fwd, [t.clone().requires_grad_() for t in differentiable] + rest)
    assert set(report.values()) == {"SUCCESS"}, report
    report = torch.library.opcheck(bwd, bwd_args(fwd(*differentiable, *rest)),
                                   test_utils=("test_schema", "test_faketensor"))
    assert set(report.values()) == {"SUCCESS"}, report


def test_scan_custom_ops_opcheck():
    from pathlab.kernels.layout import build_layout, chunk_gate, to_chunks
    from pathlab.kernels.ut_torch import ut_factors

    B, T, H, D = 1, 20, 2, 16
    q, k, v, w, beta, g = make(B, T, H, H, D, D, gate=True)
    layout = build_layout(B, T, 16, q.device)
    wn = torch.nn.functional.normalize(w, dim=-1)
    qs, ks, m, sd = ut_factors(to_chunks(q, layout), to_chunks(k, layout), to_chunks(wn, layout),
                               to_chunks(beta, layout))
    gl, go = chunk_gate(to_chunks(g, layout), layout)
    tensors = [t.detach() for t in (qs, ks, to_chunks(v, layout), m, sd, gl, go)]
    rest = [layout.chunk_first, layout.chunk_index, layout.order, layout.max_chunks, 0.25, 2, 0]  # config 0
    assert_opcheck(torch.ops.pathlab.path_scan_fwd.default, torch.ops.pathlab.path_scan_bwd.default, tensors, rest,
                   lambda out: [torch.randn_like(out[0])] + tensors + list(out) + rest)


def test_ut_custom_ops_opcheck():
    """The fused UT transform's ops."""
    from pathlab.kernels.layout import build_layout, slot_tokens

    importlib.import_module("pathlab.kernels.ut_backward")  # registers the ops
    B, T, H, Hkv, D = 1, 20, 2, 1, 16
    q, k, v, w, beta, _ = make(B, T, H, Hkv, D, D, gate=False, seed=3)
    rest = [slot_tokens(build_layout(B, T, 16, q.device), B, T), 16]
    assert_opcheck(torch.ops.pathlab.path_ut_fwd.default, torch.ops.pathlab.path_ut_bwd.default, [q, k, w, beta],
                   rest, lambda out: [torch.randn_like(t) for t in out] + [q, k, w, beta] + rest)


@pytest.mark.parametrize("route", ["recompute", "saved"])
def test_fused_route_custom_ops_opcheck(route):
    """The op that joins the fused UT transform and the scan, recomputing the factors in its backward
    (``ut="triton"``) or keeping them for it (``ut="triton_saved"``)."""
    from pathlab.kernels.layout import build_layout, chunk_gate, slot_tokens, to_chunks

    importlib.import_module("pathlab.kernels.fused")  # registers the ops
    B, T, H, Hkv, D = 1, 20, 2, 1, 16
    q, k, v, w, beta, g = make(B, T, H, Hkv, D, D, gate=True, seed=4)
    layout = build_layout(B, T, 16, q.device)
    gl, go = chunk_gate(to_chunks(g, layout), layout)
    inputs = [q, k, w, beta, v, gl.detach(), go.detach()]
    rest = [slot_tokens(layout, B, T), layout.chunk_first, layout.chunk_index, layout.order, layout.max_chunks,
            16, 0.25, 2, 0]  # block, scale, programs, config
    ops = torch.ops.pathlab
    fwd, bwd = getattr(ops, f"path_{route}_fwd").default, getattr(ops, f"path_{route}_bwd").default
    # the backward takes dO, the inputs, every output of the forward (o, lse and any kept factors), the rest
    assert_opcheck(fwd, bwd, inputs, rest, lambda out: [torch.randn_like(out[0])] + inputs + list(out) + rest)


@pytest.mark.parametrize("attention", ["path", "path_fox"])
def test_compiled_model_matches_eager(attention):
    """A small PaTH model compiled whole (``fullgraph=True``) gives eager's loss and every parameter gradient.
    On the CPU ``backend="auto"`` is the blockwise PyTorch path (activation checkpointing per query chunk)."""
    torch.manual_seed(0)
    cfg = pathlab.ModelConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=61, attention=attention,
                              attention_kwargs={"chunk_size": 8})
    model = pathlab.build_model(cfg)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 61, (2, 21), generator=gen)
    targets = torch.randint(0, 61, (2, 21), generator=gen)

    def run(net):
        model.zero_grad(set_to_none=True)
        _, loss = net(idx, targets)
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    want = run(model)
    got = run(torch.compile(model, backend="aot_eager", fullgraph=True))
    names = ["loss"] + [n for n, _ in model.named_parameters()]
    assert_same(got, want, names, tol=1e-5)
