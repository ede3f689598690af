"""RoPE's cached cos/sin table and the rotation variants under torch.compile.

* the table equals the per-element formula (cos/sin of the fp64 phase reduced mod 2π, in fp32) at every length,
  out to 65K positions, and serves decoding offsets and fp64 models;
* a compiled block equals the eager one (outputs and gradients) and has no graph break; RoPE's compiled graph
  takes the table as an input, so no per-element kernel recomputes pow, remainder, cos or sin;
* the rotation variants run one compiled graph for every layer (the layer's salt is a tensor, not a constant
  that would make ``block.compile()`` recompile per layer and run the layers past the recompile limit eagerly),
  with the random tables unchanged.
"""

import math
import re

import pytest
import torch
import torch._dynamo
from torch._dynamo.backends.common import aot_autograd

import pathlab
from pathlab.attention.rotation import hashed_uniform
from pathlab.ops import positions
from pathlab.ops.positions import rope_cos_sin, rope_phases, rotate
from pathlab.ops.softmax import _sdpa
from pathlab.testing import rel_err

TRIG = ("cos", "sin", "pow", "remainder")


def _formula(start, length, head_dim, base):
    """The per-element path: cos/sin in fp32 of the fp64 phase t·ω reduced mod 2π."""
    phase = rope_phases(start + length, head_dim, base)[start:].float()
    return torch.cos(phase), torch.sin(phase)


@pytest.mark.parametrize("T", [1, 100, 5000])
def test_table_equals_the_per_element_formula(T):
    cos, sin = rope_cos_sin(T, 64, 10000.0)
    want_cos, want_sin = _formula(0, T, 64, 10000.0)
    assert cos.shape == sin.shape == (T, 32) and cos.dtype == torch.float32
    assert (cos - want_cos).abs().max() < 1e-6 and (sin - want_sin).abs().max() < 1e-6


def test_table_keeps_its_precision_near_65k_positions():
    start, length = 65536 - 40, 80  # across 65536
    cos, sin = rope_cos_sin(length, 64, 10000.0, start=start)
    want_cos, want_sin = _formula(start, length, 64, 10000.0)
    assert (cos - want_cos).abs().max() < 1e-6 and (sin - want_sin).abs().max() < 1e-6
    # against cos/sin of the unreduced phase t·ω in fp64
    t = torch.arange(start, start + length, dtype=torch.float64)[:, None]
    angle = t * positions.rope_frequencies(64, 10000.0)[None, :]
    assert (cos.double() - torch.cos(angle)).abs().max() < 1e-6
    assert (sin.double() - torch.sin(angle)).abs().max() < 1e-6


def test_table_rows_do_not_depend_on_how_far_it_has_grown():
    base = 777.0  # a key no other test uses: the table starts empty

    def rows():
        return positions._rope_table_rows(16, base.as_integer_ratio(), torch.device("cpu"), torch.float32)

    assert rows() == 0
    short = [t.clone() for t in rope_cos_sin(10, 16, base)]
    assert rows() == positions.ROPE_TABLE_ROWS
    far = rope_cos_sin(3 * positions.ROPE_TABLE_ROWS + 5, 16, base)
    assert rows() == 4 * positions.ROPE_TABLE_ROWS
    assert torch.equal(far[0][:10], short[0]) and torch.equal(far[1][:10], short[1])
    step_cos, step_sin = rope_cos_sin(1, 16, base, start=2500)
    assert torch.equal(step_cos[0], far[0][2500]) and torch.equal(step_sin[0], far[1][2500])


def test_fp64_table_is_exactly_cos_sin_of_the_fp64_phases():
    cos, sin = rope_cos_sin(300, 16, 500.0, dtype=torch.float64)
    phase = rope_phases(300, 16, 500.0)
    assert torch.equal(cos, torch.cos(phase)) and torch.equal(sin, torch.sin(phase))


def test_table_built_under_inference_mode_serves_training():
    with torch.inference_mode():
        rope_cos_sin(8, 8, 4321.0)
    q = torch.randn(1, 8, 2, 8, requires_grad=True)
    pathlab.rope_attention(q, q, q, base=4321.0).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("T", [1, 100, 5000])
def test_rope_attention_equals_the_per_element_path(T):
    gen = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(1, T, 2, 16, generator=gen) for _ in range(3))
    phase = rope_phases(T, 16)[None, :, None, :]
    old = _sdpa(rotate(q, -phase), rotate(k, -phase), v, 16 ** -0.5)
    assert rel_err(pathlab.rope_attention(q, k, v), old) < 1e-5


def test_rope_attention_takes_a_precomputed_table():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 20, 2, 8, generator=gen) for _ in range(3))
    cos, sin = _formula(0, 32, 8, 10000.0)  # longer than T: rows 0 … T − 1 are used
    assert torch.allclose(pathlab.rope_attention(q, k, v, table=(cos, sin)), pathlab.rope_attention(q, k, v),
                          atol=1e-6)
    with pytest.raises(ValueError, match="table cos must have shape"):
        pathlab.rope_attention(q, k, v, table=(cos[:10], sin[:10]))
    with pytest.raises(ValueError, match="pair"):
        pathlab.rope_attention(q, k, v, table=cos)


def test_rotation_attention_equals_the_per_element_path():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 50, 2, 8, generator=gen) for _ in range(3))
    theta = torch.rand(2, 50, 2, 4, generator=gen) * 2
    phase = positions.accumulate_phases(theta, dim=1)
    qr, kr, vr = rotate(q, -phase), rotate(k, -phase), rotate(v, -phase)
    assert torch.equal(pathlab.rotation_attention(q, k, v, theta), _sdpa(qr, kr, v, 8 ** -0.5))
    assert torch.equal(pathlab.rotation_attention(q, k, v, theta, rotate_values=True),
                       rotate(_sdpa(qr, kr, vr, 8 ** -0.5), phase))


def test_random_tables_are_unchanged():
    """The hash (seed, layer, token, head, block) -> ξ is what it was when the layer salt was a Python number."""
    u = hashed_uniform(torch.tensor([[0, 1, 50303]]), 2, 3, salt=7 * 1_000_003 + 5)
    want = [[0.6044368573930115, 0.9413237918633968, 0.6963123010937124],
            [0.3062221927102655, 0.20130865508690476, 0.5994043326936662],
            [0.12342935660853982, 0.031111148418858647, 0.8289466670248657]]
    assert u[0, :, 1, :].tolist() == want
    model = pathlab.build_model(pathlab.ModelConfig(n_layer=3, n_head=2, n_embd=32, vocab_size=64,
                                                    attention="rot_random_qk", attention_kwargs={"seed": 3}))
    theta = model.blocks[2].attn.positional.angles(torch.zeros(1, 4, 32), torch.tensor([[5, 9, 63, 0]]))
    assert torch.allclose(theta[0, :, 1, :2], torch.tensor([[0.37611180543899536, 0.4444710612297058],
                                                            [1.7509162425994873, 0.2565200626850128],
                                                            [0.7028612494468689, 0.6322694420814514],
                                                            [0.29589900374412537, 0.18130509555339813]]),
                          rtol=0, atol=1e-7)


# ----------------------------------------------------------------------------- torch.compile


def _model(attention, n_layer=2):
    torch.manual_seed(0)
    model = pathlab.build_model(pathlab.ModelConfig(n_layer=n_layer, n_head=2, n_embd=32, vocab_size=64,
                                                    attention=attention))
    if attention.startswith("rot_learned"):  # leave RoPE: make the angles depend on the tokens
        for block in model.blocks:
            torch.nn.init.normal_(block.attn.positional.angle_proj.weight, std=0.5)
    return model


def _block_inputs(model, T=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 64, (2, T), generator=gen)
    return model.wte(idx).detach(), idx


def _grads(block, x, idx, fn):
    block.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y = fn(x, idx)
    (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in block.parameters() if p.grad is not None]


@pytest.mark.parametrize("attention", ["rope", "rot_random_qk", "rot_random_qkv", "rot_learned_qk", "rot_learned_qkv"])
def test_compiled_block_has_no_graph_break(attention):
    model = _model(attention)
    x, idx = _block_inputs(model)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model.blocks[1])(x, idx)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


@pytest.mark.parametrize("attention", ["rope", "rot_random_qk", "rot_learned_qkv"])
def test_one_compiled_graph_serves_every_layer(attention):
    """``block.compile()`` of every block: a layer-specific constant in the graph would recompile per layer."""
    model = _model(attention, n_layer=4)
    torch._dynamo.reset()
    for block in model.blocks:
        block.compile(backend="eager", fullgraph=True)
    idx = torch.randint(0, 64, (2, 16))
    with torch._dynamo.config.patch(error_on_recompile=True):
        model(idx, idx)[1].backward()


@pytest.mark.parametrize("attention, backend", [("rope", "aot_eager"), ("rope", "inductor"),
                                                ("rot_random_qk", "aot_eager"), ("rot_random_qk", "inductor"),
                                                ("rot_learned_qkv", "aot_eager")])
def test_compiled_block_equals_eager(attention, backend):
    model = _model(attention)
    block = model.blocks[1]
    x, idx = _block_inputs(model)
    eager = _grads(block, x, idx, block)
    torch._dynamo.reset()
    compiled = _grads(block, x, idx, torch.compile(block, backend=backend, fullgraph=True))
    assert len(compiled) == len(eager)
    for got, want in zip(compiled, eager):
        assert rel_err(got, want) < 1e-5


def _captured_graphs(module, *args):
    """The forward and backward ATen graphs of ``module(*args).sum()`` under torch.compile."""
    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    compiled = torch.compile(module, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)
    compiled(*args).sum().backward()
    assert len(graphs) == 2
    return graphs


def _targets(graphs):
    return {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}


def test_compiled_rope_takes_the_table_as_an_input():
    """Neither the forward nor the backward graph computes RoPE's phases (no pow, remainder, cos or sin)."""
    model = _model("rope")
    block = model.blocks[0]
    x, idx = _block_inputs(model)
    graphs = _captured_graphs(block, x.requires_grad_(), idx)
    targets = _targets(graphs)
    assert any("scaled_dot_product" in t for t in targets)
    assert not [t for t in targets if any(name in t for name in TRIG)], sorted(targets)


def test_inductor_rope_kernels_do_not_recompute_the_phases():
    from torch._inductor.utils import run_and_get_code

    model = _model("rope")
    block = model.blocks[0]
    x, idx = _block_inputs(model)
    x.requires_grad_()
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    _, codes = run_and_get_code(lambda: compiled(x, idx).sum().backward())
    assert len(codes) == 2  # forward and backward
    for code in codes:
        assert not re.search(r"\b(cos|sin|pow|remainder|fmod)\b", code)


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic"])
def test_rope_under_dynamic_shapes(dynamic):
    """A symbolic length slices the table (one past its end is specialised): still RoPE."""
    torch._dynamo.reset()
    fn = torch.compile(pathlab.rope_attention, backend="aot_eager", dynamic=dynamic, fullgraph=True)
    for T in (5, 9, 13, positions.ROPE_TABLE_ROWS + 3):
        q, k, v = (torch.randn(1, T, 2, 8) for _ in range(3))
        assert rel_err(fn(q, k, v, base=2345.0), pathlab.rope_attention(q, k, v, base=2345.0)) < 1e-5


def test_whole_model_compile_equals_eager():
    for attention in ("rope", "rot_random_qk"):
        model = _model(attention)
        idx = torch.randint(0, 64, (2, 16))
        want = model(idx, idx)[1].item()
        torch._dynamo.reset()
        got = torch.compile(model, backend="aot_eager", fullgraph=True)(idx, idx)[1].item()
        assert math.isclose(got, want, rel_tol=1e-6)


def test_importing_pathlab_leaves_triton_unimported():
    """triton reads TRITON_INTERPRET when first imported: `import pathlab` must not import it (nor torch._dynamo,
    which imports it), or setting the variable afterwards would no longer put the kernels in interpreter mode."""
    import subprocess
    import sys

    code = ("import sys, pathlab, pathlab.ops.softmax, pathlab.model; "
            "print('triton' in sys.modules, 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_constant_marker_is_the_one_dynamo_reads():
    marked = torch._dynamo.assume_constant_result(lambda: 0)
    assert positions._constant_under_compile(lambda: 0).__dict__ == marked.__dict__ == {"_dynamo_marked_constant": True}
