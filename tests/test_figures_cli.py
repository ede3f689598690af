"""`pathlab figures`: argument handling, staging (a failing notebook changes nothing), declared outputs, the
summary table, parameter checks and output folders."""

import argparse

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from pathlab.figures import pipeline as figures
from pathlab.cli import main


def _args(**kw):
    parser = argparse.ArgumentParser()
    figures.add_arguments(parser)
    ns = parser.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def _notebook(path, body, outputs=(), study_figures=()):
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["pathlab"] = {"study_figures": list(study_figures), "writes": list(outputs)}
    params = new_code_cell('profile = "tiny-cpu"\nfast = False\nout_dir = None')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, new_code_cell(body)]
    nbformat.write(nb, path)


WRITE = ("import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\nfrom pathlab import results\n"
         "fig, ax = plt.subplots()\n")


def test_unknown_profile_is_rejected(capsys):
    assert main(["figures", "--profile", "huge"]) == 2
    assert "no study named 'huge'" in capsys.readouterr().err


def test_unknown_notebook_names_the_choices(tmp_path, capsys):
    _notebook(tmp_path / "good.ipynb", "pass")
    assert figures.run(_args(notebooks=str(tmp_path), only=["nope"])) == 2
    err = capsys.readouterr().err
    assert "unknown notebook nope" in err and "good" in err


def test_missing_notebook_folder(tmp_path, capsys):
    assert figures.run(_args(notebooks=str(tmp_path / "absent"))) == 2
    assert "no notebook folder" in capsys.readouterr().err


@pytest.mark.notebooks
def test_a_failing_notebook_leaves_nothing_and_the_others_run(tmp_path, capsys):
    nbdir = tmp_path / "nbs"
    nbdir.mkdir()
    # a figure saved before the error must not reach the figure folder
    _notebook(nbdir / "a_fails.ipynb", WRITE + "results.save_figure(fig, 'a_fails', out_dir)\n"
              "raise RuntimeError('deliberate failure')", outputs=["a_fails"])
    _notebook(nbdir / "b_works.ipynb", WRITE + "results.save_figure(fig, 'b_works', out_dir)\n"
              "results.write_results('b_works', data={'x': [1]}, claims={'ok': fast, 'open': None},"
              " checks={'identity': True}, out_dir=out_dir)", outputs=["b_works"])
    _notebook(nbdir / "c_silent.ipynb", "pass", outputs=["c_silent"])  # declares an output it never writes
    out = tmp_path / "fig"
    code = figures.run(_args(notebooks=str(nbdir), out_dir=str(out), build_dir=str(tmp_path / "build"), fast=True))
    captured = capsys.readouterr()
    assert code == 1
    assert "deliberate failure" in captured.out and "a_fails" in captured.err and "c_silent" in captured.err
    assert "did not write its declared outputs ['c_silent']" in captured.out
    # each notebook's row shows its own results only
    assert "b_works: 1/2 claims held; undefined: open; 1/1 checks passed" in captured.out
    assert sorted(p.name for p in out.iterdir()) == ["b_works.json", "b_works.pdf", "b_works.png"]
    assert (tmp_path / "build" / "tiny-cpu-fast" / "a_fails.ipynb").exists()  # executed copy kept for inspection


@pytest.mark.notebooks
def test_no_figure_folder_appears_when_every_notebook_fails(tmp_path):
    nbdir = tmp_path / "nbs"
    nbdir.mkdir()
    _notebook(nbdir / "bad.ipynb", "raise ValueError('bad parameter')", outputs=["bad"])
    out = tmp_path / "figures" / "new-profile"
    assert figures.run(_args(notebooks=str(nbdir), out_dir=str(out), build_dir=str(tmp_path / "b"), fast=True)) == 1
    assert not out.exists()


@pytest.mark.notebooks
def test_a_gpu_studys_figures_use_its_committed_cells(tmp_path, capsys):
    """A notebook that reads a study's cells, for a study trained on a GPU: nothing is trained here, the figure
    runs on the committed results and the cells not yet run are named."""
    nbdir = tmp_path / "nbs"
    nbdir.mkdir()
    _notebook(nbdir / "reads.ipynb", WRITE + "results.save_figure(fig, 'reads', out_dir)\n"
              "results.write_results('reads', data={}, claims={}, checks={}, out_dir=out_dir)", outputs=["reads"],
              study_figures=["ablations"])
    out = tmp_path / "fig"
    assert figures.run(_args(notebooks=str(nbdir), out_dir=str(out), build_dir=str(tmp_path / "b"),
                             profile="owt16-debian")) == 0
    assert (out / "reads.png").is_file()
    from pathlab import study as studies

    owt = studies.load_study("owt16-debian")
    missing = studies.missing_cells(owt, owt["figures"]["ablations"])  # none, once the study is complete
    err = capsys.readouterr().err
    assert (f"study owt16-debian has no results yet for {', '.join(missing)} " in err) == bool(missing)


def test_list_notebooks(tmp_path, capsys):
    _notebook(tmp_path / "x.ipynb", "pass")
    assert figures.run(_args(notebooks=str(tmp_path), list=True)) == 0
    assert "x" in capsys.readouterr().out


def test_unknown_cells_are_named(tmp_path, capsys):
    _notebook(tmp_path / "x.ipynb", "pass")
    assert figures.run(_args(notebooks=str(tmp_path), variants="rope,bogus")) == 2
    assert "--variants: unknown ['bogus']; the study 'tiny-cpu' has" in capsys.readouterr().err


@pytest.mark.parametrize("kw, name", [({"profile": "big"}, "profile"), ({"fast": "yes"}, "fast"),
                                      ({"out_dir": 3}, "out_dir"), ({"seed": -1}, "seed"),
                                      ({"variants": "rope,bogus"}, "variants"), ({"variants": 3}, "variants"),
                                      ({"near_width": 33}, "near_width"), ({"near_width": True}, "near_width")])
def test_check_parameters(kw, name):
    """Every parameter is checked before the notebook draws anything; the study's own values pass."""
    params = {"profile": "owt16-debian", "fast": False, "out_dir": None, "seed": 0} | kw
    with pytest.raises(ValueError, match=name):
        figures.check_parameters(**params)


@pytest.mark.parametrize("kw", [{}, {"variants": "rope,path", "near_width": 64},
                                {"variants": ["alibi"], "near_width": "per-head"}, {"near_width": "128"}])
def test_check_parameters_passes_the_studys_own_values(kw):
    figures.check_parameters(profile="owt16-debian", fast=False, out_dir=None, **kw)


def test_out_dirs_and_project_path(tmp_path, monkeypatch):
    assert figures.profiles() == ["owt16-debian", "tiny-cpu"]
    assert figures.default_out_dir("tiny-cpu", False) == "figures"
    assert figures.default_out_dir("owt16-debian", False) == "figures/owt16-debian"
    assert figures.default_out_dir("owt16-debian", True) == "build/figures-fast/owt16-debian"
    # a notebook run on its own writes to a build folder, never into figures/
    assert figures.notebook_out_dir("tiny-cpu", False).parts[-3:] == ("build", "figures", "tiny-cpu")
    assert figures.notebook_out_dir("tiny-cpu", True).name == "tiny-cpu-fast"
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "pyproject.toml").write_text("")
    monkeypatch.chdir(tmp_path / "notebooks")  # as in JupyterLab
    assert figures.project_path("figures") == tmp_path / "figures"
    assert figures.notebook_out_dir("x", False, "elsewhere") == tmp_path / "elsewhere"


def test_scale_note_marks_toy_models_and_missing_cells():
    note = figures.scale_note({"study": "tiny-cpu", "toy_scale": True, "missing": ["path"]})
    assert "pipeline check, not evidence" in note and "not yet run: path" in note
    assert figures.scale_note({"study": "owt16-debian", "description": "16 layers, one H200", "toy_scale": False,
                               "missing": []}) == "study owt16-debian (16 layers, one H200)"
