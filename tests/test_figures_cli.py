"""`pathlab figures`: argument handling, failing notebooks reported while the others run, parameter checks."""

import argparse

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from pathlab import figures
from pathlab.cli import main


def _args(**kw):
    parser = argparse.ArgumentParser()
    figures.add_arguments(parser)
    ns = parser.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def _notebook(path, body):
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = new_code_cell('profile = "tiny-cpu"\nfast = False\nout_dir = "figures"')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, new_code_cell(body)]
    nbformat.write(nb, path)


def test_unknown_profile_is_rejected(capsys):
    with pytest.raises(SystemExit) as err:
        main(["figures", "--profile", "huge"])
    assert err.value.code == 2
    assert "invalid choice: 'huge'" in capsys.readouterr().err


def test_unknown_notebook_names_the_choices(tmp_path, capsys):
    _notebook(tmp_path / "good.ipynb", "pass")
    assert figures.run(_args(notebooks=str(tmp_path), only=["nope"])) == 2
    err = capsys.readouterr().err
    assert "unknown notebook nope" in err and "good" in err


def test_missing_notebook_folder(tmp_path, capsys):
    assert figures.run(_args(notebooks=str(tmp_path / "absent"))) == 2
    assert "no notebook folder" in capsys.readouterr().err


@pytest.mark.notebooks
def test_failing_notebook_is_reported_and_others_run(tmp_path, capsys):
    nbdir = tmp_path / "nbs"
    nbdir.mkdir()
    _notebook(nbdir / "a_fails.ipynb",
              "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\nfrom pathlab import results\n"
              "fig, ax = plt.subplots()\nraise RuntimeError('deliberate failure')\n"
              "results.save_figure(fig, 'a_fails', out_dir)")
    _notebook(nbdir / "b_works.ipynb",
              "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\nfrom pathlab import results\n"
              "fig, ax = plt.subplots()\nresults.save_figure(fig, 'b_works', out_dir)\n"
              "results.write_results('b_works', data={'x': [1]}, claims={'ok': fast}, out_dir=out_dir)")
    out = tmp_path / "fig"
    code = figures.run(_args(notebooks=str(nbdir), out_dir=str(out), build_dir=str(tmp_path / "build"), fast=True))
    captured = capsys.readouterr()
    assert code == 1
    assert "deliberate failure" in captured.out and "a_fails" in captured.err
    assert "b_works: 1/1 held" in captured.out
    assert sorted(p.name for p in out.iterdir()) == ["b_works.json", "b_works.pdf", "b_works.png"]
    assert (tmp_path / "build" / "tiny-cpu-fast" / "a_fails.ipynb").exists()  # executed copy kept for inspection


def test_list_notebooks(tmp_path, capsys):
    _notebook(tmp_path / "x.ipynb", "pass")
    assert figures.run(_args(notebooks=str(tmp_path), list=True)) == 0
    assert "x" in capsys.readouterr().out


@pytest.mark.parametrize("kw, name", [({"profile": "big"}, "profile"), ({"fast": "yes"}, "fast"),
                                      ({"out_dir": 3}, "out_dir"), ({"seed": -1}, "seed")])
def test_check_parameters(kw, name):
    params = {"profile": "tiny-cpu", "fast": False, "out_dir": "figures", "seed": 0} | kw
    with pytest.raises(ValueError, match=name):
        figures.check_parameters(**params)


def test_default_out_dirs_and_project_path(tmp_path, monkeypatch):
    assert figures.default_out_dir("tiny-cpu", False) == "figures"
    assert figures.default_out_dir("owt16", False) == "figures/owt16"
    assert figures.default_out_dir("owt16", True) == "build/figures-fast/owt16"
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "pyproject.toml").write_text("")
    monkeypatch.chdir(tmp_path / "notebooks")  # as in JupyterLab
    assert figures.project_path("figures") == tmp_path / "figures"


def test_variants_option_and_variants_for(tmp_path, capsys):
    from pathlab.probes import study

    nb = tmp_path / "m.ipynb"
    _notebook(nb, "pass")
    book = nbformat.read(nb, as_version=4)
    book.metadata["pathlab"] = {"variants": ["rope"]}
    nbformat.write(book, nb)
    assert figures.notebook_variants(nb) == ["rope"]
    assert figures.run(_args(notebooks=str(tmp_path), variants="rope,bogus", out_dir=str(tmp_path / "o"))) == 2
    assert "unknown variants ['bogus']" in capsys.readouterr().err
    assert study.variants_for("value_incoherence", False, only="rot_random_qkv") == ["rot_random_qkv"]
    assert study.variants_for("far_mass", True) == ["rope", "alibi", "rot_random_qk", "rot_random_qkv"]
    with pytest.raises(ValueError, match="variants"):
        study.variants_for("far_mass", False, only=["nope?"])
    with pytest.raises(ValueError, match="unknown figure"):
        study.variants_for("nothing", False)
