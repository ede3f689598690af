"""No run, checkpoint or corpus is silently poisoned: non-finite steps, concurrent trainers, corrupt checkpoints,
corpus drift, out-of-vocabulary ids, partial run directories, and the forget-gate sums' precision."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pathlab.training.checkpoint import (
    CKPT_NAME,
    PREV_NAME,
    CheckpointFallbackWarning,
    NonFiniteCheckpoint,
    load_checkpoint,
    save_checkpoint,
)
from pathlab.data.corpus import check_corpus, corpus_identity
from pathlab.data.tokens import CorpusError, read_meta, write_corpus
from pathlab.training.trainer import TrainingDiverged, load_run, train

from test_train import corpus  # noqa: F401  (the module-scoped Markov corpus fixture, shared)
from test_train import EOT, VOCAB, _losses, _markov_docs, poison_forward, tiny_config


def _ckpt_step(path):
    return load_checkpoint(path, fallback=False)["step"]


# ------------------------------------------------------------------------------------- non-finite steps


def test_nan_gradient_with_finite_loss_is_never_applied(corpus, tmp_path, monkeypatch):
    import pathlab.model

    # from iteration 4 on: the loss unchanged, its gradient NaN (0 · ∞ through the square root's derivative at 0)
    calls, forward = poison_forward(
        monkeypatch, lambda logits, loss: loss + 0.0 * torch.sqrt(logits - logits.detach()).sum())
    cfg = tiny_config(corpus, max_iters=8, eval_interval=0, ckpt_interval=2)
    with pytest.raises(TrainingDiverged, match=r"gradient norm became nan at iteration 4.*last good checkpoint "
                                               r"\(iteration 4\)"):
        train(cfg, run_dir=tmp_path, progress=False)
    ckpt = load_checkpoint(tmp_path / CKPT_NAME, fallback=False)
    assert ckpt["step"] == 4
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values() if v.is_floating_point())
    # the kept checkpoint resumes: the same data reaches the same poisoned step again
    calls["n"] = 8
    with pytest.raises(TrainingDiverged, match="at iteration 4"):
        train(cfg, run_dir=tmp_path, progress=False, resume=True)
    monkeypatch.setattr(pathlab.model.GPT, "forward", forward)
    train(cfg, run_dir=tmp_path, progress=False, resume=True)
    assert _ckpt_step(tmp_path / CKPT_NAME) == 8


def test_non_finite_weights_are_never_checkpointed(corpus, tmp_path, monkeypatch):
    import pathlab.training.trainer as train_module

    real_clip = torch.nn.utils.clip_grad_norm_
    calls = {"n": 0}

    def clip_and_poison(params, max_norm):  # iteration 3's update makes one weight NaN behind a finite norm
        norm = real_clip(params, max_norm)
        calls["n"] += 1
        if calls["n"] == 4:
            params[0].grad[0, 0] = float("nan")
        return norm

    monkeypatch.setattr(train_module.torch.nn.utils, "clip_grad_norm_", clip_and_poison)
    cfg = tiny_config(corpus, max_iters=8, eval_interval=0, ckpt_interval=2)
    with pytest.raises(TrainingDiverged, match=r"iteration 4.*not finite.*last good checkpoint \(iteration 2\)"):
        train(cfg, run_dir=tmp_path, progress=False)
    assert _ckpt_step(tmp_path / CKPT_NAME) == 2


def test_save_checkpoint_refuses_non_finite_tensors(tmp_path):
    good = {"model": {"w": torch.ones(3)}, "optimizer": {}, "step": 1}
    save_checkpoint(tmp_path / CKPT_NAME, good)
    bad = {"model": {"w": torch.tensor([1.0, float("inf")])}, "optimizer": {}, "step": 2}
    with pytest.raises(NonFiniteCheckpoint, match="model.w"):
        save_checkpoint(tmp_path / CKPT_NAME, bad)
    assert _ckpt_step(tmp_path / CKPT_NAME) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [CKPT_NAME]


# ------------------------------------------------------------------------------------- run-directory lock

HOLD_LOCK = textwrap.dedent("""
    import sys, time
    from pathlab.atomic import DirectoryLock
    lock = DirectoryLock(sys.argv[1]).acquire()
    print("locked", flush=True)
    time.sleep(120)
""")


def test_two_trainers_cannot_share_a_run_directory(corpus, tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RuntimeError, match=rf"{run_dir}.*in use by another process \(pid {holder.pid}"):
            train(tiny_config(corpus, max_iters=2), run_dir=run_dir, progress=False)
        assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]  # nothing of the second run was written
    finally:
        holder.kill()  # a dead holder's lock file stays behind and must not block
        holder.wait()
    train(tiny_config(corpus, max_iters=2), run_dir=run_dir, progress=False)
    train(tiny_config(corpus, max_iters=2), run_dir=run_dir, progress=False, resume=True)  # released on return


def test_a_run_stopped_before_its_summary_gets_it_from_the_final_checkpoint(corpus, tmp_path, monkeypatch):
    """Killed between the final checkpoint and ``summary.json``: resuming writes the summary the run would have
    written (a study cell reads it), instead of calling the run complete without one."""
    import pathlab.training.trainer as trainer_module

    cfg = tiny_config(corpus, max_iters=4)
    train(cfg, run_dir=tmp_path / "whole", progress=False)
    write = trainer_module.atomic_write_json

    def killed_at_the_summary(path, obj, *args, **kwargs):
        if path.name == "summary.json":
            raise KeyboardInterrupt("killed")
        return write(path, obj, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "atomic_write_json", killed_at_the_summary)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, run_dir=tmp_path / "cut", progress=False)
    monkeypatch.setattr(trainer_module, "atomic_write_json", write)
    assert _ckpt_step(tmp_path / "cut" / CKPT_NAME) == 4 and not (tmp_path / "cut" / "summary.json").exists()
    train(cfg, run_dir=tmp_path / "cut", progress=False, resume=True)
    whole, cut = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("whole", "cut"))
    timing = ("elapsed_s", "tokens_per_s")
    assert {k: v for k, v in cut.items() if k not in timing} == {k: v for k, v in whole.items() if k not in timing}


def test_a_damaged_metrics_line_costs_only_itself_on_resume(corpus, tmp_path):
    """One damaged line in metrics.jsonl (before the checkpoint): resuming drops that line, with a warning naming
    it, and keeps every good line before and after it."""
    cfg = tiny_config(corpus, max_iters=8, eval_interval=0, ckpt_interval=4)
    train(cfg, run_dir=tmp_path / "whole", progress=False)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, run_dir=tmp_path / "cut", progress=False, _interrupt_at=6)
    log = tmp_path / "cut" / "metrics.jsonl"
    lines = log.read_text().splitlines()
    lines[1] = lines[1][:9]  # iteration 1's entry, torn
    log.write_text("\n".join(lines) + "\n")
    with pytest.warns(UserWarning, match=r"metrics.jsonl: dropped damaged line\(s\) \[2\]"):
        train(cfg, run_dir=tmp_path / "cut", progress=False, resume=True)
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines() if "loss" in json.loads(line)]
    assert steps == [0, *range(2, 8)]
    assert _losses(tmp_path / "cut")[0] == [x for i, x in enumerate(_losses(tmp_path / "whole")[0]) if i != 1]


# ------------------------------------------------------------------------------------- checkpoint integrity


def test_checkpoint_checksum_previous_copy_and_fallback(corpus, tmp_path):
    cfg = tiny_config(corpus, max_iters=8, eval_interval=0, ckpt_interval=2)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, run_dir=tmp_path, progress=False, _interrupt_at=6)
    assert _ckpt_step(tmp_path / CKPT_NAME) == 6 and _ckpt_step(tmp_path / PREV_NAME) == 4
    data = bytearray((tmp_path / CKPT_NAME).read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4] = bytes(b ^ 0x5A for b in data[middle : middle + 4])  # inside a tensor's bytes
    (tmp_path / CKPT_NAME).write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        load_checkpoint(tmp_path / CKPT_NAME, fallback=False)
    with pytest.warns(CheckpointFallbackWarning, match=r"checksum.*previous checkpoint .*ckpt.prev.pt \(iteration 4\)"):
        _, run_cfg = load_run(tmp_path)
    assert run_cfg["checkpoint_step"] == 4
    (tmp_path / ".ckpt.pt.stale123.tmp").write_bytes(b"half a checkpoint")  # a write killed mid-way
    with pytest.warns(CheckpointFallbackWarning):
        train(cfg, run_dir=tmp_path, progress=False, resume=True)
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))
    full = train(cfg, run_dir=tmp_path / "full", progress=False)
    assert _losses(tmp_path) == _losses(full)  # resumed from iteration 4: still bit-exact
    assert _ckpt_step(tmp_path / CKPT_NAME) == 8


def test_corrupt_checkpoint_without_previous_copy_is_an_error(tmp_path):
    save_checkpoint(tmp_path / CKPT_NAME, {"model": {"w": torch.ones(1000)}, "optimizer": {}, "step": 1})
    data = bytearray((tmp_path / CKPT_NAME).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / CKPT_NAME).write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{CKPT_NAME}.*checksum.*corrupt"):
        load_checkpoint(tmp_path / CKPT_NAME)


# ------------------------------------------------------------------------------------- corpus identity and ids


def test_runs_record_their_corpus_and_refuse_another(corpus, tmp_path):
    cfg = tiny_config(corpus, max_iters=4, eval_interval=0, ckpt_interval=2)
    copy = tmp_path / "corpus"
    shutil.copytree(corpus, copy)
    cfg["data"]["corpus"] = str(copy)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, run_dir=tmp_path / "run", progress=False, _interrupt_at=2)
    identity = corpus_identity(read_meta(copy))
    env = json.loads((tmp_path / "run" / "env.json").read_text())
    assert env["corpus_identity"] == identity
    ckpt = load_checkpoint(tmp_path / "run" / CKPT_NAME)
    assert ckpt["corpus"] == identity
    check_corpus(ckpt, read_meta(copy))
    _, run_cfg = load_run(tmp_path / "run")
    check_corpus(run_cfg, read_meta(copy))
    # the corpus is prepared again and comes out different (new package versions): same name, other tokens
    rng = np.random.default_rng(1)
    write_corpus(copy, "markov", {"train": _markov_docs(rng, 30, 400), "val": _markov_docs(rng, 4, 700)},
                 {"name": "markov97", "vocab_size": VOCAB, "eot": EOT})
    with pytest.raises(ValueError, match=r"different corpus.*train_sha256.*val_sha256"):
        check_corpus(run_cfg, read_meta(copy))
    with pytest.raises(ValueError, match=r"cannot resume .*different corpus"):
        train(cfg, run_dir=tmp_path / "run", progress=False, resume=True)


def test_out_of_vocabulary_ids_in_a_corpus_are_found_before_training(corpus, tmp_path):
    copy = tmp_path / "corpus"
    shutil.copytree(corpus, copy)
    data = np.fromfile(copy / "val.bin", dtype=np.uint16)
    data[123] = VOCAB + 5  # the size and meta.json still agree: only the values are wrong
    data.tofile(copy / "val.bin")
    with pytest.raises(CorpusError, match=rf"{copy / 'val.bin'}.*token id {VOCAB + 5} at position 123"):
        train(tiny_config(copy), run_dir=tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ------------------------------------------------------------------------------------- partial run directories


def test_partial_run_directory_is_restarted_only_with_the_same_config(corpus, tmp_path, capsys):
    cfg = tiny_config(corpus, max_iters=4, eval_interval=0, ckpt_interval=0)
    with pytest.raises(KeyboardInterrupt):  # killed before its first checkpoint: config and metrics, no checkpoint
        train(cfg, run_dir=tmp_path, progress=False, _interrupt_at=2)
    assert not (tmp_path / CKPT_NAME).exists() and (tmp_path / "metrics.jsonl").exists()
    with pytest.raises(ValueError, match=r"no checkpoint to resume from"):
        train(cfg, run_dir=tmp_path, progress=False, resume=True)
    with pytest.raises(ValueError, match=r"holds an earlier run .*no checkpoint.*optim.lr"):
        train(cfg, overrides=["optim.lr=1e-2"], run_dir=tmp_path, progress=False)
    capsys.readouterr()
    train(cfg, run_dir=tmp_path, progress=False)  # the same run again: it starts over, and says so
    assert "starting it over" in capsys.readouterr().out
    assert len(_losses(tmp_path)[0]) == 4


def test_malformed_yaml_names_the_file_and_line(tmp_path, capsys):
    from pathlab.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\noptim:\n  lr: 1e-3\n   beta1: 0.9\n")  # beta1 indented one space too far
    assert main(["train", "--config", str(bad), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert str(bad) in err and "line 4" in err and "Traceback" not in err


# ------------------------------------------------------------------------------------- threads on resume


def test_resume_with_other_threads_says_it_is_not_bit_exact(corpus, tmp_path, capsys):
    threads = torch.get_num_threads()
    cfg = tiny_config(corpus, max_iters=4, eval_interval=0, ckpt_interval=2, threads=1)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, run_dir=tmp_path, progress=False, _interrupt_at=2)
    assert torch.get_num_threads() == threads  # train() leaves the process's setting as it found it
    capsys.readouterr()
    train(cfg, overrides=["train.threads=2"], run_dir=tmp_path, progress=False, resume=True)
    out = capsys.readouterr().out
    assert "train.threads" in out and "not bit-exact" in out


# ------------------------------------------------------------------------------------- forget-gate precision


def _blockwise_error(g_first: float):
    """Relative RMS error of fp32 blockwise PaTH-FoX against the fp64 reference, output and dg, with g[:, 0] set to
    ``g_first``: G_i − G_j never contains g_0, so the exact result does not depend on it, but every prefix sum
    G_i is offset by it (a strong gate early in the sequence)."""
    from pathlab import reference
    from pathlab.ops.path_blockwise import path_attention_blockwise
    from pathlab.testing import random_path_inputs

    gen = torch.Generator().manual_seed(3)
    q, k, v, w, beta, g = random_path_inputs(1, 300, 2, 16, gate=True, dtype=torch.float64, generator=gen)
    w = F.normalize(w, dim=-1)
    g = g.clone()
    g[:, 0] = g_first
    d_out = torch.randn(1, 300, 2, 16, dtype=torch.float64, generator=gen)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v, w, beta, g)]
    ref = reference.path_attention(*ref_in, scale=0.25)
    (dg_ref,) = torch.autograd.grad(ref, ref_in[5], d_out)
    fast_in = [t.float().requires_grad_() for t in (q, k, v, w, beta, g)]
    out = path_attention_blockwise(*fast_in, scale=0.25, chunk_size=64)
    (dg,) = torch.autograd.grad(out, fast_in[5], d_out.float())
    dg, dg_ref = dg[:, 1:].double(), dg_ref[:, 1:]  # dg_0 is exactly 0: the output does not depend on g_0
    return ((out.double() - ref).norm() / ref.norm()).item(), ((dg - dg_ref).norm() / dg_ref.norm()).item()


def test_strong_gates_keep_fp32_precision_in_the_blockwise_path():
    out_plain, dg_plain = _blockwise_error(g_first=-1.0)
    out_strong, dg_strong = _blockwise_error(g_first=-20_000.0)  # prefix sums near -2e4: ulp(fp32) = 2e-3
    assert out_plain < 2e-6 and dg_plain < 2e-5
    assert out_strong < 2 * out_plain + 1e-7, (out_strong, out_plain)
    assert dg_strong < 2 * dg_plain + 1e-6, (dg_strong, dg_plain)
