"""Notebooks: structure (parameters cell, declared outputs, an opening that says what is tested, no stored
outputs) and a fast papermill run of each that writes exactly its declared outputs, checks asserted."""

import ast
import json
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# Notebooks owned by the figures/probes area; state_tracking.ipynb is executed by the state-tracking tests.
PROBE_NOTEBOOKS = [p for p in NOTEBOOKS if p.stem != "state_tracking"]

# Checks that must pass even in a fast (CI-sized) run: synthetic facts and theorems. Model-based claims
# (which depend on how long the tiny models trained) must be present as booleans or None but may go either way.
DATA_ONLY = {"spectral_mixing_windows"}  # a companion plot of another figure's numbers
MUST_HOLD = {
    "spectral_mixing": ["so2_coherence_follows_gamma_power", "window_matches_prediction",
                        "householder_trace_is_one_minus_beta_over_d_power", "rope_never_mixes"],
    "score_tails": ["far_score_variance_is_qk_squared_over_d", "tails_below_bounds"],
    "far_mass_toy": ["simulation_matches_formula", "formula_reproduces_reference_values"],
    "lower_bound": ["bound_never_violated", "bound_matches_reference_values", "bound_tight_for_adversarial_logits"],
    "lower_bound_model": ["bound_never_violated"],
    "value_incoherence": ["fully_mixed_is_one_over_sqrt_m", "qk_only_is_coherent", "walks_match_closed_form"],
    "value_incoherence_model": ["rot_random_qk_kappa_is_one"],
}


def test_there_are_notebooks():
    assert len(PROBE_NOTEBOOKS) >= 5, f"expected the probe notebooks in {ROOT / 'notebooks'}"


def _parameters(cell) -> dict:
    values = {}
    for node in ast.parse(cell.source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            values[node.targets[0].id] = ast.literal_eval(node.value)
    return values


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_structure(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    tagged = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"{path.name}: needs exactly one cell tagged 'parameters', found {len(tagged)}"
    params = _parameters(tagged[0])
    assert params.get("profile") == "tiny-cpu" and params.get("fast") is False and params.get("out_dir") is None
    meta = nb.metadata.get("pathlab", {})
    assert meta.get("writes"), f"{path.name}: metadata pathlab.writes must list the figure stems it writes"
    assert set(meta) <= {"study_figures", "writes"}, f"{path.name}: unknown pathlab metadata {sorted(meta)}"
    for cell in nb.cells:  # committed without outputs: `pathlab figures` writes the executed copies to build/
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name}: a cell holds outputs"
    first = nb.cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("# "), f"{path.name}: opens with a title"
    if path.stem not in ("kernel_performance", "state_tracking"):
        assert "**What it tests.**" in first.source and "**How to read the figure" in first.source
    for cell in nb.cells:
        if cell.cell_type == "markdown":  # maths as LaTeX, not bare unicode formulas in backticks
            assert "`ρ" not in cell.source and "`Γ" not in cell.source, f"{path.name}: maths must be $…$"
    # papermill's parser (used by `papermill --help-notebook` and parameter checks) must read every parameter
    from papermill.translators import PythonTranslator

    seen = [p.name for p in PythonTranslator.inspect(tagged[0])]
    assert seen == list(params), f"{path.name}: papermill reads the parameters as {seen}, not {list(params)}"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name}: committed with outputs"
            assert cell.execution_count is None, f"{path.name}: committed with execution counts"
    text = path.read_text()
    for machine_path in (str(ROOT.parent), str(Path.home())):  # where this checkout and the user live
        assert machine_path + "/" not in text, f"{path.name}: machine path {machine_path} in a committed notebook"


@pytest.mark.notebooks
@pytest.mark.parametrize("path", PROBE_NOTEBOOKS, ids=[p.stem for p in PROBE_NOTEBOOKS])
def test_notebook_runs_fast_and_writes_its_outputs(path, tmp_path):
    from pathlab.figures.pipeline import collect_outputs, notebook_meta, run_notebook

    out = tmp_path / "fig"
    ok, error = run_notebook(path, tmp_path / "executed.ipynb",
                             {"profile": "tiny-cpu", "fast": True, "out_dir": str(out)}, ROOT)
    assert ok, f"{path.name} failed: {error}"
    stems = notebook_meta(path)["writes"]
    written, absent = collect_outputs(out, stems)
    assert not absent, f"{path.name} did not write {absent}"
    assert sorted(p.stem for p in out.iterdir()) == sorted(s for s in stems for _ in ("json", "pdf", "png")
                                                             if (out / f"{s}.json").exists()), \
        f"{path.name} wrote files it does not declare"
    executed = nbformat.read(tmp_path / "executed.ipynb", as_version=4)
    for cell in executed.cells:  # warnings are fixed at their cause, not shown to the reader
        for o in cell.get("outputs", []):
            assert not (o.get("name") == "stderr" and "Warning" in o.get("text", "")), \
                f"{path.name}: a warning in the executed notebook: {o['text'][:300]}"
    for res in written:
        record = json.loads((out / f"{res['stem']}.json").read_text())
        assert set(record) >= {"name", "claims", "checks", "data", "parameters", "versions", "git_revision"}
        assert record["parameters"]["fast"] is True
        assert (out / f"{res['stem']}.png").exists() and (out / f"{res['stem']}.pdf").exists()
        if res["stem"] not in DATA_ONLY:
            assert record["claims"] or record["checks"], f"{res['stem']}: neither claims nor checks"
        assert all(v is None or isinstance(v, bool) for v in record["claims"].values())
        for check in MUST_HOLD.get(res["stem"], []):
            assert record["checks"].get(check) is True, f"{res['stem']}: check {check} did not pass"
