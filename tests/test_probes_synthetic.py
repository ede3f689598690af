"""Synthetic probes (M1, M3-synthetic, M4 toy, M5, M6) against the closed forms and reference simulation values
of docs/theory.md."""

import math
import warnings

import numpy as np
import pytest

from pathlab.probes import bounds, coherence, farmass, mixing, tails


# ---------------------------------------------------------------- M1 mixing


@pytest.mark.parametrize("sigma, window", [(0.1, 600), (0.3, 67), (1.0, 6)])
def test_gaussian_so2_gamma_and_window_closed_form(sigma, window):
    gamma = mixing.gamma_gaussian(sigma)
    assert gamma == pytest.approx(math.exp(-sigma ** 2 / 2))
    assert mixing.mixing_window(gamma, 0.05) == window  # docs/theory.md#m1, "W(0.05)"


@pytest.mark.parametrize("sigma", [0.3, 1.0])
def test_so2_coherence_follows_gamma_power_above_noise_floor(sigma):
    trials = 1000
    c = mixing.so2_coherence(mixing.gaussian_angles(sigma), 320, trials, seed=1)[:, 0]
    n = np.arange(1, 321)
    expected = mixing.gamma_gaussian(sigma) ** n
    assert np.max(np.abs(c - expected)) < 4.0 / math.sqrt(trials)
    # below the noise floor the estimate stays there (it never keeps decaying like γ^n)
    assert np.median(c[expected < 1e-4]) == pytest.approx(mixing.noise_floor(trials), rel=0.5)
    assert abs(mixing.empirical_window(c) - mixing.mixing_window(expected[0])) <= 0.25 * mixing.mixing_window(
        expected[0]) + 1


def test_so2_sigma01_value_at_100():
    c = mixing.so2_coherence(mixing.gaussian_angles(0.1), 100, 1000, seed=2)[:, 0]
    assert c[99] == pytest.approx(0.61, abs=0.03)  # docs/theory.md#m1: c(100) = 0.61


def test_rope_never_mixes_and_scaled_uniform_matches_sinc():
    omega = mixing.rope_frequencies(64)
    assert omega[0] == 1.0 and omega[-1] == pytest.approx(10000 ** (-62 / 64))
    c_rope = mixing.so2_coherence(mixing.rope_angles(omega), 50, 3, 32)
    np.testing.assert_allclose(c_rope, 1.0, atol=1e-12)
    assert np.all(np.isinf(mixing.mixing_window(np.ones(3))))
    trials = 2000
    c = mixing.so2_coherence(mixing.scaled_uniform_angles(omega[:4]), 40, trials, 4, seed=3)
    expected = mixing.gamma_scaled_uniform(omega[:4]) ** np.arange(1, 41)[:, None]
    assert np.max(np.abs(c - expected)) < 4.0 / math.sqrt(trials)
    assert mixing.gamma_scaled_uniform(1.0) == pytest.approx(math.sin(1.0))


def test_token_table_gamma():
    theta = np.array([[0.0], [np.pi]])
    assert mixing.gamma_from_angle_table(theta)[0] == pytest.approx(0.0, abs=1e-12)
    assert mixing.gamma_from_angle_table(theta, [0.75, 0.25])[0] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="probs"):
        mixing.gamma_from_angle_table(theta, [1.0])


@pytest.mark.parametrize("beta, expected", [(2.0, (0.362, 0.131, 0.017)), (1.0, (0.60, 0.36, 0.13))])
def test_householder_trace_matches_reference_values(beta, expected):
    r = mixing.matrix_coherence(mixing.householder_step(beta), 64, 128, 100, seed=0)
    got = r["trace"][[31, 63, 127]]
    analytic = mixing.gamma_householder(64, beta) ** np.array([32, 64, 128])
    np.testing.assert_allclose(analytic, expected, atol=0.006)
    np.testing.assert_allclose(got, analytic, atol=0.02)


def test_random_beta_householder_and_lazy_haar():
    r = mixing.matrix_coherence(mixing.householder_step(mixing.sigmoid_beta), 16, 24, 400, seed=4)
    np.testing.assert_allclose(r["trace"], (1 - 1 / 16) ** np.arange(1, 25), atol=0.03)
    q = mixing.haar_so(5, 200, np.random.default_rng(0))
    np.testing.assert_allclose(q @ np.swapaxes(q, 1, 2), np.broadcast_to(np.eye(5), q.shape), atol=1e-10)
    np.testing.assert_allclose(np.linalg.det(q), 1.0, atol=1e-10)
    r = mixing.matrix_coherence(mixing.lazy_haar_step(0.3), 8, 12, 600, seed=5)
    np.testing.assert_allclose(r["trace"], 0.7 ** np.arange(1, 13), atol=0.06)


def test_mixing_bad_input():
    with pytest.raises(ValueError, match="eps"):
        mixing.mixing_window(0.5, 1.5)
    with pytest.raises(ValueError, match="head_dim"):
        mixing.rope_frequencies(7)
    with pytest.raises(ValueError, match="n_max"):
        mixing.so2_coherence(mixing.gaussian_angles(1.0), 0, 10)


# ---------------------------------------------------------------- M3 synthetic tails


@pytest.mark.parametrize("dim", [16, 64, 256])
def test_far_score_variance_and_tails_below_bounds(dim):
    rng = np.random.default_rng(dim)
    q, k = rng.normal(size=dim), rng.normal(size=dim)
    scale = np.linalg.norm(q) * np.linalg.norm(k)
    n = 20000
    t = np.linspace(0.0, 4.0, 41) * scale / math.sqrt(dim)
    s_haar = tails.haar_scores(q, k, n, seed=1)
    assert np.var(s_haar) == pytest.approx(scale ** 2 / dim, rel=0.05)
    assert abs(np.mean(s_haar)) < 4 * scale / math.sqrt(dim * n)
    slack = 3.0 / math.sqrt(n)
    assert np.all(tails.empirical_tail(s_haar, t) <= tails.sphere_tail_bound(t, dim, scale) + slack)
    assert np.all(tails.empirical_tail(s_haar, t) <= tails.levy_tail_bound(t, dim, scale) + slack)
    s_blk = tails.block_so2_scores(q, k, n, seed=2)
    r = tails.block_pair_norms(q) * tails.block_pair_norms(k)
    assert np.var(s_blk) == pytest.approx(np.sum(r ** 2) / 2, rel=0.05)
    assert np.all(tails.empirical_tail(s_blk, t) <= tails.hoeffding_tail_bound(t, r) + slack)


def test_empirical_tail_counts():
    np.testing.assert_allclose(tails.empirical_tail([-2.0, 1.0, 0.5, 3.0], [0.0, 1.0, 2.5, 5.0]),
                               [1.0, 0.75, 0.25, 0.0])


# ---------------------------------------------------------------- M4 toy model


def test_toy_far_mass_matches_reference_values_and_simulation():
    m = np.array([448, 1536, 7680, 32256, 65024])
    reference = [0.174, 0.420, 0.784, 0.938, 0.968]
    np.testing.assert_allclose(farmass.toy_far_mass(m), reference, atol=6e-4)
    np.testing.assert_allclose(farmass.simulate_toy_far_mass(m, trials=20, seed=3), farmass.toy_far_mass(m),
                               atol=5e-3)


def test_far_mass_identity_and_gap():
    rng = np.random.default_rng(0)
    near, far = rng.normal(1.0, 1.0, size=(5, 32)), rng.normal(size=(5, 300))
    log_zn = np.log(np.exp(near).sum(-1))
    log_mf = np.log(np.exp(far).mean(-1))
    gap = farmass.effective_gap(log_zn, log_mf)
    np.testing.assert_allclose(farmass.far_mass_from_gap(300, gap), bounds.far_mass_from_logits(near, far),
                               rtol=1e-12)
    on = farmass.onset_length(5.0, 64, rise=0.1)
    rho0 = farmass.far_mass_from_gap(1.0, 5.0)
    assert farmass.far_mass_from_gap(on - 64, 5.0) == pytest.approx(rho0 + 0.1)


# ---------------------------------------------------------------- M5 bound


@pytest.mark.parametrize("m_far, ref_bound, ref_min", [(448, 0.017, 0.83), (7680, 0.229, 0.99),
                                                        (65024, 0.716, 0.998)])
def test_bound_values_and_never_violated(m_far, ref_bound, ref_min):
    r = bounds.simulate_bounded_logits(m_far, 64, 3.0, 50, seed=m_far)
    assert r["bound"] == pytest.approx(ref_bound, abs=6e-4)
    assert r["violations"] == 0
    assert r["min_far_mass"] == pytest.approx(ref_min, abs=0.04)


@pytest.mark.parametrize("dist", ["two-point", "adversarial"])
def test_bound_holds_for_extreme_bounded_logits_and_is_tight(dist):
    for lam in (0.0, 2.0, 6.0):
        r = bounds.simulate_bounded_logits(300, 16, lam, 20, seed=1, distribution=dist)
        assert r["violations"] == 0
        if dist == "adversarial":
            np.testing.assert_allclose(r["far_mass"], r["bound"], rtol=1e-12)


def test_bound_fails_without_bounded_premise():
    # ALiBi-like far logits far below -λ violate the premise, and then the "bound" no longer holds
    near = np.zeros((1, 16))
    far = np.full((1, 1000), -20.0)
    lam_near_only = 0.0
    assert bounds.far_mass_from_logits(near, far)[0] < bounds.far_mass_lower_bound(1000, 16, lam_near_only)


def test_bound_helpers():
    assert bounds.far_mass_lower_bound(0, 10, 1.0) == 0.0
    assert bounds.far_mass_lower_bound(1e6, 1, 400.0) == pytest.approx(0.0)  # no overflow warning/NaN
    l_max = bounds.max_safe_length(0.5, 64, 3.0, 96)
    assert bounds.far_mass_lower_bound(l_max - 96, 64, 3.0) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="eps"):
        bounds.max_safe_length(1.0, 64, 3.0, 96)
    with warnings.catch_warnings():  # unbounded logits (ALiBi, FoX): λ in the hundreds gives +inf, no overflow
        warnings.simplefilter("error")
        huge = bounds.max_safe_length(0.5, np.array([64.0, 64.0, 64.0]), np.array([3.0, 400.0, np.nan]), 96)
    assert huge[0] == pytest.approx(l_max) and huge[1] == np.inf and np.isnan(huge[2])
    with pytest.raises(ValueError, match="distribution"):
        bounds.simulate_bounded_logits(10, 2, 1.0, 1, distribution="normal")


# ---------------------------------------------------------------- M6 coherence


def test_incoherence_is_one_over_sqrt_m():
    m = [16, 64, 256, 1024]
    r = coherence.simulate_incoherence(m, trials=60, seed=0)
    np.testing.assert_allclose(r["qkv"], [0.247, 0.125, 0.062, 0.031], rtol=0.06)  # docs/theory.md#m6
    np.testing.assert_allclose(r["qkv"], 1 / np.sqrt(m), rtol=0.06)
    assert r["qk"] == [1.0] * 4


def test_incoherence_with_finite_window_matches_closed_form():
    m = np.array([16, 128])
    gamma = float(mixing.gamma_gaussian(1.0))
    r = coherence.simulate_incoherence(m, trials=300, step_sigma=1.0, seed=1)
    np.testing.assert_allclose(r["qkv"], coherence.predicted_coherence(m, gamma), rtol=0.06)
    # the closed form of Σ_{j,k} γ^{|j-k|}
    mm = 9
    brute = sum(gamma ** abs(j - k) for j in range(mm) for k in range(mm))
    assert coherence.predicted_coherence(mm, gamma) == pytest.approx(math.sqrt(brute) / mm)


def test_coherence_ratio_and_effective_count():
    b = np.array([1.0, 0.0, 0.0, 0.0])
    alpha = np.array([0.25, 0.25])
    angles = np.array([[0.0, 0.0], [np.pi, 0.0]])  # two opposite rotations of block 0 cancel
    assert coherence.coherence_ratio(alpha, angles, b) == pytest.approx(0.0, abs=1e-12)
    assert coherence.coherence_ratio(alpha, None, b) == pytest.approx(1.0)
    assert coherence.effective_far_count(alpha) == pytest.approx(2.0)
    x = np.array([1.0, 2.0, 3.0, 4.0])
    np.testing.assert_allclose(coherence.rotate_pairs(x, np.array([np.pi / 2, 0.0])), [-3.0, 2.0, 1.0, 4.0],
                               atol=1e-12)
