"""Evaluation: fixed non-overlapping windows, PPL ratios and position buckets; train + eval end to end for every
registered attention variant on the CPU."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch

import pathlab
from pathlab.intervals import bootstrap_ratio
from pathlab.training.evaluate import (evaluate, evaluate_model, ntk_base, position_buckets, rope_base,
                                       token_losses, train_context_losses, window_starts)
from pathlab.training.trainer import load_run, train

from test_train import corpus, tiny_config  # noqa: F401  (the module-scoped synthetic corpus fixture)


def test_windows_are_fixed_non_overlapping_and_inside_the_split():
    for L in (7, 100, 1000):
        a = window_starts(20_000, L, 8, seed=3)
        b = window_starts(20_000, L, 8, seed=3)
        np.testing.assert_array_equal(a, b)
        assert np.all(np.diff(a) >= L + 1)  # non-overlapping windows of L + 1 tokens
        assert a.min() >= 0 and a.max() + L + 1 <= 20_000
        assert not np.array_equal(a, window_starts(20_000, L, 8, seed=4))
    assert len(window_starts(1000, 400, 8, seed=0)) == 2  # all that fit
    with pytest.raises(ValueError, match="needs 1001 validation tokens"):
        window_starts(500, 1000, 1, seed=0)


def test_position_buckets_are_log_spaced_and_cover_every_position():
    assert position_buckets(10) == [(0, 1), (1, 2), (2, 4), (4, 8), (8, 10)]
    b = position_buckets(65536)
    assert b[-1] == (32768, 65536) and len(b) == 17
    assert all(lo < hi for lo, hi in b) and all(b[i][1] == b[i + 1][0] for i in range(len(b) - 1))


def _model(attention="rope", vocab=97):
    torch.manual_seed(0)
    return pathlab.build_model(pathlab.ModelConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=vocab,
                                                   attention=attention))


def test_token_losses_match_the_model_loss_at_any_batching():
    model = _model()
    w = torch.randint(0, 97, (3, 41))
    losses = token_losses(model, w, batch_tokens=40, vocab_chunk=7)  # one window per batch, 7 positions per chunk
    assert losses.shape == (3, 40) and losses.dtype == torch.float32
    _, loss = model(w[:, :-1], w[:, 1:])
    torch.testing.assert_close(losses.mean(), loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(token_losses(model, w), losses, rtol=1e-5, atol=1e-6)


def test_training_context_losses_cut_the_context_every_training_length():
    model = _model()
    w = torch.randint(0, 97, (2, 3 * 16 + 1))
    cut = train_context_losses(model, w, 16)
    for c in (0, 16, 32):  # chunk c predicts the window's targets c … c + 15 from its own prefix only
        torch.testing.assert_close(cut[:, c:c + 16], token_losses(model, w[:, c:c + 17]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(train_context_losses(model, w, 48), token_losses(model, w), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="multiple"):
        train_context_losses(model, w, 20)


def test_bootstrap_interval_contains_the_ratio_and_shrinks_with_more_windows():
    rng = np.random.default_rng(0)
    base = rng.normal(3.0, 0.3, 400)
    long = base + 0.1 + rng.normal(0, 0.05, 400)  # r = e^0.1
    lo, hi = bootstrap_ratio(long[:16], base[:16])
    assert lo < np.exp(long[:16].mean() - base[:16].mean()) < hi
    lo2, hi2 = bootstrap_ratio(long, base)
    assert lo2 < np.exp(0.1) < hi2 and hi2 - lo2 < hi - lo
    assert bootstrap_ratio(long, base) == bootstrap_ratio(long, base)  # seeded
    with pytest.raises(ValueError, match="equal"):
        bootstrap_ratio(long, base[:3])


def test_ntk_base_and_rope_base_context():
    assert ntk_base(10000.0, 1.0, 64) == 10000.0
    assert ntk_base(10000.0, 4.0, 64) == pytest.approx(10000.0 * 4 ** (64 / 62))
    m = _model()
    w = torch.randint(0, 97, (1, 40))
    before = token_losses(m, w)
    with rope_base(m, 1e6):
        assert all(b.attn.positional.base == 1e6 for b in m.blocks)
        changed = token_losses(m, w)
    assert not torch.allclose(before, changed)
    torch.testing.assert_close(token_losses(m, w), before)
    with pytest.raises(ValueError, match="RoPE"):
        with rope_base(_model("alibi"), 1e6):
            pass


def test_evaluate_model_pairs_the_denominator_with_the_same_tokens():
    model = _model()
    val = np.random.default_rng(1).integers(0, 97, 3000)
    out = evaluate_model(model, val, [48, 16], 16, n_windows=5, seed=3, ntk=True, progress=False)
    assert list(out["lengths"]) == [16, 48] and set(out["ntk"]) == {16, 48}
    r16, r48 = out["lengths"][16], out["lengths"][48]
    assert r16["ratio"] == 1.0 and r16["loss"] == r16["loss_train_context"]
    starts = r48["window_starts"]
    windows = torch.from_numpy(np.stack([val[s:s + 49] for s in starts]).astype(np.int64))
    assert r48["loss"] == pytest.approx(float(token_losses(model, windows).double().mean()), rel=1e-6)
    assert r48["loss_train_context"] == pytest.approx(
        float(train_context_losses(model, windows, 16).double().mean()), rel=1e-6)
    assert r48["ratio"] == pytest.approx(np.exp(r48["loss"] - r48["loss_train_context"]))
    assert r48["ratio_ci95"][0] <= r48["ratio"] <= r48["ratio_ci95"][1]
    # NTK at the training length is the unscaled model (s = 1); its denominator is the unscaled one
    assert out["ntk"][16]["loss"] == r16["loss"]
    assert out["ntk"][48]["loss_train_context"] == r48["loss_train_context"]
    assert out["ntk"][48]["loss"] != r48["loss"]
    for bad in ([24], [8], "16,x"):
        with pytest.raises(ValueError, match="lengths"):
            evaluate_model(model, val, bad, 16, n_windows=2, seed=0, progress=False)


@pytest.mark.parametrize("attention", pathlab.available_attention())
def test_train_and_evaluate_every_variant(corpus, tmp_path, attention):  # noqa: F811
    cfg = tiny_config(corpus, max_iters=3, eval_interval=0, ckpt_interval=0, eval_iters=1, grad_accum=1)
    cfg["model"]["attention"] = attention
    run = train(cfg, run_dir=tmp_path, progress=False)
    report = evaluate(run, [64, 192], n_windows=2, device="cpu", progress=False)
    assert report["attention"] == attention and report["train_length"] == 32
    assert set(report["lengths"]) == {"32", "64", "192"}
    assert ("ntk" in report) == (attention == "rope")
    for L, r in report["lengths"].items():
        assert math.isfinite(r["loss"]) and r["ppl"] == pytest.approx(math.exp(r["loss"]))
        assert r["tokens"] == r["n_windows"] * int(L)
        # the buckets cover every position, so their position-weighted mean is the overall loss
        weighted = sum(b["loss"] * (b["stop"] - b["start"]) for b in r["buckets"]) / int(L)
        assert weighted == pytest.approx(r["loss"], rel=1e-6)
    assert report["lengths"]["32"]["ratio"] == pytest.approx(1.0)
    rows = [r for r in csv.DictReader(open(run / "eval.csv")) if r["scaling"] == "none"]
    assert [int(r["length"]) for r in rows] == [32, 64, 192]
    assert json.loads((run / "eval.json").read_text())["lengths"]["64"]["window_starts"] == \
        report["lengths"]["64"]["window_starts"]
    model, run_cfg = load_run(run)
    assert run_cfg["model"]["attention"] == attention and not model.training


def test_same_windows_for_different_models(corpus, tmp_path):  # noqa: F811
    reports = []
    for attention in ("nope", "alibi"):
        cfg = tiny_config(corpus, max_iters=1, eval_interval=0, ckpt_interval=0, eval_iters=1, grad_accum=1)
        cfg["model"]["attention"] = attention
        reports.append(evaluate(train(cfg, run_dir=tmp_path / attention, progress=False), [64], n_windows=3,
                                device="cpu", progress=False))
    assert reports[0]["lengths"]["64"]["window_starts"] == reports[1]["lengths"]["64"]["window_starts"]


def test_eval_cli_reports_bad_input(tmp_path, capsys):
    from pathlab.cli import main

    assert main(["eval", str(tmp_path), "--lengths", "128"]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_a_length_the_split_cannot_hold_is_refused_before_any_length_is_scored(monkeypatch):
    import importlib

    evaluation = importlib.import_module("pathlab.training.evaluate")  # the module (the package exports the function)
    model = pathlab.build_model(pathlab.ModelConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=50))
    monkeypatch.setattr(evaluation, "train_context_losses", lambda *a, **k: pytest.fail("a length was scored"))
    with pytest.raises(ValueError, match=r"lengths: 4096 needs 4097 validation tokens, the split has only 1000"):
        evaluate_model(model, np.zeros(1000, dtype=np.int64), [64, 4096], 32, n_windows=2, seed=0, progress=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA is the case tested")
def test_a_cuda_device_without_cuda_is_refused_before_any_work(corpus, tmp_path, monkeypatch):  # noqa: F811
    """`pathlab eval --device cuda` and `pathlab study run --device cuda` on a machine without CUDA: a clear error
    before anything loads or trains (the study used to train the whole cell first)."""
    from pathlab import study as studies

    run = train(tiny_config(corpus, max_iters=2, eval_interval=0, ckpt_interval=0, eval_iters=1, grad_accum=1),
                run_dir=tmp_path / "run", progress=False)
    with pytest.raises(ValueError, match="device: 'cuda' requested but CUDA is not available"):
        evaluate(run, [64], n_windows=1, device="cuda", progress=False)
    monkeypatch.setenv("PATHLAB_RUNS", str(tmp_path / "runs"))
    s = studies.load_study({"name": "unit", "results_dir": str(tmp_path / "results"), "train_config":
                            tiny_config(corpus, max_iters=2), "cells": {"rope": {"attention": "rope"}}})
    with pytest.raises(ValueError, match="device: 'cuda' requested"):
        studies.run_study(s, device="cuda", progress=False)
    assert not (tmp_path / "runs").exists()


def test_evaluating_on_a_rebuilt_corpus_is_refused(corpus, tmp_path):  # noqa: F811
    import shutil

    from pathlab.data.tokens import write_corpus
    from test_train import EOT, VOCAB, _markov_docs

    copy = tmp_path / "corpus"
    shutil.copytree(corpus, copy)
    cfg = tiny_config(copy, max_iters=2, eval_interval=0, ckpt_interval=0, eval_iters=1, grad_accum=1)
    run = train(cfg, run_dir=tmp_path / "run", progress=False)
    evaluate(run, [64], n_windows=1, device="cpu", progress=False)  # the corpus it was trained on: fine
    rng = np.random.default_rng(7)  # prepared again, with other text: same name, other tokens
    write_corpus(copy, "markov", {"train": _markov_docs(rng, 30, 400), "val": _markov_docs(rng, 4, 700)},
                 {"name": "markov97", "vocab_size": VOCAB, "eot": EOT})
    with pytest.raises(ValueError, match="different corpus"):
        evaluate(run, [64], n_windows=1, device="cpu", progress=False)
