"""Streamed logits and their accumulators against the fp64 reference (T×T) at small T, for every variant."""

import itertools
import math

import numpy as np
import pytest
import torch

from pathlab import available_attention

from pathlab import reference
from pathlab.attention.registry import build_attention
from pathlab.ops.positions import accumulate_phases, rotate
from pathlab.probes import learned, scores

VARIANTS = available_attention()  # every registered variant: a new one cannot be left out of the probes


def _inputs(name, T=37, H=4, Hkv=4, D=8, C=24, seed=0):
    torch.manual_seed(seed)
    module = build_attention(name, n_embd=C, n_head=H, n_kv_head=Hkv, head_dim=D, vocab_size=50)
    if getattr(module, "angle_proj", None) is not None:  # learned rotations: move away from RoPE
        torch.nn.init.normal_(module.angle_proj.weight, std=0.5)
    B = 2
    q, k, v = (torch.randn(B, T, h, D) for h in (H, Hkv, Hkv))
    x = torch.randn(B, T, C)
    idx = torch.randint(0, 50, (B, T))
    return module, q, k, v, x, idx


@pytest.mark.parametrize("name", VARIANTS)
def test_streamed_logits_match_reference(name):
    module, q, k, v, x, idx = _inputs(name, Hkv=2 if name in ("path", "alibi") else 4)
    with torch.no_grad():
        _, ref_logits, _ = module.reference(q, k, v, x=x, idx=idx)  # [B, H, T, T]
        T = q.shape[1]
        cases = [(torch.tensor([T - 1, 5, 0, 20]), 64), (torch.tensor([T - 1, 30, 33, 29]), 8),
                 (torch.tensor([T - 1, 30, 33, 29]), 64)]
        for (positions, ut_chunk), b in itertools.product(cases, range(q.shape[0])):
            layer = scores.prepare_layer(module, q, k, v, x, idx, b)
            got = torch.full((4, q.shape[2], T), -math.inf, dtype=torch.float64)
            for j0, s, raw in scores.iter_logit_chunks(layer, positions, chunk=10, ut_chunk=ut_chunk):
                got[:, :, j0:j0 + s.shape[-1]] = s
            want = ref_logits[b][:, positions].permute(1, 0, 2)  # [m, H, T]
            mask = (torch.arange(T)[None, :] <= positions[:, None])[:, None, :].expand_as(got)
            assert torch.isneginf(got[~mask]).all()
            torch.testing.assert_close(got[mask], want[mask], rtol=1e-9, atol=1e-9)


def _brute(module, name, q, k, v, x, idx, positions, W):
    """Far mass, gap, κ, bins from the full reference logits (numpy)."""
    _, logits, _ = module.reference(q, k, v, x=x, idx=idx)
    s = logits[0][:, positions].permute(1, 0, 2).numpy()  # [m, H, T]
    T = q.shape[1]
    dist = positions.numpy()[:, None] - np.arange(T)[None, :]
    valid = dist >= 0
    e = np.where(valid[:, None], np.exp(s), 0.0)
    near = (valid & (dist < W))[:, None]
    far = (valid & (dist >= W))[:, None]
    zn, zf = (e * near).sum(-1), (e * far).sum(-1)
    rho = zf / (zn + zf)
    alpha = e / (zn + zf)[..., None]
    m_eff = rho ** 2 / (alpha ** 2 * far).sum(-1)
    gap = np.log(zn) - np.log(zf / far.sum(-1))
    lam = np.where(valid[:, None], np.abs(s), 0).max(-1)
    vb = v[0].double()
    if module.score_terms(x[:1], idx[:1]).rotate_values:
        phase = accumulate_phases(module.angles(x[:1], idx[:1]), dim=1)[0]  # [T, H, D/2]
        bg = vb.mean(0)  # [H, D]
        kappa = np.zeros(rho.shape)
        for r, i in enumerate(positions.tolist()):
            for h in range(q.shape[2]):
                delta = (phase[i, h] - phase[:, h])  # Φ_i − Φ_j: [T, D/2]
                moved = rotate(bg[h][None].expand(T, -1), delta).numpy()  # P_{j→i} b̂
                weighted = ((alpha[r, h] * far[r, 0])[:, None] * moved).sum(0)  # Σ_F α_j P_{j→i} b̂
                kappa[r, h] = np.linalg.norm(weighted) / (rho[r, h] * bg[h].norm().item())
    else:
        kappa = np.ones(rho.shape)
    return s, dist, rho, gap, m_eff, lam, kappa


@pytest.mark.parametrize("name", ["rope", "fox", "path_fox", "rot_random_qk", "rot_random_qkv"])
def test_accumulator_matches_brute_force(name):
    module, q, k, v, x, idx = _inputs(name, T=45)
    q, k, v, x, idx = q[:1], k[:1], v[:1], x[:1], idx[:1]
    positions = torch.tensor([44, 40, 30, 12])
    W = 8
    edges = scores.distance_bin_edges(44)
    with torch.no_grad():
        (acc, _), = scores.probe_layer(module, q, k, v, x, idx, positions[None], edges=edges, windows=[W, 4],
                                       chunk=7)
        s, dist, rho, gap, m_eff, lam, kappa = _brute(module, name, q, k, v, x, idx, positions, W)
    pq = acc.per_query()
    np.testing.assert_allclose(pq["far_mass"][0], rho, rtol=1e-9)
    np.testing.assert_allclose(pq["gap"][0], gap, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(pq["m_eff"][0], m_eff, rtol=1e-9)
    np.testing.assert_allclose(pq["lam"][0], lam, rtol=1e-12)
    np.testing.assert_allclose(pq["kappa"], kappa, rtol=1e-8, atol=1e-12)
    # identity ρ_D = M_L / (M_L + e^Γ) and the M5 bound, which must hold for every query
    np.testing.assert_allclose(pq["far_mass"], pq["m_far"] / (pq["m_far"] + np.exp(pq["gap"])), rtol=1e-9)
    if name not in ("fox", "path_fox"):  # bounded-logit premise: ρ_D ≥ bound
        assert np.all(pq["far_mass"] >= pq["bound"] * (1 - 1e-12))
    # per-bin statistics
    pb = acc.per_bin()
    for kbin in range(len(edges) - 1):
        sel = (dist >= edges[kbin]) & (dist < edges[kbin + 1])
        vals = s.transpose(1, 0, 2)[:, sel]  # [H, n]
        if vals.shape[1] == 0:
            assert np.all(pb["count"][kbin] == 0)
            continue
        np.testing.assert_allclose(pb["count"][kbin], vals.shape[1])
        np.testing.assert_allclose(pb["mean"][kbin], vals.mean(1), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(pb["std"][kbin], vals.std(1), rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(pb["log_mean_exp"][kbin], np.log(np.exp(vals).mean(1)), rtol=1e-9)


def test_rho_s_is_one_for_rope_at_distance_zero_and_none_for_alibi():
    module, q, k, v, x, idx = _inputs("rope", T=30)
    edges = scores.distance_bin_edges(29)
    (acc, _), = scores.probe_layer(module, q[:1], k[:1], v[:1], x[:1], idx[:1], torch.tensor([[29, 20]]),
                                   edges=edges, windows=[4])
    np.testing.assert_allclose(acc.per_bin()["rho_s"][0], 1.0)
    module, q, k, v, x, idx = _inputs("alibi", T=30)
    (acc, _), = scores.probe_layer(module, q[:1], k[:1], v[:1], x[:1], idx[:1], torch.tensor([[29]]),
                                   edges=edges, windows=[4])
    assert acc.per_bin()["rho_s"] is None


def test_distance_bins():
    e = scores.distance_bin_edges(65535)
    assert e[0] == 0 and e[-1] == 65536 and np.all(np.diff(e) > 0) and len(e) < 80
    assert list(scores.distance_bin_edges(5)) == [0, 1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("short", [5, 8, 9, 10, 99, 100, 511, 4095])
def test_distance_bins_are_one_grid_at_every_length(short):
    # bin k covers the same distances at every L: the short grid, less its closing edge, is a prefix of the long one
    a, b = scores.distance_bin_edges(short), scores.distance_bin_edges(65535)
    assert a[-1] == short + 1 and np.all(np.diff(a) > 0)
    np.testing.assert_array_equal(a[:-1], b[:len(a) - 1])
    assert list(b[:9]) == list(range(9)) and {10, 100, 1000, 10000} <= set(b.tolist())


@pytest.mark.parametrize("name", ["path", "path_fox"])
def test_path_rho_s_matches_reference_without_transport(name):
    # s from the module's fp64 reference (gate included for PaTH-FoX); s⁰ from the reference with β = 0 (every
    # H_t = I) and no gate, i.e. q_i·k_j/√D. Queries 12…44 exercise the sequential region, keys 0…11 the UT region.
    module, q, k, v, x, idx = _inputs(name, T=45, Hkv=2 if name == "path" else 4)
    q, k, v, x, idx = q[:1], k[:1], v[:1], x[:1], idx[:1]
    positions = torch.tensor([44, 40, 30, 12])
    T, H, m = q.shape[1], q.shape[2], len(positions)
    edges = scores.distance_bin_edges(T - 1)
    with torch.no_grad():
        _, logits, _ = module.reference(q, k, v, x=x, idx=idx)
        w, beta, _ = module.path_inputs(x)
        _, logits0, _ = reference.path_attention(q, k, v, w, torch.zeros_like(beta), None, return_attention=True)
        want = logits[0][:, positions].permute(1, 0, 2)  # [m, H, T]
        want0 = logits0[0][:, positions].permute(1, 0, 2)
        valid = (torch.arange(T)[None, :] <= positions[:, None])[:, None, :].expand(m, H, T)
        layer = scores.prepare_layer(module, q, k, v, x, idx, 0)
        for chunk, ut_chunk in [(7, 64), (10, 5), (24, 5), (64, 4)]:  # one, several and batched UT chunks
            got = torch.full((m, H, T), math.nan, dtype=torch.float64)
            got0 = got.clone()
            for j0, s, raw in scores.iter_logit_chunks(layer, positions, chunk=chunk, ut_chunk=ut_chunk):
                got[:, :, j0:j0 + s.shape[-1]], got0[:, :, j0:j0 + s.shape[-1]] = s, raw
            assert torch.isneginf(got[~valid]).all()
            torch.testing.assert_close(got[valid], want[valid], rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(got0[valid], want0[valid], rtol=1e-9, atol=1e-9)
        (acc, _), = scores.probe_layer(module, q, k, v, x, idx, positions[None], edges=edges, windows=[8], chunk=7)
    dist = (positions[:, None] - torch.arange(T)[None, :]).numpy()  # [m, T]
    sel = dist >= 0
    pairs = lambda t: t.permute(0, 2, 1).numpy()[sel]  # noqa: E731  [P, H]
    expected = learned.score_decorrelation(pairs(want), pairs(want0), dist[sel], edges)
    rho_s = acc.per_bin()["rho_s"]
    np.testing.assert_allclose(rho_s, expected, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(rho_s[0], 1.0)  # s_ii = s⁰_ii: no transport and no gate at distance 0
