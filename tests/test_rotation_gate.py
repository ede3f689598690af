"""Accumulated rotations with FoX's forget gate (``rot_random_qk_fox``, ``forget_gate=True``; SPEC M8 (b)):

    s_ij = q_iᵀ R(Φ_i − Φ_j) k_j / √D + Σ_{l=j+1}^{i} log f_l,   f_l = σ(u_fᵀ x_l + b_f) per head.

* the fast op (pre-rotation, then FoX's path) against the fp64 reference: output and every gradient, awkward
  lengths, grouped kv heads, Q/K and Q/K/V; the layer's output and the gradients of its gate parameters;
* identities: g = 0 is the plain rotation, θ = 0 is FoX, constant θ = ω with g = 0 is RoPE, f → 0 leaves each
  token attending to itself only, and a gate bias at +large is the ungated layer;
* the model: registered, trains, fast equals reference, cached generation equals the full forward, compiles,
  builds at the paper shape with FoX's parameter count;
* on CUDA (``-m gpu``): FlexAttention's path against the reference in fp32 and bf16.
"""

import argparse

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

import pathlab
import pathlab.ops.softmax as softmax_ops
from pathlab import ModelConfig, build_model, reference
from pathlab.attention.rotation import RotationAttention
from pathlab.ops.positions import rope_frequencies
from pathlab.ops.softmax import rotation_attention, rotation_fox_attention
from pathlab.reference.softmax import rotation_fox_attention as ref_rotation_fox
from pathlab.testing import (assert_cached_generation_matches, assert_matches_reference, grad_err, rel_err,
                             train_on_repeated_pattern)

VOCAB = 61
NAME = "rot_random_qk_fox"


def _inputs(B, T, H, Hkv, D, dtype, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)

    def make(t):
        return t.to(device=device, dtype=dtype).requires_grad_()

    q, k, v = (torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in
               ((B, T, H, D), (B, T, Hkv, D), (B, T, Hkv, D)))
    theta = torch.rand(B, T, H, D // 2, generator=gen, dtype=torch.float64) * 2
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen, dtype=torch.float64) + 2)
    # angles and gates in fp32 at least, as the layer makes them (an fp64 gate would make FlexAttention's scores fp64)
    side = torch.promote_types(dtype, torch.float32)
    return [make(q), make(k), make(v), theta.to(device, side).requires_grad_(), g.to(device, side).requires_grad_()]


SHAPES = [(2, 1, 2, 2, 8), (1, 77, 4, 2, 16), (2, 130, 2, 1, 8), (1, 200, 3, 3, 32)]


def _shape_id(shape):
    B, T, H, Hkv, D = shape
    return f"B{B}-T{T}-H{H}-Hkv{Hkv}-D{D}"


@pytest.mark.parametrize("rotate_values", [False, True], ids=["qk", "qkv"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=[_shape_id(s) for s in SHAPES])
def test_fast_matches_reference(shape, dtype, rotate_values, monkeypatch):
    """Output and the gradients of q, k, v, θ and g, several query chunks on the CPU bias path."""
    monkeypatch.setattr(softmax_ops, "CPU_QUERY_CHUNK", 48)
    B, T, H, Hkv, D = shape
    tol = 1e-10 if dtype == torch.float64 else 2e-5

    def fast(q, k, v, th, g):
        return rotation_fox_attention(q, k, v, th, g, rotate_values=rotate_values)

    def ref(q, k, v, th, g):
        return ref_rotation_fox(q, k, v, th, g, rotate_values=rotate_values)

    assert_matches_reference(fast, ref, _inputs(B, T, H, Hkv, D, dtype, seed=T + H), tol, ("q", "k", "v", "theta", "g"))


def test_reference_returns_logits_and_probabilities():
    q, k, v, theta, g = (t.detach() for t in _inputs(2, 23, 2, 2, 8, torch.float64, seed=1))
    o, logits, probs = ref_rotation_fox(q, k, v, theta, g, return_attention=True)
    assert o.shape == q.shape and logits.shape == probs.shape == (2, 2, 23, 23)
    assert torch.allclose(probs.sum(-1), torch.ones(2, 2, 23, dtype=torch.float64))
    assert bool(torch.isneginf(logits.triu(1)[logits.triu(1) != 0]).all()) and float(probs.triu(1).abs().max()) == 0
    # the gate is added unscaled to the rotation's scaled logit
    _, rot_logits, _ = reference.rotation_attention(q, k, v, theta, return_attention=True)
    G = torch.cumsum(g, 1).transpose(1, 2)
    lower = torch.ones(23, 23, dtype=torch.bool).tril()
    assert torch.allclose(logits[..., lower], (rot_logits + G[..., :, None] - G[..., None, :])[..., lower], atol=1e-12)


# ----------------------------------------------------------------------------- identities


@pytest.mark.parametrize("rotate_values", [False, True], ids=["qk", "qkv"])
def test_gate_of_one_is_the_plain_rotation(rotate_values):
    q, k, v, theta, g = (t.detach() for t in _inputs(2, 70, 4, 2, 8, torch.float64, seed=2))
    zero = torch.zeros_like(g)
    want = reference.rotation_attention(q, k, v, theta, rotate_values=rotate_values)
    assert rel_err(rotation_fox_attention(q, k, v, theta, zero, rotate_values=rotate_values), want) < 1e-12
    assert rel_err(ref_rotation_fox(q, k, v, theta, zero, rotate_values=rotate_values), want) < 1e-12


@pytest.mark.parametrize("rotate_values", [False, True], ids=["qk", "qkv"])
def test_zero_angles_are_fox(rotate_values):
    q, k, v, theta, g = (t.detach() for t in _inputs(2, 70, 4, 2, 8, torch.float64, seed=3))
    zero = torch.zeros_like(theta)
    want = reference.fox_attention(q, k, v, g)
    assert rel_err(rotation_fox_attention(q, k, v, zero, g, rotate_values=rotate_values), want) < 1e-12
    assert rel_err(ref_rotation_fox(q, k, v, zero, g, rotate_values=rotate_values), want) < 1e-12


def test_constant_angles_without_forgetting_are_rope():
    q, k, v, theta, g = (t.detach() for t in _inputs(2, 50, 2, 2, 16, torch.float64, seed=4))
    omega = rope_frequencies(16).expand_as(theta).clone()
    want = reference.rope_attention(q, k, v)
    assert rel_err(rotation_fox_attention(q, k, v, omega, torch.zeros_like(g)), want) < 1e-12
    assert rel_err(ref_rotation_fox(q, k, v, omega, torch.zeros_like(g)), want) < 1e-12


@pytest.mark.parametrize("rotate_values", [False, True], ids=["qk", "qkv"])
def test_total_forgetting_attends_to_the_token_itself(rotate_values):
    """f → 0 (log f = −60 per step) leaves only j = i, where the transport is R(0) = I: o_i = v_i."""
    q, k, v, theta, g = (t.detach() for t in _inputs(2, 40, 2, 2, 8, torch.float64, seed=5))
    g = torch.full_like(g, -60.0)
    for fn in (rotation_fox_attention, ref_rotation_fox):
        assert rel_err(fn(q, k, v, theta, g, rotate_values=rotate_values), v) < 1e-12


def _layer(forget_gate, **kw):
    torch.manual_seed(0)
    return RotationAttention(mode="random", forget_gate=forget_gate, n_embd=16, n_head=4, n_kv_head=2, head_dim=8,
                             vocab_size=VOCAB, layer_idx=1, **kw).double()


@pytest.mark.parametrize("kwargs", [{}, {"table": "position", "window": 9.0}, {"rotate_values": True}],
                         ids=["token", "position-W9", "qkv"])
def test_open_gate_is_the_ungated_layer(kwargs):
    """b_f = +40 (f = σ(40), log f ≈ −4·10⁻¹⁸): the gated layer equals the plain rotation, fast and reference."""
    gated, plain = _layer(True, **kwargs), _layer(False, **kwargs)
    with torch.no_grad():
        gated.gate.proj.weight.zero_()
        gated.gate.proj.bias.fill_(40.0)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 33, 16, generator=gen, dtype=torch.float64)
    idx = torch.randint(0, VOCAB, (2, 33), generator=gen)
    q, k, v = (torch.randn(2, 33, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    want = plain(q, k, v, x=x, idx=idx)
    assert rel_err(gated(q, k, v, x=x, idx=idx), want) < 1e-12
    assert rel_err(gated(q, k, v, x=x, idx=idx, return_attention=True)[0], want) < 1e-12


@pytest.mark.parametrize("kwargs", [{}, {"table": "position", "window": 9.0}, {"rotate_values": True}],
                         ids=["token", "position-W9", "qkv"])
def test_layer_gradients_match_reference(kwargs):
    """The layer's fast path against its reference path: output, dq, dk, dv, dx and the gate's weight and bias."""
    layer = _layer(True, **kwargs)
    with torch.no_grad():
        layer.gate.proj.weight.normal_(0.0, 0.5)
        layer.gate.proj.bias.fill_(1.0)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 61, 16, generator=gen, dtype=torch.float64)
    idx = torch.randint(0, VOCAB, (2, 61), generator=gen)
    q, k, v = (torch.randn(2, 61, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    d_out = torch.randn(2, 61, 4, 8, generator=gen, dtype=torch.float64)

    def run(return_attention):
        layer.zero_grad(set_to_none=True)
        inputs = [t.clone().requires_grad_() for t in (q, k, v, x)]
        out = layer(*inputs[:3], x=inputs[3], idx=idx, return_attention=return_attention)
        out = out[0] if return_attention else out
        (out * d_out).sum().backward()
        return [out, *(t.grad for t in inputs), layer.gate.proj.weight.grad, layer.gate.proj.bias.grad]

    fast, ref = run(False), run(True)
    assert rel_err(fast[0], ref[0]) < 1e-10
    for name, got, want in zip(("q", "k", "v", "x", "gate weight", "gate bias"), fast[1:], ref[1:]):
        assert grad_err(got, want) < 1e-10, f"d{name}: {grad_err(got, want):.2e}"
    assert float(ref[-1].abs().max()) > 0  # the gate is really in the gradient


# ----------------------------------------------------------------------------- the model


def _model(**kw):
    torch.manual_seed(0)
    cfg = dict(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, attention=NAME)
    cfg.update(kw)
    return build_model(ModelConfig(**cfg))


def _qkv_model(model):
    """The registry fixes rotate_values=False for this name; the layer itself takes Q/K/V with the gate."""
    for block in model.blocks:
        block.attn.positional.rotate_values = True
    return model


def test_registered_and_listed(capsys):
    from pathlab import info

    assert NAME in pathlab.available_attention()
    assert "FoX forget gate" in pathlab.attention.describe_attention()[NAME]
    options = pathlab.attention.attention_options(NAME)
    assert {"table", "window", "dispersion", "seed", "base"} <= set(options)
    assert "forget_gate" not in options and "rotate_values" not in options  # fixed by the name
    assert "forget_gate" not in pathlab.attention.attention_options("rot_random_qk")
    info.run(argparse.Namespace(paper=False))
    assert NAME in capsys.readouterr().out
    layer = _model(attention_kwargs={"window": 32, "table": "position"}).blocks[0].attn.positional
    assert layer.gate is not None and "forget_gate=True" in repr(layer) and "window=32" in repr(layer)


def test_paper_shape_builds_with_foxs_parameter_count():
    """16 layers, width 768, 12 heads: RoPE's count plus one (768 → 12) gate with bias per layer, as FoX."""
    counts = {}
    for name in ("rope", "fox", NAME):
        with torch.device("meta"):
            model = build_model(ModelConfig.paper(name, attention_kwargs={"window": 128} if name == NAME else {}))
        counts[name] = (model.num_parameters(), model.num_parameters(non_embedding=True))
    assert counts[NAME] == counts["fox"] == (151_905_024 + 16 * (768 * 12 + 12), 113_271_552 + 16 * (768 * 12 + 12))
    assert counts[NAME][0] == 152_052_672


def test_gate_initialisation_is_foxs():
    model, fox = _model(), _model(attention="fox")
    for block, fox_block in zip(model.blocks, fox.blocks):
        gate, fox_gate = block.attn.positional.gate, fox_block.attn.positional.gate
        assert type(gate) is type(fox_gate)
        assert torch.equal(gate.proj.bias, torch.zeros(4)) and torch.equal(fox_gate.proj.bias, torch.zeros(4))
        assert 0.01 < float(gate.proj.weight.detach().std()) < 0.03  # the model's init_std = 0.02, as FoX's


@pytest.mark.parametrize("qkv", [False, True], ids=["qk", "qkv"])
def test_loss_falls(qkv):
    model = _model(attention_kwargs={"window": 16, "table": "position"})
    model = _qkv_model(model) if qkv else model

    def gate_learns(m):
        assert float(m.blocks[0].attn.positional.gate.proj.weight.grad.abs().max()) > 0

    losses = train_on_repeated_pattern(model, 10, check=gate_learns)
    assert losses[-1] < losses[0] - 0.3, losses


CONFIGS = {
    "token": ({}, False),
    "position-W64": ({"window": 64, "table": "position"}, False),
    "token-W5-qkv": ({"window": 5, "table": "token"}, True),
    "position-qkv": ({"table": "position", "dispersion": 0.5}, True),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_model_fast_path_equals_reference(config):
    """Logits and every parameter's gradient through the fast path against the fp64 reference path."""
    kwargs, qkv = CONFIGS[config]
    model = _model(attention_kwargs=kwargs, n_kv_head=2).double()
    model = _qkv_model(model) if qkv else model
    gen = torch.Generator().manual_seed(2)
    idx = torch.randint(0, VOCAB, (2, 37), generator=gen)

    def run(return_attention):
        model.zero_grad(set_to_none=True)
        out = model(idx, idx, return_attention=return_attention)
        out[1].backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (logits, _), grads = run(False)
    (ref_logits, _, records), ref_grads = run(True)
    assert rel_err(logits, ref_logits) < 1e-10
    assert set(grads) == set(ref_grads) and any("gate" in n for n in grads)
    for name in grads:
        assert grad_err(grads[name], ref_grads[name]) < 1e-10, name
    assert torch.allclose(records[1].probs.sum(-1), torch.ones(2, 4, 37, dtype=torch.float64))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_cached_generation_matches_full_forward(config):
    """Prefill + steps (the phases and FoX's running gate sum in the cache) equal the full forward."""
    kwargs, qkv = CONFIGS[config]
    model = _model(attention_kwargs=kwargs, n_kv_head=2).double().eval()
    model = _qkv_model(model) if qkv else model
    caches = assert_cached_generation_matches(model, VOCAB)
    assert caches[0].state["G"].shape == (2, 4) and float(caches[0].state["G"].detach().max()) < 0


def test_cached_generation_in_fp32():
    model = _model(attention_kwargs={"window": 64, "table": "position"}).eval()
    prompt = torch.randint(0, VOCAB, (2, 9))
    cached = model.generate(prompt, 10, temperature=0)
    logits, _ = model(cached)
    caches = [b.attn.positional.new_cache(2, 19, device="cpu", dtype=torch.float32) for b in model.blocks]
    stepped = [model._forward_cached(cached[:, :9], caches, prefill=True)]
    for t in range(9, 18):
        stepped.append(model._forward_cached(cached[:, t : t + 1], caches, prefill=False))
    assert rel_err(torch.stack(stepped, 1), logits[:, 8:18]) < 1e-5


def test_compiled_block_equals_eager():
    """The CPU path (pre-rotation, then the chunked bias SDPA) compiles in one graph and matches eager."""
    model = _model(attention_kwargs={"window": 64, "table": "position"})
    block = model.blocks[1]
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, VOCAB, (2, 24), generator=gen)
    x = model.wte(idx).detach()
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(block)(x, idx)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1

    def grads(fn):
        block.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        y = fn(xg, idx)
        (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
        return [y.detach(), xg.grad] + [p.grad for p in block.parameters() if p.grad is not None]

    eager = grads(block)
    torch._dynamo.reset()
    compiled = grads(torch.compile(block, backend="aot_eager", fullgraph=True))
    assert len(compiled) == len(eager)
    for got, want in zip(compiled, eager):
        assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("call,message", [
    (lambda q, k, v, th, g: rotation_fox_attention(q, k, v, th[..., :3], g), "theta must have shape"),
    (lambda q, k, v, th, g: rotation_fox_attention(q, k, v, th, g[:, :, :1]), "g must have shape"),
    (lambda q, k, v, th, g: rotation_fox_attention(q, k, v, th, g[0]), "g must have 3 dimensions"),
    (lambda q, k, v, th, g: rotation_fox_attention(q, k, v[..., :2], th, g, rotate_values=True), "rotate_values needs"),
    (lambda q, k, v, th, g: ref_rotation_fox(q, k, v, th, g[:, :4]), "g must have shape"),
    (lambda q, k, v, th, g: ref_rotation_fox(q, k, v, th[:, :4], g), "theta must have shape"),
])
def test_bad_inputs_raise(call, message):
    q, k, v, theta, g = (t.detach() for t in _inputs(1, 8, 2, 2, 8, torch.float32, seed=0))
    with pytest.raises(ValueError, match=message):
        call(q, k, v, theta, g)


def test_forget_gate_must_be_a_bool():
    with pytest.raises(ValueError, match="forget_gate must be True or False"):
        RotationAttention(forget_gate=1, n_embd=16, n_head=2, n_kv_head=2, head_dim=8, vocab_size=11, layer_idx=0)


def test_ungated_variants_are_unchanged():
    """rot_random_qk keeps no gate and the ungated op is the one it always was."""
    model = build_model(ModelConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=11, attention="rot_random_qk"))
    assert model.blocks[0].attn.positional.gate is None
    q, k, v, theta, _ = (t.detach() for t in _inputs(1, 30, 2, 2, 8, torch.float64, seed=8))
    assert rel_err(rotation_attention(q, k, v, theta), reference.rotation_attention(q, k, v, theta)) < 1e-12


# ----------------------------------------------------------------------------- CUDA


def _errors(fn, inputs, out_ref, grads_ref, d_out):
    out = fn(*inputs)
    grads = torch.autograd.grad(out, inputs, d_out.to(out.dtype))
    return [rel_err(out, out_ref)] + [grad_err(got, want) for got, want in zip(grads, grads_ref)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,floor", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)], ids=["fp16", "bf16"])
@pytest.mark.parametrize("rotate_values", [False, True], ids=["qk", "qkv"])
@pytest.mark.parametrize("shape", [(2, 333, 4, 4, 64), (1, 1000, 4, 2, 64)], ids=["B2-T333-H4-D64", "B1-T1000-gqa"])
def test_cuda_fast_path_matches_reference(shape, rotate_values, dtype, floor, monkeypatch):
    """FlexAttention on the rotated q, k (v) against the fp64 reference: output and the gradients of q, k, v, θ, g,
    in the half precisions that take it (fp32 takes the chunked SDPA, compared with the reference on the CPU).

    Tolerance (FlashAttention's policy): each error at most twice that of the same op in the same dtype through
    plain PyTorch (the chunked additive-bias SDPA, which also runs here), or below the floor. dθ is a reverse cumulative
    sum over the whole sequence of phase gradients, so in bf16 it is ≈ 2–4·10⁻² on both paths at these lengths.
    """
    monkeypatch.setattr(softmax_ops, "_flex_failure", None)  # judged on its own, whatever ran before
    B, T, H, Hkv, D = shape
    inputs = _inputs(B, T, H, Hkv, D, dtype, seed=0, device="cuda")
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]

    def fn(q, k, v, th, g):
        return rotation_fox_attention(q, k, v, th, g, rotate_values=rotate_values)

    out_ref = ref_rotation_fox(*ref_inputs, rotate_values=rotate_values)
    d_out = torch.randn_like(out_ref)
    grads_ref = torch.autograd.grad(out_ref, ref_inputs, d_out)
    flex = _errors(fn, inputs, out_ref, grads_ref, d_out)
    assert softmax_ops._flex_failure is None, softmax_ops._flex_failure  # FlexAttention ran, not the fallback
    monkeypatch.setattr(softmax_ops, "_use_flex", lambda q: False)
    plain = _errors(fn, inputs, out_ref, grads_ref, d_out)
    for name, got, same_dtype in zip(("o", "dq", "dk", "dv", "dtheta", "dg"), flex, plain):
        assert got <= max(2 * same_dtype, floor), f"{name}: {got:.2e} (PyTorch in {dtype}: {same_dtype:.2e})"
        assert same_dtype <= max(0.1, 10 * floor), f"{name}: the PyTorch path itself is off ({same_dtype:.2e})"


@pytest.mark.gpu
def test_cuda_model_matches_reference_in_bf16(monkeypatch):
    """A model under bf16 autocast on CUDA (head dim 16, FlexAttention's smallest): the fast path's loss and gate
    gradients against the fp64 reference path."""
    monkeypatch.setattr(softmax_ops, "_flex_failure", None)
    kw = dict(n_embd=64, attention_kwargs={"window": 64, "table": "position"})
    model, ref = _model(**kw).cuda(), _model(**kw).cuda().double()
    ref.load_state_dict(model.state_dict())
    idx = torch.randint(0, VOCAB, (2, 300), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss = model(idx, idx)
    loss.backward()
    assert softmax_ops._flex_failure is None, softmax_ops._flex_failure
    _, ref_loss, _ = ref(idx, idx, return_attention=True)
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 2e-2 * ref_loss.item()
    for layer in (0, 1):
        got = model.blocks[layer].attn.positional.gate.proj.weight.grad
        want = ref.blocks[layer].attn.positional.gate.proj.weight.grad
        assert rel_err(got, want) < 5e-2
