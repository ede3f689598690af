"""Training pipeline: exact resume, 2-process DDP against 1 process, schedule, config and bad-input checks."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from pathlab.training.checkpoint import load_checkpoint
from pathlab.data.tokens import write_corpus
from pathlab.training.config import resolve_config
from pathlab.training.trainer import TrainingDiverged, learning_rate, load_run, train

VOCAB = 97
EOT = 96


def _markov_docs(rng, n_docs, length):
    """Documents from a sparse random Markov chain, so a tiny model has something to learn."""
    nxt = rng.integers(0, EOT, size=(EOT, 3))
    docs = []
    for _ in range(n_docs):
        t = int(rng.integers(0, EOT))
        doc = []
        for _ in range(int(length)):
            doc.append(t)
            t = int(nxt[t, rng.integers(0, 3)])
        docs.append(doc)
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(0)
    folder = tmp_path_factory.mktemp("corpus")
    return write_corpus(folder, "markov", {"train": _markov_docs(rng, 30, 400), "val": _markov_docs(rng, 4, 700)},
                        {"name": "markov97", "vocab_size": VOCAB, "eot": EOT})


def tiny_config(corpus, **train):
    return {
        "name": "test",
        "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "attention": "rope"},
        "data": {"corpus": str(corpus), "block_size": 32},
        "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_iters": 2},
        "train": {"max_iters": 8, "batch_size": 4, "grad_accum": 2, "device": "cpu", "eval_interval": 4,
                  "eval_iters": 2, "ckpt_interval": 4, "log_interval": 1, **train},
    }


def poison_forward(monkeypatch, poison, after_calls=8):
    """Patch ``GPT.forward`` so that every call after the first ``after_calls`` returns ``poison(logits, loss)``
    as its loss; returns the call counter (``{"n": calls so far}``, settable to replay) and the original forward.
    With two micro-batches per iteration, ``after_calls=8`` leaves iterations 0-3 intact."""
    import pathlab.model

    forward = pathlab.model.GPT.forward
    calls = {"n": 0}

    def poisoned(self, idx, targets=None, **kw):
        logits, loss = forward(self, idx, targets, **kw)
        calls["n"] += 1
        return logits, (poison(logits, loss) if calls["n"] > after_calls else loss)

    monkeypatch.setattr(pathlab.model.GPT, "forward", poisoned)
    return calls, forward


def _losses(run_dir):
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r], [r["val_loss"] for r in rows if "val_loss" in r]


def test_resume_reproduces_uninterrupted_losses_exactly(corpus, tmp_path):
    cfg = tiny_config(corpus)
    full = train(cfg, run_dir=tmp_path / "full", progress=False)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, run_dir=tmp_path / "cut", progress=False, _interrupt_at=6)  # killed after the step-4 checkpoint
    ckpt = load_checkpoint(tmp_path / "cut" / "ckpt.pt")
    assert ckpt["step"] == 4 and ckpt["sampler"]["iteration"] == 4
    train(cfg, run_dir=tmp_path / "cut", progress=False, resume=True)
    a, va = _losses(full)
    b, vb = _losses(tmp_path / "cut")
    assert len(a) == len(b) == 8
    assert a == b  # bit-for-bit on the CPU
    assert va == vb
    assert a[-1] < a[0]
    ma, _ = load_run(full)
    mb, run_cfg = load_run(tmp_path / "cut")
    assert run_cfg["checkpoint_step"] == 8
    stamp = (tmp_path / "cut" / "ckpt.pt").stat().st_mtime_ns
    train(cfg, run_dir=tmp_path / "cut", progress=False, resume=True)  # a complete run: nothing to do
    assert (tmp_path / "cut" / "ckpt.pt").stat().st_mtime_ns == stamp
    for (na, pa), (nb, pb) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)


def test_resume_refuses_a_different_config_and_keeps_the_checkpoint(corpus, tmp_path):
    cfg = tiny_config(corpus, max_iters=4)
    train(cfg, run_dir=tmp_path, progress=False)
    before = (tmp_path / "ckpt.pt").read_bytes()
    with pytest.raises(ValueError, match="optim.lr"):
        train(cfg, overrides=["optim.lr=1e-2"], run_dir=tmp_path, resume=True, progress=False)
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        train(cfg, run_dir=tmp_path, progress=False)
    assert (tmp_path / "ckpt.pt").read_bytes() == before


def test_nan_loss_stops_and_keeps_last_good_checkpoint(corpus, tmp_path, monkeypatch):
    poison_forward(monkeypatch, lambda logits, loss: loss * float("nan"))  # from iteration 4 on
    cfg = tiny_config(corpus, max_iters=8, eval_interval=0, ckpt_interval=4)
    with pytest.raises(TrainingDiverged, match=r"nan at iteration 4.*last good checkpoint \(iteration 4\)"):
        train(cfg, run_dir=tmp_path, progress=False)
    ckpt = load_checkpoint(tmp_path / "ckpt.pt")
    assert ckpt["step"] == 4
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values() if v.is_floating_point())


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*args):
    """``torchrun --nproc_per_node 2 ARGS``: 2 CPU processes on the gloo backend; a crash prints every stack."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def train_one_and_two_processes(cfg, tmp_path):
    """Train ``cfg`` in this process, then with the command a user runs under ``torchrun`` with 2 processes;
    returns both run directories."""
    single = train(cfg, run_dir=tmp_path / "single", progress=False)
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    _torchrun("-m", "pathlab.cli", "train", "--config", str(cfg_path), "--run-dir", str(tmp_path / "two"),
              "--no-progress")
    return single, tmp_path / "two"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_match_one_process(corpus, tmp_path, strategy):
    cfg = tiny_config(corpus, max_iters=3, eval_interval=0, ckpt_interval=0, grad_accum=2, distributed=strategy)
    single, two = train_one_and_two_processes(cfg, tmp_path)
    a, va = _losses(single)
    b, vb = _losses(two)
    assert len(b) == 3
    np.testing.assert_allclose(b, a, rtol=1e-5)
    np.testing.assert_allclose(vb, va, rtol=1e-5)
    ma, _ = load_run(single)
    mb, _ = load_run(two)
    for pa, pb in zip(ma.parameters(), mb.parameters()):
        torch.testing.assert_close(pb, pa, rtol=1e-4, atol=1e-6)


FSDP_SURVIVORS = """
import gc, sys
import torch.distributed as dist
from pathlab.cli import main

destroy = dist.destroy_process_group
def counting_destroy(*args, **kwargs):
    alive = sum(type(o).__name__ in ("FSDPState", "FSDPParamGroup", "DTensor") for o in gc.get_objects())
    print(f"rank {dist.get_rank()}: {alive} FSDP objects alive when the process group is destroyed", flush=True)
    destroy(*args, **kwargs)
dist.destroy_process_group = counting_destroy
raise SystemExit(main(sys.argv[1:]))
"""


def test_fsdp_state_is_freed_while_the_process_group_lives(corpus, tmp_path):
    """FSDP's reference cycles, freed only after the group is destroyed, can make gloo abort the process at exit."""
    cfg = tiny_config(corpus, max_iters=2, eval_interval=0, ckpt_interval=0, grad_accum=2, distributed="fsdp")
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    driver = tmp_path / "driver.py"
    driver.write_text(FSDP_SURVIVORS)
    proc = _torchrun(str(driver), "train", "--config", str(cfg_path), "--run-dir", str(tmp_path / "run"),
                     "--no-progress")
    # the two ranks share one stdout, so their lines can interleave: parse the reports, not the lines
    reports = sorted(re.findall(r"rank (\d+): (\d+) FSDP objects alive when the process group is destroyed", proc.stdout))
    assert reports == [("0", "0"), ("1", "0")], proc.stdout[-2000:]


def test_learning_rate_schedule_matches_nanogpt():
    optim = {"lr": 6e-4, "min_lr": 6e-5, "warmup_iters": 10, "lr_decay_iters": 100}
    assert learning_rate(0, optim, 100) == pytest.approx(6e-4 / 11)
    assert learning_rate(9, optim, 100) == pytest.approx(6e-4 * 10 / 11)
    assert learning_rate(10, optim, 100) == pytest.approx(6e-4)
    assert learning_rate(55, optim, 100) == pytest.approx(6e-5 + 0.5 * (6e-4 - 6e-5))
    assert learning_rate(100, optim, 100) == pytest.approx(6e-5)
    assert learning_rate(500, optim, 100) == pytest.approx(6e-5)


@pytest.mark.parametrize("name", ["tiny-cpu", "h200-mini", "owt16"])
def test_shipped_configs_resolve(name):
    cfg = resolve_config(name)
    assert cfg["name"] == name
    if name == "owt16":
        m = cfg["model"]
        assert (m["n_layer"], m["n_embd"], m["n_head"], cfg["data"]["block_size"]) == (16, 768, 12, 512)
        assert cfg["train"]["batch_size"] * cfg["train"]["grad_accum"] * 512 == 524288


@pytest.mark.parametrize("override, message", [
    (["train.max_iter=5"], "did you mean train.max_iters"),
    (["train.max_iters=five"], "must be int"),
    (["model.n_layers=2"], "model.n_layer"),
    (["train.dtype=fp16"], "must be one of"),
    (["model.attention=nonsense"], "unknown attention"),
    (["optim.min_lr=1.0"], "min_lr"),
    (["noequals"], "key=value"),
    (["optim.weight_decay=-0.1"], r"'optim.weight_decay' must be >= 0"),
    (["optim.grad_clip=-1.0"], r"'optim.grad_clip' must be >= 0"),
    (["optim.beta1=1.0"], r"'optim.beta1' must lie in \[0, 1\)"),
    (["optim.beta2=-0.5"], r"'optim.beta2' must lie in \[0, 1\)"),
    (["train.device=gpu"], r"'train.device' must be auto, cpu, cuda or cuda:N, got 'gpu'"),
    (["train.device=cuda:x"], r"'train.device'"),
    (["eval.lengths=abc"], r"'eval.lengths' must be a comma-separated list of integers, got 'abc'"),
    (["train.threads=-1"], r"'train.threads' must be >= 1, got -1"),
    (["optim.lr_decay_iters=-5"], r"'optim.lr_decay_iters' must be >= 1, got -5"),
])
def test_bad_overrides_raise_value_error(override, message):
    with pytest.raises(ValueError, match=message):
        resolve_config("tiny-cpu", override)


def test_overrides_are_typed():
    cfg = resolve_config("tiny-cpu", ["optim.lr=1e-3", "train.max_iters=7", "eval.lengths=128,256",
                                      "model.attention_kwargs.base=500"])
    assert cfg["optim"]["lr"] == 1e-3 and isinstance(cfg["optim"]["lr"], float)
    assert cfg["train"]["max_iters"] == 7 and cfg["eval"]["lengths"] == [128, 256]
    assert cfg["model"]["attention_kwargs"] == {"base": 500}


def test_overrides_may_follow_the_options(capsys):
    """`pathlab train --no-progress key=value`: overrides after an option reach the config (here a bad one, named
    by the config's own error) instead of being rejected as unrecognised arguments."""
    from pathlab.cli import main

    assert main(["train", "train.max_iters=1", "--no-progress", "train.max_iters=abc"]) == 1
    assert "config key 'train.max_iters' must be int, got 'abc'" in capsys.readouterr().err


def test_a_run_dir_that_is_a_file_is_refused(corpus, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("keep me")
    with pytest.raises(ValueError, match=r"run_dir: .*notes.txt is a file, not a run directory"):
        train(tiny_config(corpus, max_iters=1), run_dir=path, progress=False)
    assert path.read_text() == "keep me"


def test_data_mismatches_are_refused(corpus, tmp_path):
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        train(tiny_config(corpus), overrides={"data.tokenizer": "gpt2"}, run_dir=tmp_path / "a", progress=False)
    with pytest.raises(ValueError, match="longest training document"):
        train(tiny_config(corpus), overrides={"data.block_size": 4096}, run_dir=tmp_path / "b", progress=False)
    with pytest.raises(ValueError, match="vocab_size"):
        train(tiny_config(corpus), overrides={"model.vocab_size": 64}, run_dir=tmp_path / "c", progress=False)
    with pytest.raises(ValueError, match="not a prepared corpus"):
        train(tiny_config(tmp_path), run_dir=tmp_path / "d", progress=False)
    with pytest.raises(ValueError, match="does not exist"):
        load_run(tmp_path)


def test_corrupt_token_file_is_detected(corpus, tmp_path):
    import shutil

    copy = tmp_path / "corpus"
    shutil.copytree(corpus, copy)
    with open(copy / "train.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="corrupt or unfinished"):
        train(tiny_config(copy), run_dir=tmp_path / "run", progress=False)
