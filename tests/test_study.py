"""`pathlab study`: config checks, cell configs, the per-cell pipeline (train, evaluate, probe, record) and resume
within a time budget, on a synthetic corpus."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from pathlab import study as studies
from pathlab.study import cells as study_cells, cli as study_cli, config as study_config
from pathlab.training.checkpoint import load_checkpoint
from pathlab.probes import records

from test_train import corpus  # noqa: F401  (the module-scoped synthetic corpus fixture)


def _study(corpus, tmp_path, **extra):  # noqa: F811
    return {
        "name": "unit", "results_dir": str(tmp_path / "results"), "reserve_s": 0,
        "train_config": {
            "name": "unit", "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "attention": "rope"},
            "data": {"corpus": str(corpus), "block_size": 32},
            "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_iters": 2},
            "train": {"max_iters": 6, "batch_size": 4, "device": "cpu", "eval_interval": 0, "eval_iters": 1,
                      "ckpt_interval": 2, "log_interval": 1}},
        "eval": {"lengths": [32, 64, 128], "n_windows": 3, "seed": 5},
        "probes": {"lengths": [32, 128], "m2_length": 128, "n_windows": 1, "n_queries": 4, "span": 16,
                   "near": [4, 8], "m2_windows": 2, "angle_lag": 63},
        "cells": {"rope": {"attention": "rope"},
                  "qkv": {"attention": "rot_random_qkv", "overrides": {"train.max_iters": 4}}},
        "figures": {"far_mass": ["rope", "qkv"]}, **extra}


@pytest.fixture()
def runs(tmp_path, monkeypatch):
    monkeypatch.setenv("PATHLAB_RUNS", str(tmp_path / "runs"))
    return tmp_path / "runs"


def test_bad_study_configs_name_the_problem(corpus, tmp_path):  # noqa: F811
    good = _study(corpus, tmp_path)
    for change, message in (({"cells": {}}, "non-empty"), ({"cells": {"a": {}}}, "needs at least an 'attention'"),
                            ({"eval": {"lenghts": [1]}}, "unknown keys"), ({"bogus": 1}, "unknown keys"),
                            ({"figures": {"far_mass": ["nope"]}}, "unknown cells")):
        with pytest.raises(ValueError, match=message):
            studies.load_study({**good, **change})
    with pytest.raises(ValueError, match="no study named"):
        studies.load_study("no-such-study")
    with pytest.raises(ValueError, match="no 'fast' section"):
        studies.load_study(good, fast=True)
    with pytest.raises(ValueError, match="unknown cell"):
        studies.cell_config(studies.load_study(good), "nope")


def test_a_study_file_that_is_not_a_yaml_mapping_is_named_with_its_line(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("name: broken\ncells: {rope: {attention: rope}\n")
    with pytest.raises(ValueError, match=r"study: .*broken.yaml is not valid YAML: .*\(line 3, column 1\)"):
        studies.load_study(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ValueError, match=r"study: .*broken.yaml must hold a mapping at the top level"):
        studies.load_study(bad)


def test_the_shipped_studies_resolve_every_cell():
    for name in studies.available_studies():
        s = studies.load_study(name)
        for cell in s["cells"]:
            cfg = studies.cell_config(s, cell)
            assert cfg["model"]["attention"] == s["cells"][cell]["attention"]
    owt = studies.load_study("owt16-debian")
    rope = studies.cell_config(owt, "rope")
    tokens = rope["train"]["max_iters"] * rope["train"]["batch_size"] * rope["data"]["block_size"]
    assert tokens >= 100e6 and rope["model"]["n_layer"] == 16 and rope["data"]["corpus"] == "debian"
    fast = studies.load_study("tiny-cpu", fast=True)
    assert fast["name"] == "tiny-cpu-fast" and fast["results_dir"].endswith("tiny-cpu-fast")


def test_a_cell_runs_end_to_end_and_is_skipped_once_done(corpus, tmp_path, runs):  # noqa: F811
    s = studies.load_study(_study(corpus, tmp_path))
    assert studies.cell_status(s, "rope") == "missing"
    assert studies.run_study(s, "rope", progress=False) == {"rope": "done"}
    out = studies.cell_results_dir(s, "rope")
    assert sorted(p.name for p in out.iterdir()) == ["cell.json", "eval.csv", "eval.json", "eval_positions.csv",
                                                    "probes.npz", "train.csv"]
    cell = json.loads((out / "cell.json").read_text())
    assert cell["tokens"] == 6 * 4 * 32 and cell["fingerprint"] == study_config.cell_fingerprint(s, "rope")
    ev = json.loads((out / "eval.json").read_text())
    assert set(ev["lengths"]) == {"32", "64", "128"} and ev["n_windows"] == 3
    rec = records.load_record(out / "probes.npz")
    assert rec["lengths"] == [32, 128] and list(rec["width_labels"]) == ["per-head", "4", "8"]
    assert rec["L128"]["heads"]["far_mass"].shape == (2, 3, 2)
    lines = (out / "train.csv").read_text().splitlines()
    assert lines[0].startswith("step,loss") and len(lines) == 1 + 6 + 1  # every iteration, the final val_loss
    assert studies.cell_status(s, "rope") == "done"
    before = (out / "cell.json").stat().st_mtime_ns
    assert studies.run_study(s, "rope", progress=False) == {"rope": "done"}
    assert (out / "cell.json").stat().st_mtime_ns == before  # skipped
    loaded = studies.load_cells(s, ["rope", "qkv"])
    assert list(loaded) == ["rope"] and studies.missing_cells(s, ["rope", "qkv"]) == ["qkv"]


def test_changed_config_makes_results_stale(corpus, tmp_path, runs):  # noqa: F811
    s = studies.load_study(_study(corpus, tmp_path))
    studies.run_study(s, "qkv", progress=False)
    changed = studies.load_study({**_study(corpus, tmp_path), "eval": {"lengths": [32, 64], "n_windows": 3}})
    assert studies.cell_status(changed, "qkv") == "stale"
    assert studies.run_study(changed, "qkv", progress=False) == {"qkv": "failed"}


def test_a_time_budget_pauses_training_and_the_same_call_continues(corpus, tmp_path, runs):  # noqa: F811
    s = studies.load_study(_study(corpus, tmp_path))
    s["cells"]["rope"]["overrides"] = {"train.max_iters": 400}
    t0 = time.monotonic()
    assert studies.run_study(s, "rope", budget_s=1.0, progress=False) == {"rope": "paused"}
    assert time.monotonic() - t0 < 30
    assert studies.cell_status(s, "rope") == "partial"
    first_call = time.monotonic() - t0
    run = studies.run_dir(s, "rope")
    step = int(load_checkpoint(run / "ckpt.pt")["step"])
    assert 0 < step < 400
    # The paused call's training time is kept; say an earlier call had trained for 1000 s.
    seconds_file = run / "study_train_seconds.json"
    assert 0 < json.loads(seconds_file.read_text())["train_s"] <= first_call
    seconds_file.write_text(json.dumps({"train_s": 1000.0}))
    s["cells"]["rope"]["overrides"] = {"train.max_iters": 400}
    t0 = time.monotonic()
    assert studies.run_study(s, "rope", progress=False) == {"rope": "done"}
    second_call = time.monotonic() - t0
    cell = json.loads((studies.cell_results_dir(s, "rope") / "cell.json").read_text())
    assert cell["iterations"] == 400
    assert 1000.0 < cell["seconds"]["train_s"] <= 1000.0 + second_call  # both calls' training, not the last one's


def test_no_stage_starts_without_the_reserve(corpus, tmp_path, runs):  # noqa: F811
    s = studies.load_study({**_study(corpus, tmp_path), "reserve_s": 3600})
    assert studies.run_study(s, budget_s=10, progress=False) == {"rope": "not started", "qkv": "not started"}
    assert studies.run_study(s, [], progress=False) == {}  # no cell missing: nothing to run, as figure_inputs asks
    with pytest.raises(ValueError, match=r"cells: unknown ' , '"):
        studies.run_study(s, " , ", progress=False)


def test_a_trained_run_of_another_config_is_refused_not_relabelled(corpus, tmp_path, runs, capsys):  # noqa: F811
    """The cell's results removed (as the stale message says) after its config changed: the finished run in runs/
    is of the old config, so the cell must not evaluate it under the new config's name."""
    s = studies.load_study(_study(corpus, tmp_path))
    assert studies.run_study(s, "rope", progress=False) == {"rope": "done"}
    shutil.rmtree(studies.cell_results_dir(s, "rope"))
    spec = {**s["cells"]["rope"], "overrides": {"optim.lr": 2e-2}}
    changed = studies.load_study({**_study(corpus, tmp_path), "cells": {**s["cells"], "rope": spec}})
    assert studies.cell_status(changed, "rope") == "trained"
    assert studies.run_study(changed, "rope", progress=False) == {"rope": "failed"}
    err = capsys.readouterr().err
    assert "cell 'rope': cannot resume" in err and "optim.lr" in err and "remove" in err
    assert not (studies.cell_results_dir(changed, "rope") / "cell.json").exists()


def test_a_corrupt_final_checkpoint_is_trained_again_not_evaluated_early(corpus, tmp_path, runs):  # noqa: F811
    """The final checkpoint corrupt after training: the trainer falls back to the previous one, and the cell
    continues training to the end before it evaluates, so its results are of the final model."""
    s = studies.load_study(_study(corpus, tmp_path))
    assert studies.run_study(s, "rope", progress=False) == {"rope": "done"}
    shutil.rmtree(studies.cell_results_dir(s, "rope"))
    ckpt = studies.run_dir(s, "rope") / "ckpt.pt"
    data = bytearray(ckpt.read_bytes())
    data[len(data) // 2:len(data) // 2 + 16] = b"\xff" * 16
    ckpt.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="ckpt.prev.pt"):
        assert studies.run_study(s, "rope", progress=False) == {"rope": "done"}
    cell = json.loads((studies.cell_results_dir(s, "rope") / "cell.json").read_text())
    assert cell["iterations"] == 6 and studies.load_cells(s, ["rope"])["rope"]["eval"]["checkpoint_step"] == 6


def test_figure_inputs_train_the_missing_cells_of_a_cpu_study(corpus, tmp_path, runs, monkeypatch):  # noqa: F811
    original = studies.load_study
    monkeypatch.setattr(study_cells, "load_study", lambda profile, fast=False: original(_study(corpus, tmp_path)))
    cells, info = studies.figure_inputs("unit", "far_mass")
    assert list(cells) == ["rope", "qkv"] and info["missing"] == [] and not info["toy_scale"]
    assert set(cells["qkv"]) == {"cell", "eval", "record"}
    with pytest.raises(ValueError, match="lists no cells for figure"):
        studies.figure_inputs("unit", "score_gaps")
    with pytest.raises(ValueError, match="variants: unknown"):
        studies.figure_inputs("unit", "far_mass", only="rope,bogus")


@pytest.mark.parametrize("name", ["cell.json", "eval.json", "probes.npz"])
def test_a_corrupt_result_file_is_refused_with_its_path(tmp_path, name):
    """A truncated result file stops loading with an error that names the file and the way back (git, or the cell
    run again), for the figures and for `pathlab study compare`; the committed cell loads as it is."""
    s = _committed_cells(tmp_path, "path-seed2")
    assert list(studies.load_cells(s, ["path-seed2"])) == ["path-seed2"]
    target = tmp_path / "path-seed2" / name
    target.write_bytes(target.read_bytes()[:200])
    with pytest.raises(ValueError, match=rf"cell 'path-seed2': .*{name} is refused: it cannot be read.*--cells "
                                         "path-seed2"):
        studies.load_cells(s, ["path-seed2"])
    if name == "eval.json":
        with pytest.raises(ValueError, match="eval.json is refused: it cannot be read"):
            study_cli._compare(s, "path-seed2", "path-seed2")


def test_a_damaged_probe_record_is_refused_wherever_it_is_damaged(tmp_path):
    """Bytes overwritten anywhere in ``probes.npz`` (the compressed data included), or an empty file: always the
    error naming the file, never a decoder's own exception."""
    s = _committed_cells(tmp_path, "path-seed2")
    target = tmp_path / "path-seed2" / "probes.npz"
    whole = target.read_bytes()
    for at in [*range(0, len(whole) - 16, len(whole) // 40), None]:
        target.write_bytes(b"" if at is None else whole[:at] + b"X" * 16 + whole[at + 16:])
        try:
            studies.load_cells(s, ["path-seed2"])
        except ValueError as err:
            assert "probes.npz is refused" in str(err)
        else:  # bytes the reader never uses (zip padding, a member's name in the central copy) may stay unnoticed
            assert at is not None
    target.write_bytes(whole)
    assert list(studies.load_cells(s, ["path-seed2"])) == ["path-seed2"]


def _committed_cells(tmp_path, *names):
    """The owt16-debian study reading copies of the committed results of ``names`` from ``tmp_path``."""
    owt = studies.load_study("owt16-debian")
    for name in names:
        shutil.copytree(studies.cell_results_dir(owt, name), tmp_path / name)
    return {**owt, "results_dir": str(tmp_path)}


@pytest.mark.parametrize("name, content, message", [
    ("cell.json", "[]", r"is not a result file of pathlab's \(it needs \['cell', 'fingerprint'"),
    ("eval.json", "{}", r"is not a result file of pathlab's \(it needs \['run', 'attention'"),
    ("eval.json", None, "belongs to cell 'path', not to 'rope'")])
def test_a_result_file_of_another_format_or_cell_is_refused(tmp_path, name, content, message):
    """Files that parse but cannot be this cell's results (another format; a copy of another cell's) stop the
    figures, the tables and `pathlab study compare` with the file's name, instead of feeding wrong numbers."""
    s = _committed_cells(tmp_path, "rope", "path")
    assert list(studies.load_cells(s, ["rope", "path"])) == ["rope", "path"]  # the negative control: as committed
    target = tmp_path / "rope" / name
    target.write_text(content if content is not None else (tmp_path / "path" / name).read_text())
    with pytest.raises(ValueError, match=rf"cell 'rope': .*rope/{name} is refused: it {message}.*--cells rope"):
        studies.load_cells(s, ["rope"])
    with pytest.raises(ValueError, match=rf"rope/{name} is refused"):
        study_cli._compare(s, "rope", "path")


def test_an_evaluation_of_another_checkpoint_is_refused(tmp_path):
    s = _committed_cells(tmp_path, "rope")
    path = tmp_path / "rope" / "eval.json"
    ev = json.loads(path.read_text())
    path.write_text(json.dumps({**ev, "checkpoint_step": ev["checkpoint_step"] - 1}))
    with pytest.raises(ValueError, match=r"eval.json is refused: it evaluated checkpoint_step \d+, the cell's"):
        studies.load_cells(s, ["rope"])


def test_stale_results_are_refused_by_the_readers(tmp_path, capsys):
    """Results of a cell whose config has changed since it ran (here its token budget) are refused by the figures'
    loader, the seed margins and `pathlab study compare`, not read as current; unchanged cells load."""
    s = _committed_cells(tmp_path, "rope", "rope-seed2", "path")
    assert list(studies.load_cells(s, ["rope", "path"])) == ["rope", "path"]
    changed = {**s, "cells": {**s["cells"], "rope": {**s["cells"]["rope"], "tokens": 50e6}}}
    assert studies.cell_status(changed, "rope") == "stale"
    for read in (lambda: studies.load_cells(changed, ["path", "rope"]), lambda: studies.seed_margins(changed),
                 lambda: study_cli._compare(changed, "rope", "path")):
        with pytest.raises(ValueError, match=r"cell 'rope': its results are stale: .*rope/cell.json records the "
                                             r"config \w+, the study config gives \w+"):
            read()
    assert list(studies.load_cells(changed, ["path"])) == ["path"]


def test_a_probe_record_of_another_cell_is_refused(corpus, tmp_path, runs):  # noqa: F811
    """``probes.npz`` names no cell itself: ``cell.json`` records its sha256, so a copy from another cell is
    refused where a JSON file would be."""
    s = studies.load_study(_study(corpus, tmp_path))
    assert studies.run_study(s, progress=False) == {"rope": "done", "qkv": "done"}
    assert list(studies.load_cells(s, ["rope", "qkv"])) == ["rope", "qkv"]  # the negative control
    target = studies.cell_results_dir(s, "rope") / "probes.npz"
    own = target.read_bytes()
    target.write_bytes((studies.cell_results_dir(s, "qkv") / "probes.npz").read_bytes())
    with pytest.raises(ValueError, match=r"rope/probes.npz is refused: its contents are not the record its "
                                         r"cell.json names"):
        studies.load_cells(s, ["rope"])
    target.write_bytes(own)
    assert list(studies.load_cells(s, ["rope"])) == ["rope"]


def test_a_cell_that_trains_from_the_start_counts_its_time_from_zero(corpus, tmp_path, runs):  # noqa: F811
    """A training-time file left in a run folder without a checkpoint (its checkpoints removed) belongs to a run
    that no longer exists: the new run's time is not added to it."""
    s = studies.load_study(_study(corpus, tmp_path))
    run = studies.run_dir(s, "rope")
    run.mkdir(parents=True)
    (run / "study_train_seconds.json").write_text(json.dumps({"train_s": 1000.0}))
    assert studies.run_study(s, "rope", progress=False) == {"rope": "done"}
    assert json.loads((studies.cell_results_dir(s, "rope") / "cell.json").read_text())["seconds"]["train_s"] < 1000


def test_a_damaged_training_time_file_restarts_the_count_with_a_warning(tmp_path, capsys):
    from pathlab.study.runner import TRAIN_SECONDS_NAME, _add_train_seconds

    (tmp_path / TRAIN_SECONDS_NAME).write_text('{"train_s": ')
    assert _add_train_seconds(tmp_path, 2.5) == 2.5
    assert "damaged" in capsys.readouterr().err
    assert _add_train_seconds(tmp_path, 1.0) == 3.5


def test_cells_scored_on_another_build_of_the_corpus_are_not_compared(tmp_path):
    """The windows two cells share are positions in the validation split: a cell of another build of the corpus
    (other package versions) held other text there. The figures' loader, the seed margins and `pathlab study
    compare` refuse the pair, naming each cell's split; the same cells from one build load (the control)."""
    s = _committed_cells(tmp_path, "rope", "rope-seed2", "path")
    assert list(studies.load_cells(s, ["rope", "path"])) == ["rope", "path"]
    assert study_cli._compare(s, "rope", "path") == 0
    assert studies.seed_margins(s)
    marker_path = tmp_path / "rope-seed2" / "cell.json"
    marker = json.loads(marker_path.read_text())
    marker["environment"]["corpus_identity"]["val_sha256"] = "0" * 64
    marker_path.write_text(json.dumps(marker))
    for read in (lambda: studies.load_cells(s, ["rope", "rope-seed2"]), lambda: studies.seed_margins(s),
                 lambda: study_cli._compare(s, "rope-seed2", "path")):
        with pytest.raises(ValueError, match=r"scored on different builds of the corpus \(validation split sha256: "
                                             r"rope \w{12}, rope-seed2 000000000000|rope-seed2 000000000000, path"):
            read()
    assert list(studies.load_cells(s, ["rope", "path"])) == ["rope", "path"]
