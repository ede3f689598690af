"""``pathlab.profiling.time_by_kernel`` and the kernel benchmark's profile of one case (scan vs the rest)."""

import gc
import importlib.util
import os
import pathlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of the kernels

from pathlab.profiling import LiveTensorBytes, saved_for_backward, time_by_kernel  # noqa: E402


def test_time_by_kernel_counts_operators_per_call_on_cpu():
    a, b = torch.randn(64, 64), torch.randn(64, 64)

    def fn():
        return (a @ b) @ b

    prof = time_by_kernel(fn, 3, "cpu")
    assert prof["calls"] == 3 and prof["ms_per_call"] > 0
    mm = [r for r in prof["kernels"] if r["name"] == "aten::mm"]
    assert mm and mm[0]["launches_per_call"] == 2
    assert sum(r["share"] for r in prof["kernels"]) == pytest.approx(1.0)  # every operator listed (top = 30 > ops)
    with pytest.raises(ValueError, match="n_calls"):
        time_by_kernel(fn, 0, "cpu")


def _bench_kernels():
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_kernels.py"
    spec = importlib.util.spec_from_file_location("bench_kernels", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench, path


def test_method_settings_are_kernel_configs():
    from pathlab.kernels import KernelConfig

    bench, _ = _bench_kernels()
    base, settings = bench.parse_method("path@bwd_launch=8,1,1@prefetch=0")
    assert base == "path" and settings == {"bwd_launch": (8, 1, 1), "prefetch": False}
    assert bench.method_config(settings) == KernelConfig(bwd_launch=(8, 1, 1), prefetch=False)
    assert bench.method_config({}) is None  # the kernel's own choices
    tuned = KernelConfig(fwd_launch=(4, 2))
    assert bench.method_config({"prefetch": True}, tuned) == KernelConfig(fwd_launch=(4, 2), prefetch=True)
    assert bench.split_methods("path,path@bwd_launch=4,2,2,sdpa,") == ["path", "path@bwd_launch=4,2,2", "sdpa"]
    for bad in ("pathx", "path@loops=split", "path@prefetch", "path@prefetch=2", "path@bwd_launch=a", "sdpa@prefetch=1"):
        with pytest.raises(SystemExit):
            bench.parse_method(bad)


def test_profile_case_splits_scan_and_rest():
    bench, path = _bench_kernels()
    # the Triton backend takes CUDA tensors only, so on a CPU the plumbing is checked with SDPA (no scan kernels)
    row = bench.profile_case(64, 2, 16, "sdpa", "cpu", tokens=128, calls=1, top=5)
    assert row["B"] == 2 and row["ms_per_call"] > 0 and len(row["kernels"]) == 5
    assert row["scan_ms"] == 0 and row["ut_ms"] == 0 and row["other_ms"] == pytest.approx(row["ms_per_call"])
    kernels = path.parents[1] / "kernels"
    for files, names in ((("scan_forward.py", "scan_backward_by_chunk.py", "scan_backward_by_sequence.py"), bench.SCAN_KERNELS),
                         (("ut_common.py", "ut_forward.py", "ut_backward.py"), bench.UT_KERNELS)):
        source = "".join((kernels / f).read_text() for f in files)  # (importing them would import triton)
        assert all(f"def {name}(" in source for name in names)  # the split looks for the real names


def test_saved_for_backward_counts_each_storage_once():
    x = torch.randn(100, 10, requires_grad=True)  # an input: excluded
    w = torch.randn(10, 10, dtype=torch.float64, requires_grad=True)

    def fn():
        h = x.double() @ w  # saves x.double() (8000 bytes) and w (excluded below)
        return (h * h).sum()  # saves h once, though it is both operands (8000 bytes)

    saved, out = saved_for_backward(fn, exclude=(x, w))
    assert saved == {"bytes": 16000, "storages": 2, "by_dtype": {"float64": 16000}}
    assert torch.isfinite(out)
    assert saved_for_backward(fn)[0]["bytes"] == 16000 + 800  # w now counts (x itself is never saved)


def test_live_tensor_bytes_counts_what_ops_make_until_it_is_freed():
    before = torch.randn(1000)  # made outside: never counted, nor its views
    with LiveTensorBytes() as meter:
        a = torch.empty(1000, 1000)  # 4 MB
        b = torch.empty(2000, 1000)  # 8 MB
        view, _ = b[:10], before[:5]
        b.add_(1)  # in place: nothing new
        del a
        c = b + 1  # 8 MB more, while 8 MB are alive
        assert (meter.live, meter.peak) == (16_000_000, 16_000_000)
        del c
        meter.reset_peak()
        d = torch.empty(10)
        assert (meter.live, meter.peak) == (8_000_040, 8_000_040)
        del b, d
        assert meter.live == 8_000_000  # the view keeps b's storage alive
        del view
    assert meter.live == 0


def test_live_tensor_bytes_opens_a_custom_op():
    """A custom op's own buffers are unseen unless its Python implementation runs under the meter: the fused UT
    forward's inverse A (``[Hkv, NC, BT, BT]`` fp32) and its chunks' bounds (``[H, NC]`` fp32) are freed inside, so
    only the opened op shows them at the peak."""
    from pathlab.kernels import ut_backward as _triton_ut
    from pathlab.kernels.layout import build_layout, slot_tokens

    B, T, H, D, BT = 1, 40, 2, 16, 16
    q, k, w = (torch.randn(B, T, H, D) for _ in range(3))
    beta = torch.rand(B, T, H)
    tokens = slot_tokens(build_layout(B, T, BT, q.device, None), B, T)
    NC = tokens.numel() // BT
    factors = 4 * H * NC * (2 * BT * D + D * D + BT * BT)  # q̃, k̃, M, S_d in fp32
    inverse = 4 * H * NC * BT * BT
    bounds = 4 * H * NC
    with LiveTensorBytes() as closed:
        out = torch.ops.pathlab.path_ut_fwd(q, k, w, beta, tokens, BT)
        assert closed.peak == closed.live == factors
    del out
    with LiveTensorBytes(inside={"pathlab::path_ut_fwd": _triton_ut._ut_fwd_impl}, collect=True) as opened:
        out = torch.ops.pathlab.path_ut_fwd(q, k, w, beta, tokens, BT)
        gc.collect()  # the interpreter's reference cycles, as collect=True does before each op
        assert opened.live == factors and opened.peak == factors + inverse + bounds
    assert len(out) == 4


def test_memory_phases_measures_on_the_cpu():
    """Without a GPU, ``benchmarks/memory_phases.py`` counts tensor bytes op by op under the interpreter: the first
    UT forward leaves exactly the factors and the inverse (q̃, S_d, A in fp32, k̃ and M in fp16), and the recomputing
    backward's last step ends with no more alive than its gradients and what it was given."""
    spec = importlib.util.spec_from_file_location(
        "memory_phases", pathlib.Path(__file__).parents[1] / "benchmarks" / "memory_phases.py")
    phases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(phases)
    T, H, D, BT = 128, 2, 32, 64
    result = phases.measure(f"{T}x{H}x{D}", "path_ut_triton", T)
    steps = result["steps"]
    assert result["device"] == "cpu"
    assert [r["step"] for r in steps] == ["ut_forward", "scan_fwd_impl", "ut_forward", "scan_bwd_impl", "ut_backward"]
    NC = T // BT
    factors = H * NC * (BT * D * (4 + 2) + D * D * 2 + BT * BT * (4 + 4))
    assert (steps[0]["exit_mib"] - steps[0]["entry_mib"]) * phases.MIB == factors
    assert all(r["entry_mib"] <= r["peak_mib"] and r["exit_mib"] <= r["peak_mib"] for r in steps)
    assert steps[3]["peak_mib"] > steps[3]["entry_mib"]  # the scan's gradients and scratch


def test_backward_in_head_groups_lowers_the_peak(monkeypatch):
    """Counted op by op (as ``memory_phases.py`` does without a GPU), the recomputing backward one kv head at a time
    peaks at about half of all four heads at once (0.50× measured at this size; the output gradients and o's stay
    whole). A regression here means a group's buffers outlive it, or the split stopped happening."""
    spec = importlib.util.spec_from_file_location(
        "memory_phases", pathlib.Path(__file__).parents[1] / "benchmarks" / "memory_phases.py")
    phases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(phases)
    from pathlab.kernels import fused as _recompute

    monkeypatch.setattr(_recompute, "GROUPS_FROM_CHUNKS", 1)
    peaks, steps = {}, {}
    for budget in (0, 1):  # all heads at once; one kv head per group
        monkeypatch.setattr(_recompute, "group_budget_bytes", lambda b=budget: b)
        result = phases.measure("256x4x32", "path_ut_triton", 256)
        peaks[budget] = max(r["peak_mib"] for r in result["steps"])
        steps[budget] = len(result["steps"])
    assert steps == {0: 5, 1: 2 + 4 * 3}  # the forward's two steps, then three per group
    assert peaks[1] < 0.6 * peaks[0], peaks


def test_fused_ut_route_keeps_what_sdpa_keeps_for_the_backward():
    """Beyond its inputs the recomputing route keeps o (in chunk layout) and the log-sum-exp, as SDPA does (1× one
    q); the PyTorch UT route keeps every fp32 factor. A regression here means something is saved again."""
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_saved_memory.py"
    spec = importlib.util.spec_from_file_location("bench_saved_memory", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = {m: bench.measure(m, 1, 128, 2, 64, torch.device("cpu")) for m in ("path", "path_ut_triton", "sdpa")}
    assert rows["path_ut_triton"]["times_one_q"] <= 1.1
    assert rows["sdpa"]["times_one_q"] <= 1.1
    assert rows["path"]["times_one_q"] >= 10


def test_kernel_resources_builds_for_sm90_without_a_gpu(tmp_path):
    """``benchmarks/kernel_resources.py`` compiles kernels for an H200 on this CPU machine (in a process without
    the interpreter) and reads ptxas's registers and spills and the PTX's instruction counts: the inverse kernel
    at D = 16 multiplies with ``mma.sync`` (fewer with the one-pass Gram product on 16-bit rows), synchronises
    between its doubling steps, has no atomics."""
    import json
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_resources.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "resources.json"
    run = subprocess.run([sys.executable, str(script), "--dims", "16", "--only", "ut_inverse", "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["target"] == "cuda sm_90" and "--only ut_inverse" in result["command"]
    rows = {row["kernel"]: row for row in result["rows"]}
    assert set(rows) == {"ut_inverse D16 gram16=False", "ut_inverse D16 gram16=True"}, list(rows)
    for row in rows.values():
        assert "error" not in row, row
        assert 0 < row["registers"] <= 255 and row["spill_store_bytes"] is not None
        assert row["shared_bytes"] > 0 and row["mma_sync"] > 0 and row["bar_sync"] >= 3
        assert row["red"] == row["atom"] == 0
    # one tensor-core pass on the 16-bit rows instead of three on fp32 ones
    assert rows["ut_inverse D16 gram16=True"]["mma_sync"] < rows["ut_inverse D16 gram16=False"]["mma_sync"]


def test_ncu_top_stalls_ranks_instructions_by_stall_samples(tmp_path):
    """The stall summary of an Nsight Compute source page (CSV): instructions by their share of all samples, with
    their main stall reasons and the instruction before each."""
    spec = importlib.util.spec_from_file_location(
        "ncu_top_stalls", pathlib.Path(__file__).parents[1] / "benchmarks" / "ncu_top_stalls.py")
    ncu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ncu)
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_long_sb", "stall_wait",
              "stall_long_sb (Not Issued)"]
    rows = [["0x0", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR17]", "10", "0", "10", "0"],
            ["0x10", "@!P0 BRA 0x0", "70", "63", "7", "60"],
            ["0x20", "HGMMA.64x64x16.F32", "20", "", "20", "0"]]
    path = tmp_path / "sass.csv"
    path.write_text('"Kernel Name","k",\n' + "\n".join(",".join(f'"{x}"' for x in r) for r in [header] + rows))
    lines = ncu.top_stalls(path, top=2)
    assert lines[0] == "3 instructions, 100 stall samples"
    assert lines[1].startswith(" 70.0%  [long_sb 90%, wait 10%]  @!P0 BRA 0x0") and "TRYWAIT" in lines[1]
    assert lines[2].startswith(" 20.0%  [wait 100%]  HGMMA") and len(lines) == 3


def test_memory_phases_wraps_each_step_of_the_fused_route_and_restores_it(monkeypatch):
    """``benchmarks/memory_phases.py`` records entry, peak and exit memory around each step of the Triton route
    (run here under the interpreter, with CUDA's memory counters replaced by a fake that reports 2 MiB more at
    every read), in the order the steps run, and puts the original functions back afterwards."""
    spec = importlib.util.spec_from_file_location(
        "memory_phases", pathlib.Path(__file__).parents[1] / "benchmarks" / "memory_phases.py")
    phases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(phases)
    from pathlab.kernels import fused as _recompute, fused as path, path_attention_triton

    reads = iter(range(1, 10_000))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 2 * next(reads) * phases.MIB)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 2 * next(reads) * phases.MIB)
    originals = (_recompute.ut_forward, _recompute.ut_backward, path._scan_fwd_impl, path._scan_bwd_impl)
    gen = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(1, 20, 1, 16, generator=gen, requires_grad=True) for _ in range(4))
    beta = torch.rand(1, 20, 1, generator=gen, requires_grad=True)
    rows = []
    with phases.phases_recorded(0, rows):
        path_attention_triton(q, k, v, w, beta, block_size=16, ut="triton").square().sum().backward()
    assert [r["step"] for r in rows] == ["ut_forward", "scan_fwd_impl", "ut_forward", "scan_bwd_impl", "ut_backward"]
    assert all(r["entry_mib"] < r["peak_mib"] < r["exit_mib"] for r in rows), rows  # the fake's reads, in order
    assert (_recompute.ut_forward, _recompute.ut_backward, path._scan_fwd_impl, path._scan_bwd_impl) == originals
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_schedule_balance_deals_every_item_once_and_evenly():
    """``benchmarks/schedule_balance.py`` (the scan backward's dealing of work items, mirrored): in both ways every
    item goes to exactly one program, partial last rounds included; the snake keeps the most loaded program near
    the mean where one direction does not (the head groups' case)."""
    spec = importlib.util.spec_from_file_location(
        "schedule_balance", pathlib.Path(__file__).parents[1] / "benchmarks" / "schedule_balance.py")
    balance = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(balance)
    for n_items in (1, 2, 5, 16, 26, 131, 132, 133, 263, 264, 265, 512):
        for programs in (1, 2, 3, 7, 132):
            for snake in (False, True):
                slots = sorted(s for taken in balance.deal(n_items, programs, snake) for s in taken)
                assert slots == list(range(n_items)), (n_items, programs, snake)
    assert balance.most_loaded_over_mean(2, 256, 1, 132, snake=False) > 1.2
    assert balance.most_loaded_over_mean(2, 256, 1, 132, snake=True) < 1.02


def test_benchmark_result_file_says_how_it_was_made(tmp_path):
    import json

    from pathlab.results import write_benchmark_result

    path = write_benchmark_result(tmp_path / "r.json", "benchmarks/x.py", ["--out", "r.json"], rows=[{"a": 1.5}],
                                  peak=torch.tensor(2.5))
    assert json.loads(path.read_text()) == {"command": "python benchmarks/x.py --out r.json", "rows": [{"a": 1.5}],
                                            "peak": 2.5}
