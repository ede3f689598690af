"""A variant is one file: a variant written and registered here, and nowhere else, trains (model, task runner,
suite) and is probed (streamed score probes, M2 windows) without any other module knowing its name."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from pathlab import ModelConfig, available_attention, build_model
from pathlab._checks import expand_kv_heads
from pathlab.attention import PositionalAttention, ScoreTerms, register_attention
from pathlab.attention.registry import REGISTRY
from pathlab.ops.positions import alibi_slopes, rope_phases, rotate
from pathlab.probes import scores
from pathlab.probes.model import learned_head_windows, measure_model, positional_hooks, run_blocks

NAME = "toy_slope_rotary"


class SlopeRotary(PositionalAttention):
    """RoPE phases plus a learned distance bias: s_ij = R(−Φ_i)q_i · R(−Φ_j)k_j / √D − m_h (i − j), m_h = e^{a_h}.

    Plain PyTorch, T×T, fp64: the fast path is the reference path (a throwaway variant needs no kernel)."""

    even_head_dim = True

    def __init__(self, *, base: float = 100.0, **common):
        super().__init__(**common)
        self.base = float(base)
        self.log_slope = nn.Parameter(torch.log(alibi_slopes(self.n_head)))

    def score_terms(self, x, idx=None):
        B, T = x.shape[:2]
        phase = rope_phases(T, self.head_dim, self.base, device=x.device)[None, :, None, :]
        return ScoreTerms(phase=phase.expand(B, T, self.n_head, self.head_dim // 2), slopes=self.log_slope.exp())

    def reference(self, q, k, v, *, x, idx=None):
        terms = self.score_terms(x, idx)
        H, T = self.n_head, q.shape[1]
        qr = rotate(q.double(), -terms.phase)
        kr = rotate(expand_kv_heads(k, H).double(), -terms.phase)
        dist = (torch.arange(T, device=q.device)[:, None] - torch.arange(T, device=q.device)[None, :]).double()
        logits = torch.einsum("bihd,bjhd->bhij", qr, kr) * self.head_dim ** -0.5
        logits = (logits - terms.slopes.double()[:, None, None] * dist).masked_fill(dist < 0, -math.inf)
        probs = torch.softmax(logits, dim=-1)
        o = torch.einsum("bhij,bjhd->bihd", probs, expand_kv_heads(v, H).double())
        return o.to(q.dtype), logits, probs

    def attend(self, q, k, v, *, x, idx=None):
        return self.reference(q, k, v, x=x, idx=idx)[0]


class FlakyKernel(SlopeRotary):
    """Fails on its "fast" backend, as a kernel might; ``fallback_options`` tell the suite how to rerun it."""

    fallback_options = {"backend": "plain"}

    def __init__(self, *, backend: str = "fast", **common):
        super().__init__(**common)
        self.backend = backend

    def attend(self, q, k, v, *, x, idx=None):
        if self.backend == "fast":
            raise RuntimeError("kernel failed")
        return super().attend(q, k, v, x=x, idx=idx)


class BrokenKernel(FlakyKernel):
    fallback_options = {}  # nothing to fall back to


@pytest.fixture
def toy():
    added = {NAME: (SlopeRotary, "test-only: RoPE phases with a learned distance bias"),
             NAME + "_flaky": (FlakyKernel, "test-only: a kernel that fails"),
             NAME + "_broken": (BrokenKernel, "test-only: a kernel that fails, no fallback")}
    for name, (cls, description) in added.items():
        register_attention(name, cls, description)
    try:
        yield NAME
    finally:
        for name in added:
            REGISTRY.pop(name, None)


def _model(name, **kw):
    torch.manual_seed(0)
    return build_model(ModelConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, attention=name, **kw))


def test_registration_checks(toy):
    assert toy in available_attention()
    with pytest.raises(ValueError, match="already registered"):
        register_attention(toy, SlopeRotary, "again")
    with pytest.raises(ValueError, match="not a PositionalAttention"):
        register_attention("toy_other", nn.Linear, "not a variant")
    with pytest.raises(ValueError, match="needs an even head dim"):  # the class attribute, not the name
        ModelConfig(attention=toy, n_embd=36, n_head=4)
    with pytest.raises(ValueError, match="does not take"):  # its options come from its signature
        _model(toy, attention_kwargs={"window": 3})


def test_new_variant_trains_a_step(toy):
    model = _model(toy, attention_kwargs={"base": 50.0})
    assert model.blocks[0].attn.positional.base == 50.0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 64, (2, 24))
    _, loss = model(idx, idx)
    loss.backward()
    slope = model.blocks[0].attn.positional.log_slope
    assert math.isfinite(loss.item()) and slope.grad is not None and slope.grad.abs().sum() > 0
    before = slope.detach().clone()
    opt.step()
    assert not torch.equal(before, slope.detach())
    assert math.isfinite(model(idx, idx)[1].item())


def test_new_variant_runs_in_the_task_runner_and_suite(toy):
    from pathlab.tasks.runner import run_task
    from pathlab.tasks.suite import _job

    small = {"steps": 2, "eval_every": 1, "n_eval": 16, "n_layer": 1}
    rec = run_task("a5", toy, preset="tiny-cpu", overrides=small, progress=False)
    assert rec["steps"] == 2 and rec["path_backend"] is None and math.isfinite(rec["metrics"]["test"]["loss"])
    rec = _job("a5", NAME + "_flaky", "tiny-cpu", small, {"length": 3, "layers": [1]})  # retried on "plain"
    assert rec["runs"][0]["settings"]["attention_kwargs"] == {"backend": "plain"}
    assert rec["fallback"].startswith("reran with backend='plain' after RuntimeError")
    with pytest.raises(RuntimeError, match="kernel failed"):  # no fallback options: the failure is raised
        _job("a5", NAME + "_broken", "tiny-cpu", small, {"length": 3, "layers": [1]})


def test_score_probes_on_the_new_variant(toy):
    model = _model(toy)
    windows = torch.randint(0, 64, (2, 40))
    # streamed logits of one layer against its own T×T reference
    captured = {}
    with torch.no_grad(), positional_hooks(model, lambda layer, *a: captured.setdefault(layer, a)):
        run_blocks(model, windows)
    module, q, k, v, x, idx = captured[1]
    positions = torch.tensor([39, 30, 17, 4])
    with torch.no_grad():
        _, ref, _ = module.reference(q, k, v, x=x, idx=idx)
        for b in range(2):
            layer = scores.prepare_layer(module, q, k, v, x, idx, b)
            got = torch.full((4, 2, 40), -math.inf, dtype=torch.float64)
            for j0, s, raw in scores.iter_logit_chunks(layer, positions, chunk=7):
                assert raw is not None  # a transported logit: ρ_s is measured
                got[:, :, j0:j0 + s.shape[-1]] = s
            torch.testing.assert_close(got, ref[b][:, positions].permute(1, 0, 2), rtol=1e-9, atol=1e-9)
    # the model-level probes: far mass against the model's own attention records
    W = 5
    res = measure_model(model, windows, n_queries=6, span=20, near_windows=(W,), chunk=8)
    with torch.no_grad():
        _, _, records = model(windows, return_attention=True)
    for layer, rec in enumerate(records):
        probs = rec.probs.numpy()
        expected = [probs[b, :, i, : i - W + 1].sum(-1) for b in range(2) for i in res["positions"][b]]
        np.testing.assert_allclose(res["per_query"]["far_mass"][layer, 0], np.array(expected), rtol=1e-6, atol=1e-12)
    assert res["per_bin"]["rho_s"] is not None and np.allclose(res["per_bin"]["rho_s"][:, 0], 1.0)
    # no step angles: every head takes the fallback width
    hw = learned_head_windows(model, windows, n_max=10, fallback=40)
    assert hw["fallback"].all() and np.all(hw["W"] == 40) and hw["coherence"] is None


def test_a_variant_without_score_terms_is_refused_by_the_probes(toy):
    class NoTerms(SlopeRotary):
        score_terms = PositionalAttention.score_terms

    module = NoTerms(n_embd=8, n_head=2, n_kv_head=2, head_dim=4, vocab_size=8, layer_idx=0)
    q = torch.randn(1, 5, 2, 4)
    with pytest.raises(NotImplementedError, match="NoTerms"):
        scores.prepare_layer(module, q, q, q, torch.randn(1, 5, 8), None, 0)
