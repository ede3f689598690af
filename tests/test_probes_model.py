"""Model-level probes: hooks + streamed statistics against the model's own T×T attention records; M2 angle stats."""

import numpy as np
import pytest
import torch

from pathlab import ModelConfig, build_model
from pathlab.probes import learned, mixing
from pathlab.probes.model import measure_model, sample_query_positions


@pytest.mark.parametrize("attention", ["rot_random_qkv", "path_fox", "alibi"])
def test_measure_model_far_mass_matches_attention_records(attention):
    torch.manual_seed(1)
    model = build_model(ModelConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, attention=attention))
    windows = torch.randint(0, 64, (2, 50))
    W = 6
    res = measure_model(model, windows, n_queries=5, span=20, near_windows=(W,), chunk=16)
    with torch.no_grad():
        _, _, records = model(windows, return_attention=True)
    pos = res["positions"]  # [B, m]
    for layer, rec in enumerate(records):
        probs = rec.probs.numpy()  # [B, H, T, T]
        expected = []
        for b in range(2):
            for i in pos[b]:
                far = probs[b, :, i, : i - W + 1].sum(-1) if i - W + 1 > 0 else np.zeros(2)
                expected.append(far)
        np.testing.assert_allclose(res["per_query"]["far_mass"][layer, 0], np.array(expected), rtol=1e-6,
                                   atol=1e-12)
    n_layer, n_head = 2, 2
    assert res["per_bin"]["count"].sum() == n_layer * n_head * sum(i + 1 for b in range(2) for i in pos[b])


def test_sample_query_positions():
    p = sample_query_positions(1000, 64, 512, 3, seed=4)
    assert p.shape == (3, 64) and p.min() >= 488 and p.max() < 1000
    assert all(len(set(row.tolist())) == 64 for row in p)
    assert torch.equal(p, sample_query_positions(1000, 64, 512, 3, seed=4))
    assert sample_query_positions(10, 64, 4, 1).shape == (1, 4)
    with pytest.raises(ValueError, match="span"):
        sample_query_positions(10, 4, 11, 1)


def test_phase_autocorrelation_brute_force():
    theta = torch.randn(2, 30, 1, 3) * 0.7
    c = learned.phase_autocorrelation(theta, 10)
    phi = torch.cumsum(theta.double(), 1)
    for n in (1, 4, 10):
        z = torch.exp(1j * (phi[:, n:] - phi[:, :-n]))
        np.testing.assert_allclose(c[n - 1], z.mean(dim=(0, 1)).abs().numpy(), rtol=1e-10)


def test_angle_statistics_iid_and_constant():
    g = torch.Generator().manual_seed(0)
    theta = torch.cat([torch.randn(4, 4000, 1, 1, generator=g) * 1.0, torch.full((4, 4000, 1, 1), 0.3)], dim=3)
    st = learned.angle_statistics(theta, 40)
    assert st["gamma"][0, 0] == pytest.approx(np.exp(-0.5), abs=0.02)
    assert st["gamma"][0, 1] == pytest.approx(1.0)
    np.testing.assert_allclose(st["coherence"][:5, 0, 0], np.exp(-0.5) ** np.arange(1, 6), atol=0.03)
    assert st["W_pred"][0, 0] == mixing.mixing_window(st["gamma"][0, 0]) and np.isinf(st["W_emp"][0, 1])
    assert abs(st["W_emp"][0, 0] - 6) <= 2
