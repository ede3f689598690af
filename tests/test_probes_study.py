"""Figure summaries of the model study, on measurements of small random models (no trained runs needed)."""

import numpy as np
import pytest
import torch

from pathlab import ModelConfig, build_model
from pathlab.probes import study
from pathlab.probes.model import measure_model


@pytest.fixture(scope="module")
def meas():
    out = {}
    for name in ("rot_random_qk", "rot_random_qkv", "alibi", "rope"):
        torch.manual_seed(0)
        model = build_model(ModelConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, attention=name))
        out[name] = {}
        for L in (64, 256):
            windows = torch.randint(0, 64, (2, L), generator=torch.Generator().manual_seed(L))
            res = measure_model(model, windows, n_queries=6, span=32, near_windows=(8, 32), angle_lag=min(63, L - 1))
            res["block_size"] = 64
            out[name][L] = res
    return out


def test_summaries_have_bool_claims_and_expected_fields(meas):
    for fn in (study.far_mass_summary, study.bound_summary, study.score_summary, study.coherence_summary,
               study.learned_summary):
        data, claims = fn(meas)
        assert claims and all(isinstance(v, bool) for v in claims.values()), fn.__name__
        assert set(data["variants"]) == set(meas)
    data, claims = study.bound_summary(meas)
    assert claims["bound_never_violated"] is True  # a theorem: holds for any logits
    data, claims = study.coherence_summary(meas)
    assert claims["qk_kappa_is_one"] is True  # Q/K-only values are not transported: κ = 1 exactly
    assert np.all(np.asarray(data["variants"]["rot_random_qkv"]["kappa"]) <= 1 + 1e-9)
    data, _ = study.far_mass_summary(meas)
    r = data["variants"]["rot_random_qk"]
    assert np.array(r["measured"]).shape == (2, 2) and np.all(r["W"] == 8) and r["W"].shape == (2, 2)
    assert all(set(d["near_sets"]) == set(meas) for d in (data, study.score_summary(meas)[0]))


def test_far_mass_claims_follow_the_numbers(meas):
    fake = {"rot_random_qk": {}}
    for L, rho in ((64, 0.2), (256, 0.6), (1024, 0.9)):
        m = meas["rot_random_qk"][64]
        pq = {k: (None if v is None else np.array(v, copy=True)) for k, v in m["per_query"].items()}
        pq["far_mass"][:] = rho
        fake["rot_random_qk"][L] = {**m, "per_query": pq}
    _, claims = study.far_mass_summary(fake)
    assert claims["rot_random_qk_far_mass_rises_with_length"] is True
    fake["rot_random_qk"][1024]["per_query"]["far_mass"][:] = 0.1
    _, claims = study.far_mass_summary(fake)
    assert claims["rot_random_qk_far_mass_rises_with_length"] is False


def test_alibi_log_mean_exp_slope(meas):
    data, claims = study.score_summary(meas)
    fitted = np.array(data["alibi_log_mean_exp_slopes"]["fitted"])
    expected = np.array(data["alibi_log_mean_exp_slopes"]["minus_m_h"])
    # an untrained model's q·k is small, so log E e^s = −m_h n + const: the fitted slope is the ALiBi slope
    np.testing.assert_allclose(fitted, expected, rtol=0.1)
    assert claims["alibi_log_mean_exp_slope_is_minus_m_h"] is True
