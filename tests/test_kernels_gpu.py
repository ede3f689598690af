"""GPU tests of the Triton PaTH kernel (bf16, long sequences) and of decoding on CUDA. Run with ``pytest -m gpu``.

Tolerances are relative RMS errors against an fp64 oracle (the explicit reference for T ≤ 512, the blockwise
PyTorch algorithm in fp64 beyond), as the public kernel passes them with bf16 inputs and β ∈ [1.5, 2]:
o ≤ 5e-3, dq/dk/dv ≤ 8e-3, dw ≤ 1.5e-2, dβ/dg ≤ 2e-2.
"""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

TOL = {"o": 5e-3, "dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dw": 1.5e-2, "dbeta": 2e-2, "dg": 2e-2}


def rel_rms(a, b):
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


def inputs(B, T, H, Hkv, D, *, beta_range=(1.5, 2.0), gate=True, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q, k, v = r(B, T, H, D).bfloat16(), r(B, T, Hkv, D).bfloat16(), r(B, T, Hkv, D).bfloat16()
    w = r(B, T, Hkv, D)
    lo, hi = beta_range
    beta = lo + (hi - lo) * torch.rand(B, T, Hkv, device="cuda", generator=gen)
    g = F.logsigmoid(3.0 + r(B, T, H)) if gate else None
    return q, k, v, w, beta, g


def grads_of(fn, leaves, do):
    leaves = [t.detach().requires_grad_() for t in leaves]
    o = fn(*leaves)
    return [o.detach()] + [x.detach() for x in torch.autograd.grad(o, leaves, do)]


@pytest.mark.parametrize("T,oracle", [(300, "reference"), (4096, "torch"), (16384, "torch")],
                         ids=["T300-ref", "T4096-blockwise64", "T16384-blockwise64"])
@pytest.mark.parametrize("gate", [False, True], ids=["path", "path_fox"])
def test_bf16_against_oracle(T, oracle, gate):
    import pathlab
    from pathlab.reference import path_attention as reference

    H, Hkv, D = (4, 2, 64) if T <= 4096 else (2, 1, 64)
    q, k, v, w, beta, g = inputs(1, T, H, Hkv, D, gate=gate)
    leaves = [q, k, v, w, beta] + ([g] if gate else [])
    do = torch.randn(1, T, H, D, device="cuda").bfloat16()

    def fast(*xs):
        return pathlab.path_attention(*xs[:5], xs[5] if gate else None, backend="triton")

    def slow(*xs):
        xs = [x.double() for x in xs]
        if oracle == "reference":
            return reference(*xs[:5], xs[5] if gate else None)
        return pathlab.path_attention(*xs[:5], xs[5] if gate else None, backend="torch", chunk_size=256)

    got = grads_of(fast, leaves, do)
    want = grads_of(slow, leaves, do.double())
    names = ["o", "dq", "dk", "dv", "dw", "dbeta"] + (["dg"] if gate else [])
    errs = {n: rel_rms(a, b) for n, a, b in zip(names, got, want)}
    print(f"T={T} gate={gate} errors: {errs}")
    for n, e in errs.items():
        assert e <= TOL[n], f"{n}: relative RMS error {e:.3g} > {TOL[n]} (all: {errs})"


def test_long_sequence_beta_near_two_is_finite():
    import pathlab

    q, k, v, w, beta, g = inputs(1, 65536, 4, 4, 128, beta_range=(1.9, 1.999), gate=True)
    leaves = [t.requires_grad_() for t in (q, k, v, w, beta, g)]
    o = pathlab.path_attention(*leaves, backend="triton")
    o.backward(torch.randn_like(o))
    assert torch.isfinite(o).all()
    for name, t in zip("q k v w beta g".split(), leaves):
        assert torch.isfinite(t.grad).all(), f"d{name} has NaN/inf"


@pytest.mark.parametrize("gate", [False, True], ids=["path", "path_fox"])
def test_prefill_then_512_steps_match_parallel_form(gate):
    import pathlab
    from pathlab.decoding import PathDecodeCache

    T0, N, H, Hkv, D = 1024, 512, 4, 2, 64
    q, k, v, w, beta, g = inputs(2, T0 + N, H, Hkv, D, beta_range=(0.0, 2.0), gate=gate)
    full = pathlab.path_attention(q.float(), k.float(), v.float(), w, beta, g, backend="torch")
    cache = PathDecodeCache(2, Hkv, T0 + N, D, D, n_heads=H, device="cuda")
    sl = lambda t, a, b: None if t is None else t[:, a:b]  # noqa: E731
    outs = [cache.prefill(*(sl(t, 0, T0).float() if t.dtype == torch.bfloat16 else sl(t, 0, T0)
                            for t in (q, k, v, w, beta)), sl(g, 0, T0))]
    for t in range(T0, T0 + N):
        outs.append(cache.step(*(sl(x, t, t + 1).float() for x in (q, k, v, w, beta)), sl(g, t, t + 1)))
    o = torch.cat(outs, 1)
    err = (o - full).abs().max().item() / full.abs().max().item()
    assert err <= 2e-3, f"decode vs parallel form: max error {err:.3g} relative to max |o|"
