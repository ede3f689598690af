"""Identities that tie the variants together, in fp64 on the CPU."""

import math

import pytest
import torch
import torch.nn.functional as F

import pathlab
from pathlab import reference
from pathlab.ops.positions import rope_frequencies
from pathlab.testing import random_path_inputs, rel_err


def _qkv(B=2, T=40, H=4, D=8, Hkv=None, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    Hkv = H if Hkv is None else Hkv
    return (torch.randn(B, T, H, D, generator=gen, dtype=dtype), torch.randn(B, T, Hkv, D, generator=gen, dtype=dtype),
            torch.randn(B, T, Hkv, D, generator=gen, dtype=dtype))


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_path_with_beta_zero_is_nope(backend):
    q, k, v, w, beta, g = random_path_inputs(2, 37, 2, 8, dtype=torch.float64, beta_range=(0.0, 0.0), gate=True)
    assert rel_err(pathlab.path_attention(q, k, v, w, beta, backend=backend), reference.nope_attention(q, k, v)) < 1e-12
    # and PaTH-FoX with β = 0 is FoX
    assert rel_err(pathlab.path_attention(q, k, v, w, beta, g, backend=backend), reference.fox_attention(q, k, v, g)) < 1e-12


def test_path_with_beta_two_applies_reflections():
    """β = 2 makes every H_t a reflection (H² = I): with one fixed w, n reflections are I for even n, H for odd n."""
    B, T, H, D = 1, 12, 1, 6
    q, k, v = _qkv(B, T, H, D)
    w_dir = F.normalize(torch.randn(D, dtype=torch.float64), dim=0)
    w = w_dir.expand(B, T, H, D).clone()
    beta = torch.full((B, T, H), 2.0, dtype=torch.float64)
    _, logits, _ = reference.path_attention(q, k, v, w, beta, return_attention=True)
    reflection = torch.eye(D, dtype=torch.float64) - 2 * torch.outer(w_dir, w_dir)
    assert torch.allclose(reflection @ reflection, torch.eye(D, dtype=torch.float64))
    for i in range(T):
        for j in range(i + 1):
            transport = torch.eye(D, dtype=torch.float64) if (i - j) % 2 == 0 else reflection
            expected = q[0, i, 0] @ transport @ k[0, j, 0] / math.sqrt(D)
            assert torch.isclose(logits[0, 0, i, j], expected, atol=1e-12)
    # the blockwise path agrees, and orthogonal transport bounds every logit by ‖q‖‖k‖/√D
    assert rel_err(pathlab.path_attention(q, k, v, w, beta, backend="torch", chunk_size=5),
                   reference.path_attention(q, k, v, w, beta)) < 1e-12
    bound = q.norm(dim=-1)[0, :, 0, None] * k.norm(dim=-1)[0, None, :, 0] / math.sqrt(D)
    assert bool((logits[0, 0].tril().abs() <= bound + 1e-12).all())


@pytest.mark.parametrize("rotate_values", [False, True])
def test_constant_angle_accumulated_rotation_is_rope(rotate_values):
    q, k, v = _qkv()
    theta = rope_frequencies(q.shape[-1]).expand(*q.shape[:3], -1).clone()
    rope = reference.rope_attention(q, k, v)
    if not rotate_values:
        assert rel_err(pathlab.rotation_attention(q, k, v, theta), rope) < 1e-12
        assert rel_err(reference.rotation_attention(q, k, v, theta), rope) < 1e-12
    assert rel_err(pathlab.rope_attention(q, k, v), rope) < 1e-12


def test_rope_logits_depend_only_on_distance():
    B, T, H, D = 1, 30, 2, 8
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 1, H, D, generator=gen, dtype=torch.float64).expand(B, T, H, D)
    k = torch.randn(1, 1, H, D, generator=gen, dtype=torch.float64).expand(B, T, H, D)
    _, logits, _ = reference.rope_attention(q, k, k, return_attention=True)
    for n in range(T):
        diagonal = torch.diagonal(logits, offset=-n, dim1=-2, dim2=-1)
        assert torch.allclose(diagonal, diagonal[..., :1].expand_as(diagonal), atol=1e-12)
    assert not torch.allclose(logits[0, 0, 5, 5], logits[0, 0, 5, 2])  # but not constant across distances


def test_qkv_rotation_with_one_hot_attention_transports_the_value():
    """If query i attends only to key 0, the Q/K/V output is R(Φ_i − Φ_0) v_0."""
    B, T, H, D = 1, 9, 2, 6
    gen = torch.Generator().manual_seed(2)
    theta = torch.rand(B, T, H, D // 2, generator=gen, dtype=torch.float64) * 3
    phi = torch.cumsum(theta, dim=1)
    k = torch.zeros(B, T, H, D, dtype=torch.float64)
    k[:, 0] = torch.randn(B, H, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, T, H, D, generator=gen, dtype=torch.float64)

    def rot(x, angle):  # R(angle) on half-split pairs
        half = D // 2
        c, s = torch.cos(angle), torch.sin(angle)
        return torch.cat((x[..., :half] * c - x[..., half:] * s, x[..., :half] * s + x[..., half:] * c), -1)

    q = 200.0 * rot(k[:, :1], phi - phi[:, :1])  # q_i = c R(Φ_i − Φ_0) k_0 maximises the logit to key 0
    o = pathlab.rotation_attention(q, k, v, theta, rotate_values=True)
    expected = rot(v[:, :1], phi - phi[:, :1])
    assert rel_err(o[:, 1:], expected[:, 1:]) < 1e-8
    # Q/K only returns the untransported value
    assert rel_err(pathlab.rotation_attention(q, k, v, theta)[:, 1:], v[:, :1].expand(B, T - 1, H, D)) < 1e-8


def test_alibi_slopes_match_the_paper():
    assert pathlab.alibi_slopes(8).tolist() == [2.0 ** -(i + 1) for i in range(8)]
    expected_12 = [0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625,
                   0.7071, 0.3536, 0.1768, 0.0884]
    assert torch.allclose(pathlab.alibi_slopes(12), torch.tensor(expected_12), atol=1e-4)


def test_fox_with_constant_gates_is_alibi():
    """Σ_{l=j+1}^{i} log f_l with log f ≡ −m_h is exactly ALiBi's −m_h (i − j)."""
    q, k, v = _qkv(H=8)
    slopes = pathlab.alibi_slopes(8).double()
    g = (-slopes).expand(q.shape[0], q.shape[1], 8).clone()
    assert rel_err(pathlab.fox_attention(q, k, v, g), reference.alibi_attention(q, k, v)) < 1e-12
    assert rel_err(reference.fox_attention(q, k, v, g), reference.alibi_attention(q, k, v)) < 1e-12


def test_probabilities_are_causal_and_normalised():
    q, k, v, w, beta, g = random_path_inputs(1, 20, 2, 8, dtype=torch.float64, gate=True)
    _, logits, probs = reference.path_attention(q, k, v, w, beta, g, return_attention=True)
    assert torch.allclose(probs.sum(-1), torch.ones_like(probs.sum(-1)))
    assert bool((probs.triu(1) == 0).all()) and bool(torch.isneginf(logits.triu(1)[..., 0, 1:]).all())
