"""End-to-end task runs on the CPU: settings, the training loop, the sweep and the CLI (tiny presets)."""

import json
import math

import pytest
import torch

from pathlab.tasks import cli as tasks_cli
from pathlab.tasks.runner import learning_rate, run_task
from pathlab.tasks.settings import parse_overrides, resolve_settings
from pathlab.tasks.specs import batch_counts, split_metrics
from pathlab.tasks.suite import run_suite, sweep_a5


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny models: one thread is faster than two fighting over a busy machine
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("task,attention", [("flipflop", "path"), ("a5", "rope"), ("mqrar", "path_fox")])
def test_tiny_run_end_to_end(tmp_path, task, attention):
    out = tmp_path / f"{task}.json"
    rec = run_task(task, attention, preset="tiny-cpu", out=out, progress=False, command="test")
    on_disk = json.loads(out.read_text())
    assert on_disk["summary"] == rec["summary"] and on_disk["command"] == "test"
    assert on_disk["settings"]["attention_kwargs"] == {} and "torch" in on_disk["versions"]
    assert rec["steps"] == rec["settings"]["steps"] and rec["stopped"] == "steps"
    assert len(rec["history"]) == rec["steps"] // rec["settings"]["eval_every"]
    for split, m in rec["metrics"].items():
        assert 0.0 <= m["accuracy"] <= 1.0 and m["n_scored"] > 0 and math.isfinite(m["loss"])
    assert rec["path_backend"] == ("torch" if attention.startswith("path") else None)  # no Triton on the CPU
    if task == "flipflop":
        assert set(rec["summary"]["read_error"]) == {"in_dist", "sparse", "dense"}
    # same seed, same run: bitwise-identical metrics on the CPU
    again = run_task(task, attention, preset="tiny-cpu", progress=False)
    assert again["metrics"] == rec["metrics"]


def test_training_learns_flipflop_with_path():
    # PaTH solves short flip-flop sequences within ~50 steps; an untrained model errs on about half of the reads
    rec = run_task("flipflop", "path", progress=False, overrides=dict(
        n_instructions=16, n_layer=1, n_head=2, n_embd=32, steps=80, batch_size=32, lr=3e-3, warmup=20,
        eval_every=40, n_eval=200, n_eval_sparse=200, n_eval_dense=50))
    assert rec["summary"]["read_error"]["in_dist"] < 0.05, rec["summary"]
    assert rec["summary"]["n_reads"]["in_dist"] > 300


def test_scoring_counts():
    y = torch.tensor([[-1, 2, 3], [-1, -1, 1], [-1, -1, -1]])
    pred = torch.tensor([[0, 2, 3], [0, 0, 0], [0, 0, 0]])
    logits = torch.nn.functional.one_hot(pred, 5).float() * 10
    m = split_metrics(batch_counts(logits, y))
    assert m["accuracy"] == pytest.approx(2 / 3)
    assert m["sequence_accuracy"] == pytest.approx(1 / 2) and m["last_accuracy"] == pytest.approx(1 / 2)
    assert m["n_scored"] == 3 and m["n_sequences"] == 2


def test_settings_layers_and_errors():
    s = resolve_settings("mqrar", preset="h200", overrides={"n_back": 3, "lr": "3e-4"} | {"lr": 3e-4})
    assert (s["n_layer"], s["n_embd"], s["n_head"], s["n_pairs"], s["length"]) == (2, 256, 2, 32, 768)
    assert s["n_back"] == 3 and s["lr"] == 3e-4
    assert parse_overrides(["a=1", "b=x", "c=None", "d={'k': 2}"]) == {"a": 1, "b": "x", "c": None, "d": {"k": 2}}
    with pytest.raises(ValueError, match="unknown setting 'n_layers'"):
        resolve_settings("a5", overrides={"n_layers": 2})
    with pytest.raises(ValueError, match="steps must be an int"):
        resolve_settings("a5", overrides={"steps": "many"})
    with pytest.raises(ValueError, match="variant must be one of"):
        resolve_settings("a5", overrides={"variant": "parity"})
    with pytest.raises(ValueError, match="preset must be one of"):
        resolve_settings("flipflop", preset="laptop")
    with pytest.raises(ValueError, match="length must exceed"):
        resolve_settings("mqrar", overrides={"n_back": 4, "length": 200})
    with pytest.raises(ValueError, match="unknown attention"):
        run_task("a5", "sinusoidal", preset="tiny-cpu", progress=False)


@pytest.mark.parametrize("task,key,value,message", [
    ("flipflop", "n_eval", 0, "n_eval must be >= 1"),  # trained, then failed on the empty evaluation set
    ("flipflop", "n_eval_sparse", 0, "n_eval_sparse must be >= 1"),
    ("mqrar", "n_eval", 0, "n_eval must be >= 1"),
    ("a5", "min_lr_ratio", -1, r"min_lr_ratio must be in \[0, 1\]"),  # negative learning rates
    ("a5", "min_lr_ratio", 2, r"min_lr_ratio must be in \[0, 1\]"),
    ("a5", "solved_at", 5, r"solved_at must be in \(0, 1\)"),  # no length could ever be solved
    ("a5", "solved_at", 1, r"solved_at must be in \(0, 1\)"),
    ("a5", "weight_decay", -1, "weight_decay must be >= 0"),
    ("a5", "warmup", -5, "warmup must be >= 0"),
    ("a5", "grad_clip", -1, "grad_clip must be >= 0"),
    ("a5", "beta2", 1.0, r"beta2 must be in \[0, 1\)"),
    ("a5", "stop_at", 2.0, r"stop_at must be in \(0, 1\]"),
    ("a5", "mlp_ratio", 0, "mlp_ratio must be >= 1"),
    ("a5", "max_seconds", float("inf"), "max_seconds must be a finite number"),  # the result JSON cannot hold it
])
def test_settings_out_of_range_are_refused_before_training(task, key, value, message):
    with pytest.raises(ValueError, match=message):
        resolve_settings(task, preset="tiny-cpu", overrides={key: value})


def test_cli_settings_may_follow_the_options(capsys):
    from pathlab.cli import main

    assert main(["tasks", "run", "a5", "--attention", "rope", "--preset", "tiny-cpu", "--quiet", "n_layer=two"]) == 2
    assert "n_layer" in capsys.readouterr().err


def test_cli_run_refuses_a_directory_as_out_before_training(tmp_path, capsys, monkeypatch):
    from pathlab.cli import main
    from pathlab.tasks import runner

    monkeypatch.setattr(runner, "build_task_model", lambda *a, **k: pytest.fail("trained before checking --out"))
    assert main(["tasks", "run", "a5", "--attention", "rope", "--preset", "tiny-cpu", "--quiet", "--out",
                 str(tmp_path)]) == 2
    assert f"--out {tmp_path} is a directory" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["tasks", "run", "a5", "--attention", "rope", "--preset", "tiny-cpu", "--quiet", "--out",
                 str(tmp_path / "file" / "r.json")]) == 2
    assert "which is a file" in capsys.readouterr().err
    with pytest.raises(ValueError, match="out .* is a directory"):
        run_task("a5", "rope", preset="tiny-cpu", out=tmp_path, progress=False)
    assert main(["tasks", "sweep-a5", "--preset", "tiny-cpu", "--attentions", "rope", "--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path} is a directory" in capsys.readouterr().err


def test_learning_rate_schedule():
    s = resolve_settings("a5", overrides=dict(steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1))
    lrs = [learning_rate(s, i, i / 100) for i in range(101)]
    assert lrs[0] == pytest.approx(1 / 11) and max(lrs) == pytest.approx(1.0, abs=0.01)
    assert lrs[-1] == pytest.approx(0.1) and all(a >= b - 1e-12 for a, b in zip(lrs[10:], lrs[11:]))
    # a time-bounded run decays by the time fraction when it runs ahead of the steps
    assert learning_rate(s, 20, 1.0) == pytest.approx(0.1)


def test_a5_sweep_and_suite(tmp_path):
    out = tmp_path / "sweep.json"
    sweep_a5(preset="tiny-cpu", attentions=["rope"], lengths=[2], layers=[1, 2], out=out,
             overrides={"steps": 4, "eval_every": 2}, command="cmd", log=lambda *_: None)
    doc = json.loads(out.read_text())
    (chain,) = doc["chains"]
    assert doc["command"] == "cmd" and doc["lengths"] == [2] and doc["layers"] == [1, 2]
    # 4 steps cannot solve A5: both depths are tried, and the minimum is unknown
    assert chain["layers_tried"] == [1, 2] and chain["min_layers"] is None
    assert tasks_cli.min_layers_table(out) == {"rope": {2: None}}

    paths = run_suite(preset="tiny-cpu", attentions=["nope"], tasks=["mqrar", "flipflop"], out_dir=tmp_path,
                      overrides={"mqrar": {"steps": 2, "eval_every": 1}, "flipflop": {"steps": 2}},
                      log=lambda *_: None)
    mq = json.loads(paths["mqrar"].read_text())
    assert [r["settings"]["n_back"] for r in mq["runs"]] == [1, 2]
    assert json.loads(paths["flipflop"].read_text())["runs"][0]["attention"] == "nope"


def test_parallel_depths_join_one_chain(tmp_path):
    """--parallel-depths trains each depth as its own job; the results join one chain per (attention, length)."""
    from pathlab.cli import main

    assert main(["tasks", "suite", "--preset", "tiny-cpu", "--attentions", "nope", "--tasks", "a5", "--lengths",
                 "2", "--layers", "1,2", "--parallel-depths", "--out-dir", str(tmp_path), "--set", "a5:steps=2",
                 "--set", "a5:eval_every=2"]) == 0
    (chain,) = json.loads((tmp_path / "a5_sweep.json").read_text())["chains"]
    assert chain["layers_tried"] == [1, 2] and [r["settings"]["n_layer"] for r in chain["runs"]] == [1, 2]


def test_merge_chains_takes_the_smallest_solving_depth():
    from pathlab.tasks.suite import merge_chains

    def chain(n, solved):
        return {"attention": "path", "length": 5, "layers_tried": [n], "min_layers": n if solved else None,
                "runs": [{"settings": {"n_layer": n}}]}

    merged = merge_chains([chain(3, True), chain(1, False), chain(2, True)])
    assert merged["layers_tried"] == [1, 2, 3] and merged["min_layers"] == 2
    assert merge_chains([chain(2, False), chain(1, False)])["min_layers"] is None


def test_cli_run_and_errors(tmp_path, capsys):
    from pathlab.cli import main

    out = tmp_path / "r.json"
    assert main(["tasks", "run", "a5", "--attention", "fox", "--preset", "tiny-cpu", "--quiet", "--out", str(out),
                 "steps=3", "eval_every=3"]) == 0
    rec = json.loads(out.read_text())
    assert rec["steps"] == 3 and rec["command"].startswith("pathlab ")
    assert main(["tasks", "run", "a5", "--attention", "fox", "--preset", "tiny-cpu", "--quiet", "--out",
                 str(out), "depth=3"]) == 2
    assert "unknown setting 'depth'" in capsys.readouterr().err
    assert main(["tasks", "settings", "flipflop", "--preset", "h200"]) == 0
    assert json.loads(capsys.readouterr().out)["n_embd"] == 64


def test_suite_falls_back_to_blockwise_path_when_the_kernel_fails(monkeypatch):
    from pathlab.tasks import suite

    calls = []

    def flaky(task, attention, *, overrides=None, **kw):
        backend = (overrides or {}).get("attention_kwargs", {}).get("backend")
        calls.append(backend)
        if backend != "torch":
            raise RuntimeError("kernel exploded")
        return {"summary": {}, "settings": overrides}

    monkeypatch.setattr(suite, "run_task", flaky)
    rec = suite._job("mqrar", "path", "tiny-cpu", {}, {"n_back": 2})
    assert calls == [None, "torch"] and "kernel exploded" in rec["fallback"]
    with pytest.raises(RuntimeError, match="kernel exploded"):
        suite._job("mqrar", "rope", "tiny-cpu", {}, {"n_back": 2})  # no fallback for other variants


def test_cpu_workers_share_the_cores(monkeypatch):
    import torch

    from pathlab.tasks import suite

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(suite.os, "cpu_count", lambda: 8)
    assert [suite._worker_threads(w) for w in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert suite._worker_threads(2) == 1  # the GPU does the work

    seen = []
    monkeypatch.setattr(suite, "run_task", lambda *a, **k: seen.append(torch.get_num_threads()) or {})
    before = torch.get_num_threads()
    try:
        suite._job("mqrar", "rope", "tiny-cpu", {}, {"n_back": 2}, threads=1)
    finally:
        torch.set_num_threads(before)
    assert seen == [1]


def test_worker_errors_reach_the_parent_as_picklable_text(monkeypatch):
    import pickle
    import sys

    from pathlab.tasks import suite

    def unpicklable(*a, **k):
        err = ValueError("compile failed")
        err.frame = sys._getframe()  # like torch.compile's exceptions
        raise err

    monkeypatch.setattr(suite, "run_task", unpicklable)
    with pytest.raises(RuntimeError, match="ValueError: compile failed") as info:
        suite._job("flipflop", "fox", "tiny-cpu", {}, {})
    pickle.dumps(info.value)


def test_cli_sweep_a5(tmp_path, capsys):
    from pathlab.cli import main

    out = tmp_path / "sweep.json"
    assert main(["tasks", "sweep-a5", "--preset", "tiny-cpu", "--attentions", "rope", "--lengths", "2",
                 "--layers", "1", "--out", str(out), "steps=2", "eval_every=2"]) == 0
    assert json.loads(capsys.readouterr().out.split("wrote")[0]) == {"rope": {"2": None}}
    assert json.loads(out.read_text())["command"].startswith("pathlab ")


def test_cli_suite_takes_the_sweep_lists(tmp_path):
    from pathlab.cli import main

    assert main(["tasks", "suite", "--preset", "tiny-cpu", "--attentions", "nope", "--tasks", "mqrar,a5",
                 "--n-back", "3", "--lengths", "2", "--layers", "1", "--out-dir", str(tmp_path)]) == 0
    mq = json.loads((tmp_path / "mqrar.json").read_text())
    a5 = json.loads((tmp_path / "a5_sweep.json").read_text())
    assert mq["n_back"] == [3] and [r["settings"]["n_back"] for r in mq["runs"]] == [3]
    assert a5["lengths"] == [2] and a5["layers"] == [1]


def test_compiled_training_step_follows_the_eager_run():
    """compile=aot_eager traces the PaTH model's training step and trains as the eager run does."""
    eager = run_task("mqrar", "path", preset="tiny-cpu", progress=False)
    traced = run_task("mqrar", "path", preset="tiny-cpu", overrides={"compile": "aot_eager"}, progress=False)
    losses = [h["train_loss"] for h in eager["history"]], [h["train_loss"] for h in traced["history"]]
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)
    with pytest.raises(ValueError, match="compile must be one of"):
        run_task("mqrar", "path", preset="tiny-cpu", overrides={"compile": "fast"}, progress=False)


@pytest.mark.parametrize("setting,option", [("mqrar:n_back=2", "--n-back"), ("a5:length=3", "--lengths"),
                                            ("a5:n_layer=2", "--layers")])
def test_suite_refuses_a_setting_it_sweeps(tmp_path, capsys, setting, option):
    """The sweep would replace the value without a word: the error points to the sweep's own option."""
    from pathlab.cli import main

    assert main(["tasks", "suite", "--preset", "tiny-cpu", "--attentions", "nope", "--tasks", "mqrar,a5",
                 "--set", setting, "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{setting.replace(':', ' setting ')} would be ignored" in err and f"give the values with {option}" in err
    assert not list(tmp_path.iterdir())


def test_suite_checks_names_and_settings_before_any_job(tmp_path, capsys, monkeypatch):
    from pathlab.cli import main
    from pathlab.tasks import suite

    monkeypatch.setattr(suite, "run_task", lambda *a, **k: pytest.fail("a job started before the checks"))
    base = ["tasks", "suite", "--preset", "tiny-cpu", "--tasks", "flipflop", "--out-dir", str(tmp_path)]
    for extra, message in ((["--attentions", "rope,nosuch"], "attentions: unknown 'nosuch'; choose from"),
                           (["--attentions", "rope,rope"], "attentions names rope more than once"),
                           (["--set", "flipflop:n_eval=0"], "flipflop settings: n_eval must be >= 1"),
                           (["--set", "flipflop:attention_kwargs={'base': -1.0}"], "rope base must be a number"),
                           (["--set", "mqrar:steps=2"], "given for 'mqrar', which this suite does not run")):
        assert main(base + ["--attentions", "rope"] + extra) == 2, extra
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())


def test_a_failed_job_fails_the_suite_and_names_it(tmp_path, capsys, monkeypatch):
    """The other jobs finish and are written; the exit status is 1 and the message names the failed job, with
    a ValueError's text and no traceback."""
    from pathlab.cli import main
    from pathlab.tasks import suite

    real = suite.run_task

    def fox_fails(task, attention, **kw):
        if attention == "fox":
            raise ValueError("fox cannot run here")
        return real(task, attention, **kw)

    monkeypatch.setattr(suite, "run_task", fox_fails)
    assert main(["tasks", "suite", "--preset", "tiny-cpu", "--tasks", "flipflop", "--attentions", "fox,nope",
                 "--set", "flipflop:steps=2", "--out-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "1 of 2 jobs failed: flipflop fox (ValueError: fox cannot run here)" in err and "Traceback" not in err
    assert [r["attention"] for r in json.loads((tmp_path / "flipflop.json").read_text())["runs"]] == ["nope"]


def test_a_job_failed_in_a_worker_fails_the_suite(tmp_path, capsys, monkeypatch):
    """With worker processes too: a variant registered only in this process passes the checks here and fails
    in the workers, which start afresh."""
    from pathlab.attention import registry
    from pathlab.attention.nope import NoPE
    from pathlab.cli import main

    monkeypatch.setitem(registry.REGISTRY, "only_here", (NoPE, {}, "registered by the test"))
    assert main(["tasks", "suite", "--preset", "tiny-cpu", "--tasks", "flipflop", "--attentions", "only_here,nope",
                 "--workers", "2", "--set", "flipflop:steps=2", "--out-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "1 of 2 jobs failed: flipflop only_here (ValueError: unknown attention 'only_here'" in err
    assert "Traceback" not in err
    assert [r["attention"] for r in json.loads((tmp_path / "flipflop.json").read_text())["runs"]] == ["nope"]


def _counting_runs(monkeypatch, stop_after=None):
    """Patch the suite's run_task to record (attention, n_layer) of each run it trains; with ``stop_after``, the
    run after that many is interrupted as a kill would (KeyboardInterrupt is no job failure)."""
    from pathlab.tasks import suite

    real, trained = run_task, []

    def counted(task, attention, **kw):
        if stop_after is not None and len(trained) == stop_after:
            raise KeyboardInterrupt
        trained.append((attention, (kw.get("overrides") or {}).get("n_layer")))
        return real(task, attention, **kw)

    monkeypatch.setattr(suite, "run_task", counted)
    return trained


def test_an_interrupted_suite_resumes_and_keeps_what_finished(tmp_path, monkeypatch):
    quiet = dict(preset="tiny-cpu", tasks=["flipflop"], out_dir=tmp_path, log=lambda *_: None)
    steps = {"flipflop": {"steps": 2}}
    _counting_runs(monkeypatch, stop_after=1)
    with pytest.raises(KeyboardInterrupt):
        run_suite(attentions=["rope", "nope"], overrides=steps, **quiet)
    path = tmp_path / "flipflop.json"
    doc = json.loads(path.read_text())
    assert [r["attention"] for r in doc["runs"]] == ["rope"] and doc["complete"] is False
    assert doc["planned"] == [{"attention": "nope"}, {"attention": "rope"}]

    trained = _counting_runs(monkeypatch)
    run_suite(attentions=["rope", "nope"], overrides=steps, **quiet)  # the same suite again: only nope trains
    again = json.loads(path.read_text())
    assert trained == [("nope", None)] and again["complete"] is True
    assert [r["attention"] for r in again["runs"]] == ["nope", "rope"] and again["runs"][1] == doc["runs"][0]

    run_suite(attentions=["fox"], overrides=steps, **quiet)  # other variants join the file
    merged = json.loads(path.read_text())
    assert [r["attention"] for r in merged["runs"]] == ["fox", "nope", "rope"] and merged["complete"] is True
    assert trained == [("nope", None), ("fox", None)]

    before = path.read_bytes()  # other settings or another preset: refused, the file untouched
    with pytest.raises(ValueError, match=r"flipflop\.json holds flipflop results of other settings .*steps: 2 there"):
        run_suite(attentions=["rope"], overrides={"flipflop": {"steps": 3}}, **quiet)
    with pytest.raises(ValueError, match="results of preset 'tiny-cpu', not 'cpu'.*delete or move the file"):
        run_suite(**{**quiet, "preset": "cpu"}, attentions=["rope"])
    assert path.read_bytes() == before and trained == [("nope", None), ("fox", None)]

    _counting_runs(monkeypatch, stop_after=0)  # stopped before its first job ended: only the plan, nothing to keep
    with pytest.raises(KeyboardInterrupt):
        run_suite(attentions=["rope"], overrides={"flipflop": {"steps": 3}}, **{**quiet, "out_dir": tmp_path / "b"})
    assert json.loads((tmp_path / "b" / "flipflop.json").read_text())["runs"] == []
    _counting_runs(monkeypatch, stop_after=0)
    with pytest.raises(KeyboardInterrupt):  # another suite may start there
        run_suite(attentions=["nope"], **{**quiet, "out_dir": tmp_path / "b"})
    assert json.loads((tmp_path / "b" / "flipflop.json").read_text())["planned"] == [{"attention": "nope"}]


def test_a5_depths_resume_in_their_chain(tmp_path, monkeypatch):
    quiet = dict(preset="tiny-cpu", tasks=["a5"], attentions=["nope"], out_dir=tmp_path, log=lambda *_: None,
                 overrides={"a5": {"steps": 2, "eval_every": 2}}, sweeps={"a5": {"lengths": [2], "layers": [1, 2]}})
    _counting_runs(monkeypatch, stop_after=1)
    with pytest.raises(KeyboardInterrupt):  # depths as jobs, the deepest first: depth 2 finished
        run_suite(parallel_depths=True, **quiet)
    (chain,) = json.loads((tmp_path / "a5_sweep.json").read_text())["chains"]
    assert chain["layers_tried"] == [2]
    trained = _counting_runs(monkeypatch)
    run_suite(**quiet)  # deepening one chain takes the depth it has
    doc = json.loads((tmp_path / "a5_sweep.json").read_text())
    assert trained == [("nope", 1)] and doc["complete"] is True
    assert doc["chains"][0]["layers_tried"] == [1, 2] and doc["chains"][0]["runs"][1] == chain["runs"][0]


def test_the_suite_refuses_an_unreadable_results_file(tmp_path):
    (tmp_path / "mqrar.json").write_text('{"task": "mqrar", "ru')
    with pytest.raises(ValueError, match=r"mqrar\.json holds earlier results but cannot be read"):
        run_suite(preset="tiny-cpu", tasks=["mqrar"], attentions=["nope"], out_dir=tmp_path, log=lambda *_: None)
    with pytest.raises(ValueError, match="lies under .*which is a file"):
        run_suite(preset="tiny-cpu", tasks=["mqrar"], attentions=["nope"], out_dir=tmp_path / "mqrar.json")


def test_committed_results_resume_as_written(tmp_path, monkeypatch):
    """The committed files predate the plan and completeness fields: the suite that wrote one finds all its jobs
    done and leaves it as it is; one whose settings no longer resolve the same (no `compile` then) is refused,
    naming the setting."""
    import shutil
    from pathlib import Path

    from pathlab.tasks import suite

    committed = Path(__file__).resolve().parents[1] / "results" / "tasks" / "cpu"
    for name in ("mqrar.json", "flipflop.json"):
        shutil.copy(committed / name, tmp_path / name)
    monkeypatch.setattr(suite, "run_task", lambda *a, **k: pytest.fail("a committed run was trained again"))
    run_suite(preset="cpu", tasks=["mqrar"], attentions=["rope", "fox", "path"], out_dir=tmp_path,
              sweeps={"mqrar": {"n_back": [1, 2]}}, log=lambda *_: None,
              overrides={"mqrar": {"steps": 3000, "max_seconds": None, "stop_at": 0.99}})
    assert (tmp_path / "mqrar.json").read_bytes() == (committed / "mqrar.json").read_bytes()
    with pytest.raises(ValueError, match="other settings .*compile: absent there, 'none' in this suite"):
        run_suite(preset="cpu", tasks=["flipflop"], attentions=["rope"], out_dir=tmp_path, log=lambda *_: None)


def test_a_suite_refuses_a_folder_another_suite_writes(tmp_path, monkeypatch):
    """Two suites resuming into one folder would each rewrite its files without the other's records."""
    from pathlab.atomic import DirectoryLock
    from pathlab.tasks import suite

    monkeypatch.setattr(suite, "run_task", lambda *a, **k: pytest.fail("trained while another suite writes"))
    (tmp_path / ".flipflop.json.abc.tmp").write_text("{")  # left by a killed write
    with DirectoryLock(tmp_path):
        with pytest.raises(ValueError, match=f"another suite writes there: {tmp_path} is in use"):
            run_suite(preset="tiny-cpu", tasks=["flipflop"], attentions=["nope"], out_dir=tmp_path,
                      log=lambda *_: None)
    monkeypatch.undo()
    run_suite(preset="tiny-cpu", tasks=["flipflop"], attentions=["nope"], out_dir=tmp_path, log=lambda *_: None,
              overrides={"flipflop": {"steps": 2}})
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "flipflop.json"]
