"""`pathlab study table`: the markdown tables of a study's results, on synthetic results, and the check
that the tables committed in the README and the study ledger are the ones the committed results give."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pathlab import study as studies
from pathlab.study import tables

ROOT = Path(__file__).resolve().parents[1]


def _eval(rng, lengths=(512, 2048, 8192, 32768, 65536), ntk=False):
    def section():
        out = {}
        for L in lengths:
            r = 1.0 if L == 512 else float(rng.uniform(1, 10))
            out[str(L)] = {"loss": float(rng.uniform(2, 4)), "ratio": r, "ratio_ci95": [r * 0.9, r * 1.1]}
        return out

    ev = {"train_length": 512, "lengths": section()}
    if ntk:
        ev["ntk"] = section()
    return ev


def _study(rng):
    """A study of three cells, two of them with results (``{cell: {"cell": …, "eval": …}}``)."""
    study = {"name": "unit",
             "cells": {"rope": {"attention": "rope", "group": "headline"},
                       "alibi": {"attention": "alibi", "group": "headline"},
                       "w16": {"attention": "rot_random_qk", "group": "sweep"}}}
    results = {}
    for name, ntk in (("rope", True), ("w16", False)):
        cell = {"tokens": 50003968, "iterations": 1526, "git_revision": f"{rng.integers(1 << 60):040x}",
                "seconds": {"train_s": 200.4, "eval_s": 53.6, "probes_s": 33.2},
                "environment": {"gpu": "NVIDIA H100 80GB HBM3"} if name == "w16" else {}}
        results[name] = {"cell": cell, "eval": _eval(rng, ntk=ntk)}
    return study, results


def _fmt(row):
    return f"{row['ratio']:.2f} [{row['ratio_ci95'][0]:.2f}, {row['ratio_ci95'][1]:.2f}]"


def test_tables_read_every_number_from_the_cell_files():
    study, results = _study(np.random.default_rng())
    cells = tables.render(study, "cells", results).splitlines()
    assert [line.split(" | ")[0] for line in cells[2:]] == ["| rope", "| w16"]  # alibi has no results: no row
    cell, ev = results["w16"]["cell"], results["w16"]["eval"]
    assert cells[3] == (f"| w16 | 50.0M | 1526 | {ev['lengths']['512']['loss']:.3f} | {_fmt(ev['lengths']['8192'])} | "
                        f"{_fmt(ev['lengths']['65536'])} | 200 / 54 / 33 | H100 | {cell['git_revision'][:7]} |")
    assert cells[2].endswith(f"| CPU | {results['rope']['cell']['git_revision'][:7]} |")  # no GPU recorded

    head = tables.render(study, "headline", results).splitlines()
    assert head[0].startswith("| cell | r(2K) | r(8K) | r(32K) | r(65K) |") and head[0].endswith("published |")
    cell, ev = results["rope"]["cell"], results["rope"]["eval"]
    assert head[2].split(" | ")[1:5] == [_fmt(ev["lengths"][str(L)]) for L in (2048, 8192, 32768, 65536)]
    assert head[2].endswith("| r(8K) = 16.2 |")
    assert head[3].startswith("| rope, NTK-scaled at evaluation | " + _fmt(ev["ntk"]["2048"]))
    assert head[4] == "| alibi | not yet run | | | | | | r(65K) = 0.96 |"
    assert all(line.count("|") == head[0].count("|") for line in head)

    sweep = tables.render(study, "sweep", results).splitlines()
    assert "published" not in sweep[0] and "NTK" not in "\n".join(sweep) and len(sweep) == 3


def test_an_unknown_group_is_an_error_naming_the_groups():
    study, results = _study(np.random.default_rng())
    with pytest.raises(ValueError, match="no cells in group 'bogus'; its groups: headline, sweep"):
        tables.render(study, "bogus", results)


def test_fill_replaces_only_this_studys_blocks_and_is_idempotent(tmp_path):
    study, results = _study(np.random.default_rng())
    other = "<!-- table: pathlab study table other cells -->\nstale\n<!-- end of table -->"
    doc = ("intro\n<!-- table: pathlab study table unit sweep -->\nstale\n<!-- end of table -->\nmiddle\n"
           f"{other}\nend\n")
    filled = tables.fill(doc, study, results)
    assert "stale\n<!-- end of table -->\nmiddle" not in filled and other in filled
    assert filled.startswith("intro\n") and filled.endswith("\nend\n") and "| w16 |" in filled
    assert tables.fill(filled, study, results) == filled
    path = tmp_path / "doc.md"
    path.write_text(doc)
    assert tables.write_tables(study, results, [path, tmp_path / "absent.md"]) == [path]
    assert path.read_text() == filled and tables.write_tables(study, results, [path]) == []


def test_committed_docs_show_the_committed_results():
    """README.md and every study ledger hold the tables their results give (rerun `pathlab study table <study>
    --write` after adding a cell's results)."""
    checked = 0
    for name in studies.available_studies():
        study = studies.load_study(name)
        for path in (ROOT / "README.md", studies.results_dir(study) / "README.md"):
            if path.is_file() and f"pathlab study table {name} " in path.read_text():
                text = path.read_text()
                results = studies.load_cells(study, study["cells"])
                assert tables.fill(text, study, results) == text, f"{path.name}: run `pathlab study table {name} --write`"
                checked += 1
    assert checked >= 2  # the README and the owt16-debian ledger carry tables


def test_cli_prints_tables_and_refuses_an_unknown_group(capsys):
    from pathlab.cli import main

    assert main(["study", "table", "owt16-debian", "window-sweep"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("window-sweep:\n| cell | r(2K)") and "| rot_window_qk_W256 | " in out
    assert main(["study", "table", "owt16-debian", "bogus"]) == 2
    assert "no cells in group 'bogus'" in capsys.readouterr().err


def test_paired_table_compares_the_shared_lengths_on_shared_windows():
    """Lengths only one cell has are left out; a cell scored on other windows gets no paired interval."""
    from pathlab.intervals import paired_ratio, paired_table

    rng = np.random.default_rng()

    def windowed(lengths):
        out = {}
        for L in lengths:
            d = rng.normal(0.1, 0.05, 8)  # loss − loss at the training context, per window
            out[str(L)] = {"ratio": float(np.exp(d.mean())), "window_loss": list(3.0 + d),
                           "window_loss_train_context": [3.0] * 8, "window_starts": list(range(0, 80, 10))}
        return {"train_length": 512, "lengths": out}

    a, b = windowed((512, 2048, 8192, 65536)), windowed((512, 2048, 8192))
    rows = paired_table(a, b)
    assert [r["length"] for r in rows] == [512, 2048, 8192]
    for r in rows:
        want = paired_ratio(a["lengths"][str(r["length"])], b["lengths"][str(r["length"])], seed=r["length"])
        assert r["ratio"] == pytest.approx(r["r_a"] / r["r_b"]) == pytest.approx(want["ratio"])
        assert r["paired_ci95"] == want["paired_ci95"]
    b["lengths"]["8192"]["window_starts"] = [s + 1 for s in b["lengths"]["8192"]["window_starts"]]
    assert paired_table(a, b)[-1]["paired_ci95"] is None


def test_cli_compares_two_cells_and_refuses_one_without_results(capsys, monkeypatch, tmp_path):
    from pathlab.cli import main
    from pathlab.study import cells as study_cells

    assert main(["study", "compare", "owt16-debian", "nope", "rope"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == ("| L | r(nope) | r(rope) | r(nope) / r(rope) [95%] | seed margin m(L) | interval beyond [1/m, m] |")
    last = lines[-1].strip("| ").split(" | ")
    assert last[0] == "65536" and float(last[3].split()[0]) == pytest.approx(float(last[1]) / float(last[2]), rel=2e-3)
    margin = study_cells.seed_margins("owt16-debian")[65536]
    assert float(last[4]) == pytest.approx(margin, abs=5e-4)
    lo = float(last[3].split("[")[1].split(",")[0])
    assert lo > margin and last[5] == "above"  # NoPE over RoPE at 65K: beyond the seeds' spread
    # a cell of the study whose results folder is empty, whichever cells have been run
    committed = study_cells.cell_results_dir
    monkeypatch.setattr(study_cells, "cell_results_dir",
                        lambda study, cell: tmp_path / cell if cell == "path" else committed(study, cell))
    assert main(["study", "compare", "owt16-debian", "nope", "path"]) == 2
    assert "no results yet for path" in capsys.readouterr().err
