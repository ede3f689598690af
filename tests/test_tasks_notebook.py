"""The state-tracking report (tables, claims, figure) and a fast papermill run of notebooks/state_tracking.ipynb."""

import json
from pathlib import Path

import pytest

from pathlab.tasks import report

ROOT = Path(__file__).resolve().parents[1]


def _suite(tmp_path, ff_errors, mq_acc, a5_min, layers=(1, 2, 3)):
    """Write a minimal suite folder: ff_errors {att: (id, sparse, dense)} fractions, mq_acc {att: {N: acc}},
    a5_min {att: {k: min layers or None}}."""
    runs = [{"attention": a, "steps": 10, "train_seconds": 1.0,
             "summary": {"read_error": dict(zip(report.SPLITS, e)), "n_reads": dict.fromkeys(report.SPLITS, 100)}}
            for a, e in ff_errors.items()]
    (tmp_path / "flipflop.json").write_text(json.dumps({"task": "flipflop", "runs": runs}))
    tiny = {"n_pairs": 4, "length": 48, "vocab_size": 64}  # blind guesses score 15-30% here
    runs = [{"attention": a, "settings": {"n_back": n, **tiny}, "summary": {"accuracy": acc}}
            for a, t in mq_acc.items() for n, acc in t.items()]
    (tmp_path / "mqrar.json").write_text(json.dumps({"task": "mqrar", "runs": runs}))
    chains = [{"attention": a, "length": k, "min_layers": m,
               "layers_tried": [d for d in layers if m is None or d <= m],
               "runs": [{"settings": {"n_layer": 1}, "summary": {"sequence_accuracy": 0.5}}]}
              for a, t in a5_min.items() for k, m in t.items()]
    (tmp_path / "a5_sweep.json").write_text(json.dumps({"chains": chains, "layers": list(layers), "solved_at": 0.9}))
    return tmp_path


def test_tables_and_claims_follow_the_numbers(tmp_path):
    good = _suite(tmp_path, {"path": (0.0, 0.0005, 0.0), "rope": (0.07, 0.40, 0.0), "fox": (0.08, 0.36, 0.0)},
                  {"path": {1: 1.0, 2: 0.9, 3: 0.8}, "rope": {1: 1.0, 2: 0.5, 3: 0.3}, "fox": {2: 0.6, 3: 0.2}},
                  {"path": {4: 1, 8: 2}, "rope": {4: 2, 8: None}})
    data = report.state_tracking_data(good)
    assert [r["attention"] for r in data["flipflop"]] == ["rope", "fox", "path"]
    assert data["flipflop"][2]["sparse_percent"] == pytest.approx(0.05)
    assert data["flipflop"][0]["paper_sparse_percent"] == 40.3
    assert data["a5_min_layers"] == {"rope": {4: 2, 8: None}, "path": {4: 1, 8: 2}}
    assert data["mqrar_accuracy"]["fox"] == {2: 0.6, 3: 0.2}
    assert set(data["mqrar_baselines"]) == {1, 2, 3}
    assert 2 / 64 < data["mqrar_baselines"][2]["frequent_value"] < data["mqrar_baselines"][2]["key_blind"] < 0.5
    assert all(report.state_tracking_claims(data).values()) and len(report.state_tracking_claims(data)) == 7
    assert "| PaTH | 0% / 0% | 0.05% / 0.0001% |" in report.format_flipflop_table(data["flipflop"])
    digest = report.summary_markdown(good)
    assert "| RoPE | 2 | — |" in digest and "| PaTH | 100.0% | 90.0% | 80.0% |" in digest
    assert "`a5_path_needs_no_more_layers_than_rope`: held" in digest

    partial = _suite(tmp_path, {"path": (0.0, 0.0, 0.0)}, {"path": {2: 0.5}},
                     {"path": {3: 1, 4: 2}, "rope": {4: None}})  # RoPE not run at k = 3
    assert "| RoPE | n/a | — |" in report.summary_markdown(partial)

    bad = _suite(tmp_path, {"path": (0.002, 0.01, 0.0), "rope": (0.07, 0.015, 0.0)},
                 {"path": {2: 0.5, 3: 0.8}, "rope": {2: 0.6, 3: 0.3}, "fox": {2: 0.1, 3: 0.1}},
                 {"path": {4: 3, 8: None}, "rope": {4: 2, 8: None}})
    claims = report.state_tracking_claims(report.state_tracking_data(bad))
    assert claims == {"flipflop_path_in_dist_error_at_most_0.1pct": False,
                      "flipflop_path_sparse_error_at_most_0.1pct": False,
                      "flipflop_rope_sparse_error_clearly_above_path": False,
                      "mqrar_path_recalls_beyond_the_key_blind_guess_for_n_2_and_3": True,
                      "mqrar_path_above_rope_and_fox_for_n_2_and_3": False,
                      "a5_path_needs_no_more_layers_than_rope": False,
                      "a5_path_needs_fewer_layers_than_rope_at_some_length": False}
    fig = report.plot_state_tracking(report.state_tracking_data(bad))
    assert len(fig.axes) == 4


def test_a5_claims_respect_depths_not_tried(tmp_path):
    # depths 2-4 tried: a chain solved at depth 2 says "at most 2", so PaTH at <=2 against RoPE at <=2 is
    # undecided, and the separation holds only where RoPE needed a depth that PaTH's bound beats
    ff, mq = {"path": (0.0, 0.0, 0.0)}, {}
    tie = report.state_tracking_data(_suite(tmp_path, ff, mq, {"path": {4: 2}, "rope": {4: 2}}, layers=(2, 3, 4)))
    claims = report.state_tracking_claims(tie)
    assert claims["a5_path_needs_no_more_layers_than_rope"] is None
    assert claims["a5_path_needs_fewer_layers_than_rope_at_some_length"] is None
    assert "| PaTH | ≤2 |" in report.summary_markdown(tmp_path)
    apart = report.state_tracking_data(_suite(tmp_path, ff, mq, {"path": {4: 2, 16: 2}, "rope": {4: 2, 16: None}},
                                              layers=(2, 3, 4)))
    claims = report.state_tracking_claims(apart)
    assert claims["a5_path_needs_fewer_layers_than_rope_at_some_length"] is True
    assert claims["a5_path_needs_no_more_layers_than_rope"] is None  # k = 4 stays undecided
    behind = report.state_tracking_data(_suite(tmp_path, ff, mq, {"path": {8: 3, 16: None}, "rope": {8: 2, 16: 4}},
                                               layers=(2, 3, 4)))
    claims = report.state_tracking_claims(behind)  # the negative control: RoPE ahead at every length
    assert claims["a5_path_needs_fewer_layers_than_rope_at_some_length"] is False
    assert claims["a5_path_needs_no_more_layers_than_rope"] is False
    assert report.a5_depth_bounds(None, (2, 3, 4)) == (5, 5) and report.a5_depth_bounds(3, (2, 3, 4)) == (3, 3)
    fig = report.plot_state_tracking(apart)
    assert [t.get_text() for t in fig.axes[1].get_yticklabels()] == ["≤2", "3", "4", ">4"]


def test_mqrar_comparison_is_undecided_while_path_sits_at_the_blind_guess(tmp_path):
    # PaTH ahead of RoPE and FoX, but every model below the best key-blind guess (about 28% here): none recalls
    folder = _suite(tmp_path, {"path": (0.0, 0.0, 0.0)},
                    {"path": {2: 0.2, 3: 0.2}, "rope": {2: 0.1, 3: 0.1}, "fox": {2: 0.05, 3: 0.05}}, {})
    data = report.state_tracking_data(folder)
    claims = report.state_tracking_claims(data)
    assert claims["mqrar_path_recalls_beyond_the_key_blind_guess_for_n_2_and_3"] is False
    assert claims["mqrar_path_above_rope_and_fox_for_n_2_and_3"] is None
    digest = report.summary_markdown(folder)
    assert "`mqrar_path_above_rope_and_fox_for_n_2_and_3`: undecided" in digest
    assert "| *best key-blind guess* |" in digest


def test_find_results_prefers_complete_folders(tmp_path):
    assert report.find_results(tmp_path) is None
    (tmp_path / "cpu").mkdir()
    _suite(tmp_path / "cpu", {"path": (0, 0, 0)}, {"path": {1: 1.0}}, {"path": {4: 1}})
    (tmp_path / "h200").mkdir()
    (tmp_path / "h200" / "flipflop.json").write_text("{}")  # incomplete: skipped
    assert report.find_results(tmp_path) == tmp_path / "cpu"


def test_a_truncated_suite_file_is_refused_with_its_path(tmp_path):
    _suite(tmp_path, {"path": (0, 0, 0)}, {"path": {1: 1.0}}, {"path": {4: 1}})
    assert set(report.load_suite(tmp_path)) == {"flipflop", "mqrar", "a5"}
    path = tmp_path / "mqrar.json"
    path.write_text(path.read_text()[:40])
    with pytest.raises(ValueError, match=r"mqrar\.json cannot be read"):
        report.load_suite(tmp_path)


@pytest.mark.notebooks
def test_state_tracking_notebook_fast(tmp_path, monkeypatch):
    from pathlab.figures.pipeline import collect_outputs, run_notebook

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the kernel inherits it: tiny models, one thread

    ok, error = run_notebook(ROOT / "notebooks" / "state_tracking.ipynb", tmp_path / "executed.ipynb",
                             {"profile": "tiny-cpu", "fast": True, "out_dir": str(tmp_path / "fig"),
                              "retrain": True}, ROOT)
    assert ok, error
    (res,), absent = collect_outputs(tmp_path / "fig", ["state_tracking"])
    assert not absent
    assert res["stem"] == "state_tracking" and res["figure"]
    record = json.loads((tmp_path / "fig" / "state_tracking.json").read_text())
    assert record["parameters"] == {"profile": "tiny-cpu", "fast": True, "retrain": True}
    assert record["data"]["source"].startswith("trained now with the tiny-cpu task preset")
    assert {r["attention"] for r in record["data"]["flipflop"]} == {"rope", "fox", "path", "path_fox"}
    assert set(record["data"]["a5_min_layers"]) == {"rope", "fox", "path", "path_fox"}
    # every claim is there: those the tiny-cpu runs decide as booleans (tiny models need not satisfy them), the
    # MQRAR-N ones undecided (its sweep stops at N = 2)
    assert list(record["claims"]) == list(report.CLAIMS)
    assert all(isinstance(v, bool) if not k.startswith("mqrar") else v is None for k, v in record["claims"].items())
    assert record["data"]["complete"] == {"flipflop": True, "mqrar": True, "a5": True}
    assert (tmp_path / "fig" / "state_tracking.pdf").exists()


def _edit(path, **fields):
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, **fields}))


def test_a_folder_mixing_presets_is_refused(tmp_path):
    """A tiny-cpu MQRAR-N file copied among the h200 results would be compared as if it were theirs."""
    import shutil

    folder = tmp_path / "h200"
    shutil.copytree(ROOT / "results" / "tasks" / "h200", folder)
    _suite(tmp_path, {}, {"rope": {1: 0.5}}, {})
    _edit(tmp_path / "mqrar.json", preset="tiny-cpu")
    shutil.copy(tmp_path / "mqrar.json", folder / "mqrar.json")
    for read in (report.load_suite, report.state_tracking_data, lambda f: report.find_results(f.parent)):
        with pytest.raises(ValueError, match=r"h200 mixes the results of several presets .*mqrar\.json: 'tiny-cpu'"):
            read(folder)


def test_an_unfinished_suite_leaves_the_claims_that_need_it_undecided(tmp_path):
    folder = _suite(tmp_path, {"path": (0.0, 0.0, 0.0), "rope": (0.07, 0.4, 0.0)},
                    {"path": {2: 0.9}, "rope": {2: 0.5, 3: 0.3}, "fox": {2: 0.6, 3: 0.2}},
                    {"path": {4: 1, 8: 2}, "rope": {4: 2, 8: None}})
    doc = json.loads((folder / "a5_sweep.json").read_text())
    doc["chains"][-1]["layers_tried"] = [1]  # RoPE at k = 8: depths 2 and 3 did not finish
    (folder / "a5_sweep.json").write_text(json.dumps(doc))
    as_written = report.state_tracking_claims(report.state_tracking_data(folder))
    assert as_written["a5_path_needs_fewer_layers_than_rope_at_some_length"] is True
    plan = [{"attention": a, "n_back": n} for a in ("fox", "path", "rope") for n in (2, 3)]
    _edit(folder / "mqrar.json", planned=plan, complete=False)  # PaTH at N = 3 did not finish
    _edit(folder / "a5_sweep.json", planned=[{"attention": a, "length": k} for a in ("path", "rope") for k in (4, 8)],
          complete=False)  # nor RoPE's chain at k = 8
    _edit(folder / "flipflop.json", planned=[{"attention": "path"}, {"attention": "rope"}], complete=True)
    data = report.state_tracking_data(folder)
    assert data["complete"] == {"flipflop": True, "mqrar": False, "a5": False}
    assert data["missing"] == {"mqrar": [{"attention": "path", "n_back": 3}],
                               "a5": [{"attention": "rope", "length": 8}]}
    claims = report.state_tracking_claims(data)
    assert list(claims) == list(report.CLAIMS)  # every claim is there, those without their runs undecided
    assert claims["flipflop_path_sparse_error_at_most_0.1pct"] is True
    assert all(claims[c] is None for c in report.CLAIMS[3:])
    digest = report.summary_markdown(folder)
    assert "- `mqrar.json`: PaTH N=3" in digest and "- `a5_sweep.json`: RoPE k=8" in digest
    assert "`a5_path_needs_fewer_layers_than_rope_at_some_length`: undecided" in digest


def test_committed_results_load_as_complete_and_keep_their_claims():
    """The committed files predate the plan and completeness fields: complete as written, their claims as the
    committed figure recorded them."""
    data = report.state_tracking_data(ROOT / "results" / "tasks" / "h200")
    assert data["complete"] == {"flipflop": True, "mqrar": True, "a5": True} and data["missing"] == {}
    figure = json.loads((ROOT / "figures" / "state_tracking.json").read_text())
    assert report.state_tracking_claims(data) == figure["claims"]
    assert report.find_results(ROOT / "results" / "tasks") == ROOT / "results" / "tasks" / "h200"
