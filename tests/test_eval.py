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
from pathlab.evaluate import evaluate, per_position_loss, position_buckets, window_starts
from pathlab.train import load_run, train

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


def test_per_position_loss_matches_the_model_loss(corpus):  # noqa: F811
    torch.manual_seed(0)
    model = pathlab.build_model(pathlab.ModelConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=97))
    w = torch.randint(0, 97, (3, 41))
    losses = per_position_loss(model, w, torch.device("cpu"), chunk=16)
    _, loss = model(w[:, :-1], w[:, 1:])
    torch.testing.assert_close(losses.mean(), loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("attention", pathlab.available_attention())
def test_train_and_evaluate_every_variant(corpus, tmp_path, attention):  # noqa: F811
    cfg = tiny_config(corpus, max_iters=3, eval_interval=0, ckpt_interval=0, eval_iters=1, grad_accum=1)
    cfg["model"]["attention"] = attention
    run = train(cfg, run_dir=tmp_path, progress=False)
    report = evaluate(run, [16, 64, 200], n_windows=2, device="cpu", progress=False)
    assert report["attention"] == attention and report["train_length"] == 32
    assert set(report["lengths"]) == {"16", "32", "64", "200"}
    for L, r in report["lengths"].items():
        assert math.isfinite(r["loss"]) and r["ppl"] == pytest.approx(math.exp(r["loss"]))
        assert r["tokens"] == r["n_windows"] * int(L)
        # the buckets cover every position, so their position-weighted mean is the overall loss
        weighted = sum(b["loss"] * (b["stop"] - b["start"]) for b in r["buckets"]) / int(L)
        assert weighted == pytest.approx(r["loss"], rel=1e-6)
    assert report["lengths"]["32"]["ratio"] == pytest.approx(1.0)
    assert report["lengths"]["200"]["ratio"] == pytest.approx(report["lengths"]["200"]["ppl"]
                                                              / report["lengths"]["32"]["ppl"])
    rows = list(csv.DictReader(open(run / "eval.csv")))
    assert [int(r["length"]) for r in rows] == [16, 32, 64, 200]
    assert json.loads((run / "eval.json").read_text())["lengths"]["64"]["window_starts"] == \
        report["lengths"]["64"]["window_starts"]
    model, run_cfg = load_run(run)
    assert run_cfg["model"]["attention"] == attention and not model.training


def test_same_windows_for_different_models(corpus, tmp_path):  # noqa: F811
    reports = []
    for attention in ("nope", "alibi"):
        cfg = tiny_config(corpus, max_iters=1, eval_interval=0, ckpt_interval=0, eval_iters=1, grad_accum=1)
        cfg["model"]["attention"] = attention
        reports.append(evaluate(train(cfg, run_dir=tmp_path / attention, progress=False), [50], n_windows=3,
                                device="cpu", progress=False))
    assert reports[0]["lengths"]["50"]["window_starts"] == reports[1]["lengths"]["50"]["window_starts"]


def test_eval_cli_reports_bad_input(tmp_path, capsys):
    from pathlab.cli import main

    assert main(["eval", str(tmp_path), "--lengths", "128"]) == 1
    assert "does not exist" in capsys.readouterr().err
