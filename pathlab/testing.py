"""Helpers for comparing implementations: relative errors and random inputs of every op."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / max(‖expected‖, tiny), computed in fp64; NaN anywhere gives inf."""
    a, e = actual.detach().double(), expected.detach().double()
    if not bool(torch.isfinite(a).all()):
        return float("inf")
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()


def random_path_inputs(B, T, H, D, *, Hkv=None, Dv=None, dtype=torch.float32, device="cpu", beta_range=(0.0, 2.0),
                       gate=False, generator=None, requires_grad=False):
    """q, k, v, w, beta, g for PaTH with beta ~ U(beta_range) and g = log σ(N(0, 1)) (or None)."""
    Hkv = H if Hkv is None else Hkv
    Dv = D if Dv is None else Dv

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(device=device, dtype=dtype)

    q, k, w, v = randn(B, T, H, D), randn(B, T, Hkv, D), randn(B, T, Hkv, D), randn(B, T, Hkv, Dv)
    lo, hi = beta_range
    beta = (lo + (hi - lo) * torch.rand(B, T, Hkv, generator=generator, dtype=torch.float64)).to(device, dtype)
    g = F.logsigmoid(randn(B, T, H) + 2.0) if gate else None
    tensors = [q, k, v, w, beta, g]
    if requires_grad:
        for t in tensors:
            if t is not None:
                t.requires_grad_(True)
    return tensors


def grads_of(fn, leaves, do) -> list[torch.Tensor]:
    """``[fn(*leaves), d leaf_1, d leaf_2, …]`` (detached) for the output gradient ``do``; the leaves are detached
    copies, so the caller's tensors are not touched."""
    leaves = [t.detach().requires_grad_() for t in leaves]
    out = fn(*leaves)
    return [out.detach()] + [g.detach() for g in torch.autograd.grad(out, leaves, do)]


def grad_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / max(‖expected‖, 1): a relative error with a floor, so gradients that should be zero
    (an input an op ignores, dq at T = 1) must come out as zero up to rounding."""
    return ((actual.detach().double() - expected.detach().double()).norm() / expected.detach().double().norm()
            .clamp_min(1.0)).item()


def assert_matches_reference(fast, reference, inputs, tol: float, names) -> None:
    """Run ``fast(*inputs)`` and ``reference`` on fp64 copies; compare the output (relative error) and the gradient
    of every input (:func:`grad_err`) for one random output gradient, each below ``tol``."""
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    out, out_ref = fast(*inputs), reference(*ref_inputs)
    assert rel_err(out, out_ref) < tol, f"output: {rel_err(out, out_ref):.2e}"
    d_out = torch.randn_like(out_ref)
    grads = torch.autograd.grad(out, inputs, d_out.to(out.dtype), allow_unused=True, materialize_grads=True)
    grads_ref = torch.autograd.grad(out_ref, ref_inputs, d_out, allow_unused=True, materialize_grads=True)
    for name, got, want in zip(names, grads, grads_ref):
        assert grad_err(got, want) < tol, f"d{name}: {grad_err(got, want):.2e}"


def train_on_repeated_pattern(model, steps: int, *, lr: float = 3e-3, seed: int = 1, check=None) -> list[float]:
    """Train ``model`` with AdamW on a random 8-token pattern repeated six times (learnable from context alone)
    and return the losses; every gradient must be finite, and ``check(model)`` runs after each backward."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, model.config.vocab_size, (4, 8), generator=gen).repeat(1, 6)
    idx, targets = data[:, :-1], data[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        _, loss = model(idx, targets)
        opt.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        if check is not None:
            check(model)
        opt.step()
        losses.append(loss.item())
    return losses


def assert_cached_generation_matches(model, vocab_size: int, *, prompt_len: int = 7, new_tokens: int = 12):
    """Greedy generation with the KV cache equals generation by full recomputation, and the logits of a prefill
    plus one cached step per token equal the full forward at every generated position. Returns the caches of
    that stepped run (for checks of a variant's cache state)."""
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, vocab_size, (2, prompt_len), generator=gen)
    cached = model.generate(prompt, new_tokens, temperature=0)
    assert cached.shape == (2, prompt_len + new_tokens)
    assert torch.equal(cached, model.generate(prompt, new_tokens, temperature=0, use_cache=False))
    end = prompt_len + new_tokens - 1
    logits, _ = model(cached)
    caches = [b.attn.positional.new_cache(2, end + 1, device="cpu", dtype=torch.float64) for b in model.blocks]
    stepped = [model._forward_cached(cached[:, :prompt_len], caches, prefill=True)]
    for t in range(prompt_len, end):
        stepped.append(model._forward_cached(cached[:, t : t + 1], caches, prefill=False))
    assert torch.allclose(torch.stack(stepped, 1), logits[:, prompt_len - 1 : end], atol=1e-5)
    return caches
