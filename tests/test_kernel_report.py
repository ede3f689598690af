"""The kernel-performance report (figures/kernel_performance from benchmark result files)."""

import json

from pathlab.figures import kernel_report


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
