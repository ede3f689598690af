"""pathlab.figures.plotting: which panels a figure draws from partial results."""

import matplotlib

matplotlib.use("Agg")

from pathlab.figures import plotting  # noqa: E402

ROW = {"lengths": [512, 1024, 2048], "ratio": [1.0, 1.2, 1.5]}
ROPE_POINT = {"tau": 0.0, "cell": "rope", "ratio_longest": 1.5}


def test_the_dispersion_panel_waits_for_a_second_value_of_tau():
    """One τ is no sweep: the panel would only magnify an axis around one point."""
    one = {"dispersion_sweep": [ROPE_POINT], "ntk": {"rope": ROW, "rope+ntk": ROW}}
    fig = plotting.plot_ablations(one)
    assert [ax.get_title() for ax in fig.axes] == ["(c) NTK-scaled RoPE"]

    two = dict(one, dispersion_sweep=[ROPE_POINT, {"tau": 1.0, "cell": "rot_iid_tau1", "ratio_longest": 1.1}])
    fig = plotting.plot_ablations(two)
    assert [ax.get_title() for ax in fig.axes] == ["(a) more dispersion, more mixing", "(c) NTK-scaled RoPE"]


def test_an_ablation_figure_without_cells_says_so():
    fig = plotting.plot_ablations({"dispersion_sweep": [ROPE_POINT]})
    assert "no ablation cell has results yet" in [t.get_text() for ax in fig.axes for t in ax.texts]
