"""Model-level probes: hooks + streamed statistics against the model's own T×T attention records; M2 angle stats."""

import numpy as np
import pytest
import torch

from pathlab import ModelConfig, build_model
from pathlab._checks import expand_kv_heads
from pathlab.probes import learned, mixing, scores
from pathlab.probes.model import measure_model, positional_hooks, run_blocks, sample_query_positions


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


@pytest.mark.parametrize("attention", ["path", "path_fox"])
def test_measure_model_path_rho_s_matches_attention_records(attention):
    # ρ_s(n) = Σ s·s⁰ / Σ (s⁰)² per bin, s from the fp64 reference records (PaTH-FoX: gate included),
    # s⁰ = q_i·k_j/√D from the q, k that the same reference forward saw
    torch.manual_seed(5)
    model = build_model(ModelConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, attention=attention))
    windows = torch.randint(0, 64, (2, 90))
    res = measure_model(model, windows, n_queries=6, span=30, near_windows=(6,), chunk=16)
    qk = {}

    def grab(layer, module, q, k, v, x, idx):
        qk[layer] = (q.double(), expand_kv_heads(k, q.shape[2]).double())

    with torch.no_grad(), positional_hooks(model, grab):
        _, _, records = model(windows, return_attention=True)
    pos = res["positions"]
    for layer, rec in enumerate(records):
        q, k = qk[layer]
        s0 = torch.einsum("bihd,bjhd->bhij", q, k) * q.shape[-1] ** -0.5
        s, s_raw, dist = [], [], []
        for b in range(2):
            for i in pos[b]:
                s.append(rec.logits[b, :, i, : i + 1].T.numpy())  # [i + 1, H]
                s_raw.append(s0[b, :, i, : i + 1].T.numpy())
                dist.append(i - np.arange(i + 1))
        expected = learned.score_decorrelation(np.concatenate(s), np.concatenate(s_raw), np.concatenate(dist),
                                               res["edges"])
        np.testing.assert_allclose(res["per_bin"]["rho_s"][layer], expected, rtol=1e-5, atol=1e-8)


def _assert_same_measurement(want: dict, got: dict, rtol: float = 1e-8):
    """Every per_bin / per_query array equal to ``rtol`` (with a floor of 1e-12 × the array's largest finite
    magnitude), NaN and ±inf in the same places; None where the other is None."""
    for part in ("per_bin", "per_query"):
        assert want[part].keys() == got[part].keys()
        for key, a in want[part].items():
            b = got[part][key]
            if a is None or b is None:
                assert a is None and b is None, f"{part}[{key!r}]"
                continue
            finite = np.abs(a[np.isfinite(a)])
            floor = 1e-12 * (finite.max() if finite.size else 1.0)
            np.testing.assert_allclose(b, a, rtol=rtol, atol=floor, equal_nan=True, err_msg=f"{part}[{key!r}]")


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["rope", "alibi", "fox", "path", "path_fox", "rot_random_qk",
                                       "rot_random_qkv"])
def test_measure_model_on_cuda_matches_cpu(attention):
    # The model is fp64 and every layer attends through its fp64 reference path on both devices, so the two
    # runs see the same q, k, v to rounding: what is compared is the streamed statistics alone (on the GPU with
    # its default, larger key chunk; on the CPU with many small chunks).
    torch.manual_seed(4)
    model = build_model(ModelConfig(n_layer=3, n_head=2, n_embd=32, vocab_size=64, attention=attention)).double()
    for block in model.blocks:
        pos = block.attn.positional
        pos.attend = lambda q, k, v, *, x, idx=None, pos=pos: pos.reference(q, k, v, x=x, idx=idx)[0]
    windows = torch.randint(0, 64, (2, 400))
    kw = dict(n_queries=16, span=64, near_windows=(8, np.full((3, 2), 32)))
    want = measure_model(model, windows, chunk=48, **kw)
    got = measure_model(model.cuda(), windows, **kw)
    np.testing.assert_array_equal(got["edges"], want["edges"])
    _assert_same_measurement(want, got)
    # the accumulators and the logits of a layer live on the GPU
    inputs = {}
    with torch.no_grad(), positional_hooks(model, lambda layer, *a: inputs.setdefault(layer, a)):
        run_blocks(model, windows[:1].cuda())
    module, q, k, v, x, idx = inputs[0]
    (acc, layer), = scores.probe_layer(module, q, k, v, x, idx, torch.as_tensor(want["positions"][:1]),
                                       edges=want["edges"], windows=[8])
    held = [t for t in vars(acc).values() if isinstance(t, torch.Tensor)]
    assert held and all(t.device.type == "cuda" for t in held)
    assert all(s.is_cuda and (raw is None or raw.is_cuda) for _, s, raw in scores.iter_logit_chunks(
        layer, torch.as_tensor(want["positions"][0])))


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
