"""Window-controlled random rotations: θ_{t,h,b} = ω_b + σ ε_{t,h,b}, ε ~ N(0, 1), σ² = 2 ln(1/ε₀)/W.

* the step statistics: mean ω_b, γ_b = |mean_t e^{iθ}| = e^{−σ²/2} in every block, ε standard normal;
* the mixing curve c(n) = |mean_t e^{i(Φ_{t+n} − Φ_t)}| follows γⁿ and crosses ε₀ = 0.05 at n ≈ W in every block;
* a model trains, its fast path equals the fp64 reference, cached generation equals the full forward, and a
  compiled block equals the eager one; bad options raise ValueError.
"""

import math

import numpy as np
import pytest
import torch
import torch._dynamo

import pathlab
from pathlab import ModelConfig, build_model
from pathlab.attention.rotation import RotationAttention, keyed_normal, salt_key, window_sigma
from pathlab.ops.positions import rope_frequencies
from pathlab.probes.learned import phase_correlation
from pathlab.probes.mixing import empirical_window
from pathlab.testing import assert_cached_generation_matches, rel_err, train_on_repeated_pattern

EPS0 = 0.05
VOCAB = 61


def _layer(window, table="position", n_head=2, head_dim=64, **kw):
    return RotationAttention(mode="random", table=table, window=window, n_embd=32, n_head=n_head, n_kv_head=n_head,
                             head_dim=head_dim, vocab_size=50304, layer_idx=3, **kw)


def _position_angles(layer, T, start=0):
    return layer.angles(torch.zeros(1, T, 1), start=start).double()  # [1, T, H, D/2]


def test_sigma_gives_the_window():
    for W in (1.0, 16.0, 64.0, 512.0, 1e5):
        gamma = math.exp(-window_sigma(W) ** 2 / 2)
        assert math.isclose(math.log(EPS0) / math.log(gamma), W, rel_tol=1e-12)


def test_box_muller_normals():
    """ε from the hash: mean 0, variance 1, Gaussian tails and no cross-block correlation; finite everywhere."""
    eps = keyed_normal(torch.arange(200_000)[None], 2, 8, salt_key(12345))  # [1, T, 2, 8]
    assert eps.dtype == torch.float64 and bool(torch.isfinite(eps).all())
    flat = eps.reshape(-1, 16)
    assert flat.mean(0).abs().max() < 0.01 and (flat.var(0) - 1).abs().max() < 0.02
    assert abs(float((flat.abs() > 1.96).double().mean()) - 0.05) < 0.002  # the N(0, 1) two-sided 5% tail
    assert abs(float((flat ** 4).mean()) - 3.0) < 0.05  # kurtosis of a normal
    corr = torch.corrcoef(flat.T)
    assert (corr - torch.eye(16, dtype=torch.float64)).abs().max() < 0.01
    # consecutive positions are independent too
    assert abs(float(torch.corrcoef(torch.stack((flat[:-1, 0], flat[1:, 0])))[0, 1])) < 0.01


def test_u_zero_gives_a_finite_normal(monkeypatch):
    """u₁ = 0 (the hash's smallest value) must not reach log(0): the radius uses 1 − u₁ ∈ [2⁻³², 1]."""
    import pathlab.attention.rotation as rotation

    monkeypatch.setattr(rotation, "keyed_uniform", lambda index, H, nb, key: torch.zeros(*index.shape, H, nb,
                                                                                        dtype=torch.float64))
    assert torch.equal(rotation.keyed_normal(torch.zeros(1, 3, dtype=torch.long), 1, 2, salt_key(0)),
                       torch.zeros(1, 3, 1, 2, dtype=torch.float64))
    ones = torch.full((1, 1, 1, 2), 1 - 2.0 ** -32, dtype=torch.float64)  # the largest u: radius √(64 ln 2)
    monkeypatch.setattr(rotation, "keyed_uniform", lambda index, H, nb, key: ones.expand(*index.shape, H, nb))
    eps = rotation.keyed_normal(torch.zeros(1, 1, dtype=torch.long), 1, 1, salt_key(0))
    assert torch.isfinite(eps).all() and float(eps.abs().max()) <= math.sqrt(64 * math.log(2)) + 1e-9


@pytest.mark.parametrize("W", [16, 64, 200.5])
def test_gamma_and_mean_angle_per_block(W):
    """|mean_t e^{iθ_t}| = e^{−σ²/2} and mean_t θ_t = ω_b in every (head, block), over 2¹⁷ positions."""
    layer = _layer(W)
    theta = _position_angles(layer, 1 << 17)[0]  # [T, H, D/2]
    sigma = window_sigma(W)
    gamma = torch.polar(torch.ones_like(theta), theta).mean(0).abs()
    assert (gamma - math.exp(-sigma ** 2 / 2)).abs().max() < 5e-3
    omega = rope_frequencies(64)
    standard_error = sigma / math.sqrt(theta.shape[0])
    assert ((theta.mean(0) - omega) / standard_error).abs().max() < 4.5  # 64 blocks: < 4.5 standard errors
    assert torch.allclose(theta.std(0), torch.full_like(omega, sigma), rtol=0.02)


@pytest.mark.parametrize("W", [16, 40.5, 64])
def test_mixing_curve_crosses_eps0_at_the_window(W):
    """c_b(n) = |mean_{t,h} e^{i(Φ_{t+n} − Φ_t)}| is γⁿ (RoPE's mean phase drops out of the modulus) and falls to ε₀
    at n ≈ W in every block, the slow blocks (ω down to 3·10⁻⁴ at D = 16) included.

    The time average over one sequence has an effective sample of about T/(W/6) (overlapping paths share their
    steps), so the complex correlation is also averaged over 8 independent heads before the modulus is taken; the
    remaining noise is ≈ 0.005 (W = 64). c(W) = ε₀ exactly, so the crossing is ⌈W⌉ or the step after."""
    layer = _layer(W, n_head=8, head_dim=16)
    theta = _position_angles(layer, 1 << 16)
    n_max = int(3 * W)
    c = np.abs(phase_correlation(theta, n_max).mean(1))  # [n, D/2]
    gamma = math.exp(-window_sigma(W) ** 2 / 2)
    assert np.abs(c - gamma ** np.arange(1, n_max + 1)[:, None]).max() < 0.025
    assert 0 <= empirical_window(c.mean(1), EPS0) - math.ceil(W) <= 2
    per_block = np.array([empirical_window(c[:, b], EPS0) for b in range(c.shape[1])])
    assert np.all(np.abs(per_block - W) <= max(2, 0.1 * W)), per_block


def test_token_table_is_frozen_and_mixes_over_varied_text():
    """table="token": the same token always gets the same angles; over i.i.d. uniform tokens from a large vocabulary
    γ_b = |Σ_v p(v) e^{iθ_b(v)}| is e^{−σ²/2} up to the table's sampling noise."""
    layer = _layer(32, table="token")
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 50304, (1, 1 << 16), generator=gen)
    theta = layer.angles(torch.zeros(1, idx.shape[1], 1), idx).double()[0]
    first = {}
    for t, token in enumerate(idx[0, :4000].tolist()):
        if token in first:
            assert torch.equal(theta[t], theta[first[token]])
        first.setdefault(token, t)
    gamma = torch.polar(torch.ones_like(theta), theta).mean(0).abs()
    assert (gamma - math.exp(-window_sigma(32) ** 2 / 2)).abs().max() < 0.015
    # the table does not depend on the position nor on the batch row
    again = layer.angles(torch.zeros(2, 3, 1), torch.stack((idx[0, 10:13], idx[0, :3])))
    assert torch.equal(again[0].double(), theta[10:13]) and torch.equal(again[1].double(), theta[:3])


def test_position_table_decodes_from_any_start():
    layer = _layer(64)
    full = _position_angles(layer, 40)
    assert torch.equal(_position_angles(layer, 1, start=29)[0, 0], full[0, 29])
    assert torch.equal(_position_angles(layer, 11, start=29)[0], full[0, 29:])


def test_a_huge_window_is_rope():
    """σ → 0: θ = ω_b (to fp32 rounding of ω), so the model is RoPE."""
    layer = _layer(1e30)
    assert torch.equal(_position_angles(layer, 5)[0], rope_frequencies(64).float().double().expand(5, 2, 32))
    kw = dict(n_layer=1, n_head=2, n_embd=32, vocab_size=VOCAB)
    torch.manual_seed(0)
    rot = build_model(ModelConfig(attention="rot_random_qk", attention_kwargs={"window": 1e30, "table": "position"},
                                  **kw))
    rope = build_model(ModelConfig(attention="rope", **kw))
    rope.load_state_dict(rot.state_dict())
    idx = torch.randint(0, VOCAB, (2, 40))
    assert rel_err(rot(idx)[0], rope(idx)[0]) < 1e-5


def test_layers_and_seeds_draw_different_noise():
    a = _position_angles(_layer(64), 50)
    b = _position_angles(RotationAttention(mode="random", table="position", window=64, n_embd=32, n_head=2,
                                           n_kv_head=2, head_dim=64, vocab_size=11, layer_idx=4), 50)
    c = _position_angles(_layer(64, seed=1), 50)
    assert not torch.allclose(a, b) and not torch.allclose(a, c)


# ----------------------------------------------------------------------------- in a model


def _model(name="rot_random_qk", **kw):
    torch.manual_seed(0)
    cfg = dict(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, attention=name,
               attention_kwargs={"window": 64, "table": "position"})
    cfg.update(kw)
    return build_model(ModelConfig(**cfg))


def test_extra_repr_shows_the_window():
    text = repr(_model().blocks[0].attn.positional)
    assert "window=64" in text and "table=position" in text and "dispersion" not in text
    assert "dispersion=1" in repr(_model(attention_kwargs={}).blocks[0].attn.positional)


@pytest.mark.parametrize("name", ["rot_random_qk", "rot_random_qkv"])
def test_model_trains_a_step(name):
    losses = train_on_repeated_pattern(_model(name), 8)
    assert losses[-1] < losses[0] - 0.2, losses


@pytest.mark.parametrize("table", ["position", "token"])
@pytest.mark.parametrize("name", ["rot_random_qk", "rot_random_qkv"])
def test_fast_path_equals_the_reference(name, table):
    model = _model(name, attention_kwargs={"window": 12.5, "table": table}).double()
    idx = torch.randint(0, VOCAB, (2, 37))
    logits, _ = model(idx)
    ref_logits, _, records = model(idx, return_attention=True)
    assert torch.allclose(ref_logits, logits, atol=1e-10)
    assert torch.allclose(records[0].probs.sum(-1), torch.ones(2, 4, 37, dtype=torch.float64))


@pytest.mark.parametrize("kwargs", [{"window": 64, "table": "position"}, {"window": 5, "table": "token"}],
                         ids=["position-W64", "token-W5"])
@pytest.mark.parametrize("name", ["rot_random_qk", "rot_random_qkv"])
def test_cached_generation_matches_full_forward(name, kwargs):
    """Prefill + steps equal the full forward (the test_model pattern): the per-position noise is keyed by the
    absolute position, so a step at position t draws the same ε as the full sequence."""
    assert_cached_generation_matches(_model(name, attention_kwargs=kwargs, n_kv_head=2).double().eval(), VOCAB)


def test_compiled_block_equals_eager_and_has_no_graph_break():
    """The window's σ is one Python number for every layer and the salt a buffer: one graph, no break, no
    recompile per layer (the test_rotary_tables pattern), and the compiled block's output and gradients are eager's."""
    model = _model(n_layer=3)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, VOCAB, (2, 24), generator=gen)
    x = model.wte(idx).detach()
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model.blocks[1])(x, idx)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1

    def grads(fn):
        block = model.blocks[1]
        block.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        y = fn(xg, idx)
        (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
        return [y.detach(), xg.grad] + [p.grad for p in block.parameters() if p.grad is not None]

    eager = grads(model.blocks[1])
    torch._dynamo.reset()
    compiled = grads(torch.compile(model.blocks[1], backend="aot_eager", fullgraph=True))
    for got, want in zip(compiled, eager):
        assert rel_err(got, want) < 1e-5
    torch._dynamo.reset()
    for block in model.blocks:
        block.compile(backend="eager", fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        model(idx, idx)[1].backward()


# ----------------------------------------------------------------------------- bad options


@pytest.mark.parametrize("kwargs,message", [
    ({"window": 0}, "window must be a finite number > 0"),
    ({"window": -3.0}, "window must be a finite number > 0"),
    ({"window": float("inf")}, "window must be a finite number > 0"),
    ({"window": float("nan")}, "window must be a finite number > 0"),
    ({"window": "64"}, "window must be a finite number > 0"),
    ({"window": True}, "window must be a finite number > 0"),
    ({"window": torch.tensor(64.0)}, "window must be a finite number > 0"),
    ({"window": 64, "dispersion": 0.5}, r"window=64 and dispersion=0.5 cannot be combined"),
    ({"window": 64, "dispersion": 0}, r"window=64 and dispersion=0 cannot be combined"),
])
def test_bad_windows_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _model(attention_kwargs=kwargs)


def test_window_is_for_random_angles_only():
    with pytest.raises(ValueError, match="window applies to mode='random' only"):
        _model("rot_learned_qk", attention_kwargs={"window": 64})


def test_accepted_windows():
    assert _layer(3).window == 3.0 and _layer(np.float64(2.5)).window == 2.5 and _layer(None).window is None
    assert "window" in pathlab.attention.attention_options("rot_random_qk")
    assert _layer(64, dispersion=1.0).window == 64.0  # the default dispersion is no conflict
