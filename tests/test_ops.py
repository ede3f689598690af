"""Fast paths of the softmax-family ops against their fp64 references: output and every gradient."""

import pytest
import torch
import torch.nn.functional as F

import pathlab
import pathlab.ops.softmax as softmax_ops
from pathlab import reference
from pathlab.testing import assert_matches_reference, rel_err


def _inputs(B, T, H, Hkv, D, dtype, seed):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()

    q, k, v = randn(B, T, H, D), randn(B, T, Hkv, D), randn(B, T, Hkv, D)
    theta = (torch.rand(B, T, H, D // 2, generator=gen, dtype=torch.float64) * 2).to(dtype).requires_grad_()
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen, dtype=torch.float64) + 2).to(dtype).requires_grad_()
    return q, k, v, theta, g


OPS = {
    "nope": (lambda q, k, v, th, g: pathlab.nope_attention(q, k, v), lambda q, k, v, th, g: reference.nope_attention(q, k, v)),
    "rope": (lambda q, k, v, th, g: pathlab.rope_attention(q, k, v, base=500.0),
             lambda q, k, v, th, g: reference.rope_attention(q, k, v, base=500.0)),
    "rot_qk": (lambda q, k, v, th, g: pathlab.rotation_attention(q, k, v, th),
               lambda q, k, v, th, g: reference.rotation_attention(q, k, v, th)),
    "rot_qkv": (lambda q, k, v, th, g: pathlab.rotation_attention(q, k, v, th, rotate_values=True),
                lambda q, k, v, th, g: reference.rotation_attention(q, k, v, th, rotate_values=True)),
    "alibi": (lambda q, k, v, th, g: pathlab.alibi_attention(q, k, v), lambda q, k, v, th, g: reference.alibi_attention(q, k, v)),
    "fox": (lambda q, k, v, th, g: pathlab.fox_attention(q, k, v, g), lambda q, k, v, th, g: reference.fox_attention(q, k, v, g)),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("shape", [(2, 1, 2, 2, 8), (1, 77, 4, 2, 16), (2, 130, 2, 1, 8)],
                         ids=["T1", "T77-gqa", "T130-mqa"])
@pytest.mark.parametrize("op", list(OPS))
def test_fast_matches_reference(op, shape, dtype, monkeypatch):
    monkeypatch.setattr(softmax_ops, "CPU_QUERY_CHUNK", 48)  # several query chunks on the CPU bias path
    B, T, H, Hkv, D = shape
    fast, ref = OPS[op]
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    assert_matches_reference(fast, ref, _inputs(B, T, H, Hkv, D, dtype, seed=T + H), tol, ("q", "k", "v", "theta", "g"))


def test_rotation_phases_stay_accurate_at_long_range():
    """Φ is accumulated in fp64 and reduced mod 2π, so fp32 cos/sin stay exact far out (65K positions)."""
    from pathlab.ops.positions import accumulate_phases, rope_phases

    T, D = 65536, 8
    theta = torch.full((1, T, 1, D // 2), 1.0)  # ω = 1 steps: Φ reaches 65536 rad
    phase = accumulate_phases(theta, dim=1)
    assert float(phase.max()) < 2 * torch.pi
    exact = torch.remainder(torch.arange(1, T + 1, dtype=torch.float64), 2 * torch.pi)
    assert torch.allclose(phase[0, :, 0, 0], exact, atol=1e-9)
    far = torch.cos(phase[0, -1, 0, 0].float()).double()
    assert abs(far - torch.cos(torch.tensor(65536.0, dtype=torch.float64))) < 1e-6
    assert float(rope_phases(T, D).max()) < 2 * torch.pi


def test_a_failing_flex_attention_falls_back_loudly(monkeypatch):
    """If FlexAttention breaks on a GPU, ALiBi and FoX warn once and use the chunked bias path (same result)."""
    calls = []

    def broken_flex(*args):
        calls.append(1)
        raise RuntimeError("simulated compiler failure")

    monkeypatch.setattr(softmax_ops, "_flex_failure", None)
    monkeypatch.setattr(softmax_ops, "_flex", broken_flex)
    monkeypatch.setattr(softmax_ops, "_use_flex", lambda q: softmax_ops._flex_failure is None)
    q, k, v, theta, g = _inputs(1, 40, 2, 2, 8, torch.float64, seed=9)
    with pytest.warns(RuntimeWarning, match="FlexAttention failed .*simulated compiler failure"):
        out = pathlab.fox_attention(q, k, v, g)
    assert rel_err(out, reference.fox_attention(q, k, v, g)) < 1e-10
    out = pathlab.alibi_attention(q, k, v)  # no second attempt, no second warning
    assert rel_err(out, reference.alibi_attention(q, k, v)) < 1e-10
    assert len(calls) == 1


def test_flex_attention_takes_half_precision_on_cuda_only():
    """fp32 and fp64 inputs (the probes' forward) take the chunked SDPA: FlexAttention multiplies fp32 operands off
    the tensor cores. On the CPU every dtype does (FlexAttention has no CPU backward)."""
    route = softmax_ops._flex_route
    assert route("cuda", torch.bfloat16) and route("cuda", torch.float16)
    assert not route("cuda", torch.float32) and not route("cuda", torch.float64)
    assert not any(route("cpu", dtype) for dtype in (torch.bfloat16, torch.float16, torch.float32))


def test_flex_attention_stays_compiled_across_many_shapes():
    """An evaluation calls FlexAttention at many (B, T): past the compiler's recompile limit (8 shapes) a
    static-shape compile runs ``flex_attention`` unfused, on the full B·H·T² scores (which at 65K tokens no GPU
    holds). Ten shapes on the CPU stay compiled and match the chunked bias SDPA."""
    import warnings

    from pathlab.ops.positions import alibi_slopes

    H = 2
    slopes = alibi_slopes(H)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    def bias_fn(i, j):
        return -slopes[None, :, None, None] * (i[:, None] - j[None, :]).float()

    gen = torch.Generator().manual_seed(3)
    for B, T in [(2, 128), (1, 256), (4, 128), (1, 512), (2, 256), (8, 128), (1, 1024), (3, 128), (1, 2048),
                 (2, 200)]:
        q, k, v = (torch.randn(B, T, H, 16, generator=gen) for _ in range(3))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = softmax_ops._flex(q, k, v, 0.25, score_mod)
        unfused = [str(w.message)[:80] for w in caught if "without torch.compile" in str(w.message)]
        assert not unfused, (B, T, unfused)
        assert rel_err(out, softmax_ops._chunked_bias_sdpa(q, k, v, 0.25, bias_fn)) < 1e-5, (B, T)


@pytest.mark.parametrize("T", [1, 100, 128, 300, 1000])
def test_causal_block_mask_is_the_causal_mask(T):
    """The block mask built from its block structure equals create_block_mask's and attends causally."""
    import warnings

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    built = softmax_ops._causal_block_mask(T, "cpu")
    dense = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, T, T, device="cpu")
    assert built.seq_lengths == (T, T)
    assert torch.equal(built.to_dense(), dense.to_dense())
    q, k, v = (torch.randn(1, 2, T, 16) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unfused CPU flex_attention warns that it is unfused
        out = flex_attention(q, k, v, block_mask=built)
    assert rel_err(out, F.scaled_dot_product_attention(q, k, v, is_causal=True)) < 1e-5
