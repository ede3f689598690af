"""pathlab.results: atomic figure and JSON writing."""

import json
import math
import os

import numpy as np
import pytest
import torch

from pathlab import results


def test_write_and_read_results_roundtrip(tmp_path):
    path = results.write_results(
        "demo", data={"x": np.arange(3), "y": torch.tensor([0.5, float("nan")]), "s": np.float32(1.5)},
        claims={"holds": np.bool_(True), "fails": False}, parameters={"profile": "tiny-cpu", "fast": True},
        out_dir=tmp_path)
    assert path == tmp_path / "demo.json"
    record = results.read_results(path)
    assert record["claims"] == {"holds": True, "fails": False}
    assert record["data"] == {"x": [0, 1, 2], "y": [0.5, None], "s": 1.5}
    assert record["parameters"]["profile"] == "tiny-cpu"
    assert "torch" in record["versions"] and "python" in record["versions"]
    assert "git_revision" in record
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_claims_must_be_bool(tmp_path):
    with pytest.raises(ValueError, match="claims"):
        results.write_results("demo", data={}, claims={"holds": 1.0}, out_dir=tmp_path)
    assert not (tmp_path / "demo.json").exists()


def test_bad_stem_rejected(tmp_path):
    with pytest.raises(ValueError, match="stem"):
        results.write_results("a/b", data={}, out_dir=tmp_path)


def test_unserialisable_data_leaves_previous_file(tmp_path):
    results.write_results("demo", data={"v": 1}, out_dir=tmp_path)
    with pytest.raises(TypeError):
        results.write_results("demo", data={"v": object()}, out_dir=tmp_path)
    assert results.read_results(tmp_path / "demo.json")["data"] == {"v": 1}
    assert len(os.listdir(tmp_path)) == 1


def test_read_results_rejects_other_format(tmp_path):
    p = tmp_path / "old.json"
    p.write_text(json.dumps({"name": "old", "claims": {}, "data": {}, "format": 0}))
    with pytest.raises(ValueError, match="pathlab figures --only old"):
        results.read_results(p)
    with pytest.raises(FileNotFoundError, match="pathlab figures"):
        results.read_results(tmp_path / "missing.json")


def test_save_figure_atomic_and_deterministic(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    paths = results.save_figure(fig, "fig", tmp_path)
    assert [p.name for p in paths] == ["fig.png", "fig.pdf"]
    first = (tmp_path / "fig.pdf").read_bytes()
    results.save_figure(fig, "fig", tmp_path)
    assert (tmp_path / "fig.pdf").read_bytes() == first  # no creation date in the PDF
    assert (tmp_path / "fig.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plt.close(fig)


def test_failing_savefig_leaves_no_partial_file(tmp_path):
    class Broken:
        def savefig(self, buf, **kwargs):
            buf.write(b"partial")
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        results.save_figure(Broken(), "broken", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_to_jsonable_floats():
    assert results.to_jsonable({"a": (1, 2.0, math.inf)}) == {"a": [1, 2.0, None]}
