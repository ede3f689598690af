"""M7/M8 helpers (per-position loss, NTK RoPE, length curves) and the kernel-performance report."""

import json

import numpy as np
import pytest
import torch

from pathlab import ModelConfig, build_model, kernel_report
from pathlab.probes import extrapolation as ex


def _model(attention="rope"):
    torch.manual_seed(0)
    return build_model(ModelConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, attention=attention))


def test_per_position_loss_matches_model_loss():
    m = _model()
    w = torch.randint(0, 64, (3, 50))
    loss = ex.per_position_loss(m, w, chunk=7)
    assert loss.shape == (49,)
    with torch.no_grad():
        _, ref = m(w[:, :-1], w[:, 1:])
    assert loss.mean() == pytest.approx(ref.item(), rel=1e-6)


def test_chunked_loss_is_the_loss_of_training_length_windows():
    m = _model()
    w = torch.randint(0, 64, (2, 3 * 16 + 1))
    expected = np.mean([ex.per_position_loss(m, w[:, c:c + 17]).mean() for c in (0, 16, 32)])
    assert ex.chunked_loss(m, w, 16) == pytest.approx(expected, rel=1e-9)
    assert ex.chunked_loss(m, w, 48) == pytest.approx(ex.per_position_loss(m, w).mean(), rel=1e-9)
    with pytest.raises(ValueError, match="multiple"):
        ex.chunked_loss(m, w, 20)


def test_bucket_positions_cover_all():
    loss = np.arange(100, dtype=float)
    centres, means = ex.bucket_positions(loss)
    assert np.all(np.diff(centres) > 0) and means[0] == 0.5 and means[-1] == 87.0  # buckets [0, 2) … [75, 100)


def test_ntk_base_and_rope_base_context():
    assert ex.ntk_base(10000.0, 1.0, 64) == 10000.0
    assert ex.ntk_base(10000.0, 4.0, 64) == pytest.approx(10000.0 * 4 ** (64 / 62))
    m = _model()
    w = torch.randint(0, 64, (1, 40))
    before = ex.per_position_loss(m, w)
    with ex.rope_base(m, 1e6):
        assert all(b.attn.positional.base == 1e6 for b in m.blocks)
        changed = ex.per_position_loss(m, w)
    assert not np.allclose(before, changed)
    np.testing.assert_allclose(ex.per_position_loss(m, w), before)
    with pytest.raises(ValueError, match="RoPE"):
        with ex.rope_base(_model("alibi"), 1e6):
            pass


def test_length_curves_ratio_and_ntk_entry():
    cfg = {"data": {"block_size": 16}, "model": {"attention": "rope", "n_embd": 32, "n_head": 2}}
    windows = lambda c, n: torch.randint(0, 64, (2, n), generator=torch.Generator().manual_seed(n))  # noqa: E731
    out = ex.length_curves({"rope": (_model(), cfg)}, windows, [16, 48], ntk=True)
    assert set(out) == {"rope", "rope+ntk"}
    assert out["rope"]["ppl_ratio"][0] == pytest.approx(1.0) and len(out["rope"]["position_loss"]) > 3
    r = out["rope"]
    assert r["ppl_ratio"][1] == pytest.approx(np.exp(r["mean_loss"][1] - r["train_length_loss"][1]))
    assert out["rope+ntk"]["mean_loss"][0] == pytest.approx(out["rope"]["mean_loss"][0], rel=1e-9)  # s = 1 at L_train


def test_kernel_report_absent_and_present(tmp_path):
    found, notes = kernel_report.load_benchmarks(tmp_path / "none")
    data, claims = kernel_report.kernel_summary(found, notes)
    assert claims == {"benchmark_results_present": False} and "bench_kernels.py" in notes[0]
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps({"x": 1}))  # another benchmark's file: passed over quietly
    (tmp_path / "kernels-broken.json").write_text(json.dumps({"x": 1}))  # a kernel result without cases: noted
    (tmp_path / "k.json").write_text(json.dumps({
        "device": "H200", "cases": [
            {"method": "sdpa", "T": 4096, "B": 8, "H": 12, "D": 64, "fwd_ms": 0.5, "fwd_bwd_ms": 2.0, "peak_mib": 291},
            {"method": "path", "T": 4096, "B": 8, "H": 12, "D": 64, "fwd_ms": 1.5, "fwd_bwd_ms": 6.0, "peak_mib": 500},
            # a side-by-side experiment with a kernel setting: neither a row nor a claim
            {"method": "path@PATHLAB_PATH_BWD=4,2,2", "T": 4096, "B": 8, "H": 12, "D": 64, "fwd_ms": 9.0,
             "fwd_bwd_ms": 99.0, "peak_mib": 500},
            {"method": "fla_path", "T": 4096, "B": 8, "H": 12, "D": 64, "skipped": "not importable"}],
        "correctness": {"path-12x64": {"o": 1e-3, "dq": 2e-3, "dk": 2e-3, "dv": 1e-3, "dw": 5e-3, "dbeta": 1e-2},
                        "path@PATHLAB_PATH_BWD_LAMBDA=x-12x64": {"o": 1.0}}}))
    found, notes = kernel_report.load_benchmarks(tmp_path)
    assert [f["file"] for f in found] == ["k.json"] and len(notes) == 2
    assert notes[0].startswith("bad.json: unreadable") and notes[1].startswith("kernels-broken.json: not a")
    data, claims = kernel_report.kernel_summary(found, notes)
    assert [r["method"] for r in data["rows"]] == ["path", "sdpa"]
    path_row = [r for r in data["rows"] if r["method"] == "path"][0]
    assert path_row["ratio_to_sdpa"] == 3.0 and path_row["anchor_public_fwd_bwd_ms"] == 11.99
    assert claims == {"benchmark_results_present": True, "path_faster_than_public_kernel": True,
                      "path_gradients_within_public_tolerances": True}
    assert "| path | 4096 | 12×64 |" in kernel_report.kernel_table_markdown(data)
