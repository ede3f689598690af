"""M2 score-weighted decorrelation ρ_s(n), per-head near-set widths W_h, and the M4 prediction from training-length
statistics: closed forms and constructed cases."""

import math

import numpy as np
import pytest
import torch

from pathlab import ModelConfig, build_model
from pathlab.ops.positions import rotate
from pathlab.probes import farmass, learned, summaries
from pathlab.probes.model import learned_head_windows, measure_model


def _dense_pairs(q, k, theta):
    """Every causal pair of ``[B, T, H, D]`` q, k with step angles θ ``[B, T, H, D/2]``: (s, s⁰, distance)."""
    B, T, H, D = q.shape
    phi = torch.cumsum(theta.double(), 1)
    qr, kr = rotate(q.double(), -phi), rotate(k.double(), -phi)  # s_ij = q_iᵀ R(Φ_i − Φ_j) k_j / √D
    s = torch.einsum("bihd,bjhd->bijh", qr, kr) / math.sqrt(D)
    s0 = torch.einsum("bihd,bjhd->bijh", q.double(), k.double()) / math.sqrt(D)
    i, j = torch.tril_indices(T, T)
    return (s[:, i, j].reshape(-1, H).numpy(), s0[:, i, j].reshape(-1, H).numpy(),
            (i - j).repeat(B).numpy())


def test_rho_s_of_constant_rotation_is_the_analytic_cosine():
    # one block, constant angle ω (RoPE), q = (1, 1), k = (1, 0): s = cos ωn + sin ωn, s⁰ = 1 (× 1/√2)
    T, omega = 64, 0.3
    q = torch.tensor([1.0, 1.0]).expand(1, T, 1, 2)
    k = torch.tensor([1.0, 0.0]).expand(1, T, 1, 2)
    theta = torch.full((1, T, 1, 1), omega, dtype=torch.float64)
    s, s0, dist = _dense_pairs(q, k, theta)
    n = np.arange(T)
    rho = learned.score_decorrelation(s, s0, dist, np.arange(T + 1))  # one distance per bin
    np.testing.assert_allclose(rho[:, 0], np.cos(omega * n) + np.sin(omega * n), atol=1e-12)
    u = learned.block_score_weights(q, k)
    np.testing.assert_allclose(u, [[1 - 1j]], atol=1e-12)
    pred = learned.predicted_score_decorrelation(learned.phase_correlation(theta, T - 1), u)
    np.testing.assert_allclose(pred[:, 0], (np.cos(omega * n) + np.sin(omega * n))[1:], atol=1e-10)
    # the envelope never decays: a RoPE head has no window and takes the fallback
    coh = learned.head_coherence(learned.phase_correlation(theta, T - 1), u)
    w, fell = learned.head_windows(coh, 0.05, fallback=512)
    assert w.tolist() == [512.0] and fell.tolist() == [True]


def test_rho_s_of_fully_mixed_phases_vanishes_beyond_one_step():
    g = torch.Generator().manual_seed(0)
    B, T, H, D = 16, 500, 2, 8
    theta = torch.rand(B, T, H, D // 2, generator=g, dtype=torch.float64) * 2 * math.pi  # U[0, 2π): ψ = 0
    q, k = torch.randn(B, T, H, D, generator=g), torch.randn(B, T, H, D, generator=g)
    q = q + 0.5 * k  # a positive score alignment, so that E[(s⁰)²] is not only noise
    s, s0, dist = _dense_pairs(q[:4, :200], k[:4, :200], theta[:4, :200])
    edges = np.array([0, 1, 2, 5, 20, 200])
    rho = learned.score_decorrelation(s, s0, dist, edges)  # [5 bins, H]
    np.testing.assert_allclose(rho[0], 1.0, atol=1e-12)  # n = 0: no rotation at all
    assert np.all(np.abs(rho[1:]) < 0.15)
    u = learned.block_score_weights(q, k)
    np.testing.assert_allclose(u.real.sum(-1), 1.0, atol=1e-10)  # Σ_b Re u_b = 1
    corr = learned.phase_correlation(theta, 50)
    assert np.all(np.abs(learned.predicted_score_decorrelation(corr, u)) < 0.05)
    w, fell = learned.head_windows(learned.head_coherence(corr, u), 0.05, fallback=256)
    assert w.tolist() == [1.0, 1.0] and not fell.any()


def test_head_windows_of_synthetic_heads_with_known_decay():
    # θ ~ N(0, σ²) i.i.d. per head: C(n) = e^{−nσ²/2}; q = k = one fixed vector: u_b = |v_b|²/|v|² ≥ 0, Σ u_b = 1,
    # so c_h(n) = e^{−nσ²/2} and W_h = ⌈ln ε / (−σ²/2)⌉ = 6 (σ = 1), 67 (σ = 0.3); head 2 turns by a constant angle
    g = torch.Generator().manual_seed(1)
    B, T, D = 16, 800, 8
    theta = torch.stack([torch.randn(B, T, 4, generator=g, dtype=torch.float64),
                         0.3 * torch.randn(B, T, 4, generator=g, dtype=torch.float64),
                         torch.full((B, T, 4), 0.5, dtype=torch.float64)], dim=2)  # [B, T, 3, Db]
    v = torch.randn(3, D, generator=g)
    q = k = v.expand(B, T, 3, D)
    u = learned.block_score_weights(q, k)
    np.testing.assert_allclose(u.imag, 0.0, atol=1e-10)
    np.testing.assert_allclose(u.real.sum(-1), 1.0, atol=1e-10)
    coh = learned.head_coherence(learned.phase_correlation(theta, 150), u)
    np.testing.assert_allclose(coh[:5, 0], np.exp(-0.5 * np.arange(1, 6)), atol=0.02)
    w, fell = learned.head_windows(coh, 0.05, fallback=256)
    # c(n) is flat near W for σ = 0.3 (slope ε σ²/2 ≈ 0.002 per step) against a noise of ≈ 0.01: a few steps' play
    assert abs(w[0] - 6) <= 1 and abs(w[1] - 67) <= 10 and w[2] == 256
    assert fell.tolist() == [False, False, True]
    assert np.isinf(learned.head_windows(coh, 0.05)[0][2])  # no fallback: inf


def test_learned_head_windows_of_models():
    torch.manual_seed(0)
    windows = torch.randint(0, 64, (2, 80))
    rot = build_model(ModelConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, attention="rot_random_qk"))
    hw = learned_head_windows(rot, windows, n_max=40, fallback=64)
    assert hw["W"].shape == (2, 2) and hw["coherence"].shape == (40, 2, 2)
    np.testing.assert_array_equal(hw["W"], np.where(hw["fallback"], 64.0, hw["W_m2"]))
    assert np.all(hw["W"] >= 1) and np.all(np.isfinite(hw["W"]))
    rope = build_model(ModelConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, attention="rope"))
    hw = learned_head_windows(rope, windows, n_max=40, fallback=64)  # no step angles: every head falls back
    assert hw["fallback"].all() and np.all(hw["W"] == 64) and hw["coherence"] is None
    with pytest.raises(ValueError, match="n_max"):
        learned_head_windows(rope, windows, n_max=80, fallback=64)


@pytest.mark.parametrize("attention", ["rot_random_qkv", "alibi"])
def test_per_head_near_set_matches_attention_records(attention):
    torch.manual_seed(2)
    model = build_model(ModelConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, attention=attention))
    windows = torch.randint(0, 64, (2, 50))
    W = np.array([[3, 9], [6, 1]])  # [layers, H]
    res = measure_model(model, windows, n_queries=5, span=20, near_windows=(W, 4), chunk=16)
    np.testing.assert_array_equal(res["near_windows"][0], W)
    np.testing.assert_array_equal(res["near_windows"][1], 4)
    with torch.no_grad():
        _, _, records = model(windows, return_attention=True)
    for layer, rec in enumerate(records):
        probs = rec.probs.numpy()  # [B, H, T, T]
        expected = [[probs[b, h, i, : max(i - W[layer, h] + 1, 0)].sum() for h in range(2)]
                    for b in range(2) for i in res["positions"][b]]
        np.testing.assert_allclose(res["per_query"]["far_mass"][layer, 0], expected, rtol=1e-6, atol=1e-12)
        m_far = [[max(i - W[layer, h] + 1, 0) for h in range(2)] for b in range(2) for i in res["positions"][b]]
        np.testing.assert_array_equal(res["per_query"]["m_far"][layer, 0], m_far)
    with pytest.raises(ValueError, match="near_windows"):
        measure_model(model, windows, n_queries=2, span=10, near_windows=(np.zeros((2, 2)),))


def test_measured_rho_s_of_a_model_is_the_pure_function():
    torch.manual_seed(3)
    model = build_model(ModelConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=64, attention="rot_random_qk"))
    windows = torch.randint(0, 64, (1, 40))
    captured = {}
    from pathlab.probes.model import positional_hooks, run_blocks

    def grab(layer, module, q, k, v, x, idx):
        captured.update(q=q.detach(), k=k.detach(), theta=module.angles(x, idx).detach())

    with torch.no_grad(), positional_hooks(model, grab):
        run_blocks(model, windows)
    res = measure_model(model, windows, n_queries=40, span=40, near_windows=(4,))
    s, s0, dist = _dense_pairs(captured["q"], captured["k"], captured["theta"])
    expected = learned.score_decorrelation(s, s0, dist, res["edges"])
    np.testing.assert_allclose(res["per_bin"]["rho_s"][0], expected, rtol=1e-6, atol=1e-9)


def test_far_mass_prediction_from_training_length_reproduces_the_toy_model():
    # M4 toy model (docs/theory.md#m4): K = 64 near keys at s = 4, far s ~ N(0, 1). Γ measured at M_L = 448
    # only predicts ρ_D = 0.174 / 0.420 / 0.784 / 0.938 / 0.968 at M_L = 448 / 1536 / 7680 / 32256 / 65024.
    rng = np.random.default_rng(0)
    trials, m_train = 400, 448
    far = rng.normal(size=(trials, m_train))
    log_zn = math.log(64) + 4.0
    log_mf = np.log(np.exp(far).mean(axis=1))
    gap = farmass.effective_gap(np.full(trials, log_zn), log_mf)[:, None]  # [Q, H = 1]
    m_far = np.array([448, 1536, 7680, 32256, 65024], float)[:, None]  # [Q', H]
    pred = farmass.predict_far_mass(gap, m_far)[:, 0]
    np.testing.assert_allclose(pred, [0.174, 0.420, 0.784, 0.938, 0.968], atol=0.015)
    np.testing.assert_allclose(pred, farmass.toy_far_mass(m_far[:, 0]), atol=0.015)
    # a head whose training length has no far key cannot be predicted
    both = farmass.predict_far_mass(np.concatenate([gap, np.full_like(gap, np.nan)], 1), np.hstack([m_far, m_far]))
    assert np.all(np.isfinite(both[:, 0])) and np.all(np.isnan(both[:, 1]))
    with pytest.raises(ValueError, match="m_far"):
        farmass.predict_far_mass(gap, -m_far)


def test_bad_input_is_a_value_error():
    with pytest.raises(ValueError, match="same shape"):
        learned.score_decorrelation(np.zeros(3), np.zeros(4), np.arange(3), [0, 1, 5])
    with pytest.raises(ValueError, match="distance"):
        learned.score_decorrelation(np.zeros(3), np.zeros(3), np.array([0, -1, 2]), [0, 1, 5])
    with pytest.raises(ValueError, match="edges"):
        learned.score_decorrelation(np.zeros(3), np.zeros(3), np.arange(3), [0, 0, 5])
    with pytest.raises(ValueError, match="eps"):
        learned.head_windows(np.ones((3, 2)), eps=1.5)
    with pytest.raises(ValueError, match="fallback"):
        learned.head_windows(np.ones((3, 2)), fallback=0)
    with pytest.raises(ValueError, match="weights"):
        learned.predicted_score_decorrelation(np.ones((3, 2, 4)), np.ones((2, 3)))
    with pytest.raises(ValueError, match="q and k"):
        learned.block_score_weights(torch.zeros(1, 4, 2, 3), torch.zeros(1, 4, 2, 3))
    with pytest.raises(ValueError, match="theta"):
        learned.phase_correlation(torch.zeros(4, 2, 3), 2)
    record = {"width_labels": np.array(["per-head", "64", "128"])}
    for bad in (0, 2.5, "32", 512):
        with pytest.raises(ValueError, match="width must be one of"):
            summaries.width_index(record, bad)
    assert summaries.width_index(record, None) == 0 and summaries.width_index(record, 64) == 1
