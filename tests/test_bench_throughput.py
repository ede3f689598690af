"""The throughput benchmark's process isolation: a stopped benchmark leaves no worker behind (a worker left running
would share the GPU with the measurements that follow)."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_throughput.py"


def _workers(token: str) -> list[int]:
    """Pids of live benchmark workers whose command line contains ``token``."""
    pids = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next(line for line in (entry / "status").read_text().splitlines() if line.startswith("State:"))
        except (OSError, StopIteration):
            continue
        if "--worker " in cmdline and token in cmdline and "zombie" not in state:
            pids.append(int(entry.name))
    return pids


@pytest.mark.skipif(not pathlib.Path("/proc/self/cmdline").exists(), reason="needs Linux /proc to find the worker")
def test_sigterm_to_the_benchmark_kills_its_running_worker(tmp_path):
    out = tmp_path / "throughput.json"
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--variants", "nope", "--compile", "none",
           "--layers", "1", "--width", "64", "--batch", "1", "--block", "8", "--steps", "10000000", "--warmup", "0",
           "--variant-timeout-s", "600", "--out", str(out)]
    parent = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 120
        while not _workers(str(out)) and time.time() < deadline:
            assert parent.poll() is None, "the benchmark exited before starting its worker"
            time.sleep(0.2)
        workers = _workers(str(out))
        assert workers, "no worker process appeared within 120 s"
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=60) != 0
        deadline = time.time() + 30
        while _workers(str(out)) and time.time() < deadline:
            time.sleep(0.2)
        assert _workers(str(out)) == [], "the worker outlived the stopped benchmark"
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid in _workers(str(out)):
            os.kill(pid, signal.SIGKILL)


def test_data_parallel_run_records_all_processes_and_a_failure_does_not_hang(tmp_path):
    """``--gpus 2`` on the CPU: 2 gloo processes under torchrun with DistributedDataParallel. Tokens of both
    processes are counted, and a variant that fails in every process is recorded as an error (torchrun stops)."""
    import json

    out = tmp_path / "throughput.json"
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--variants", "nope,no_such_variant", "--compile", "none",
           "--layers", "1", "--width", "64", "--batch", "2", "--block", "8", "--steps", "2", "--warmup", "1",
           "--gpus", "2", "--variant-timeout-s", "240", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["setup"]["processes"] == 2
    good = report["throughput"]["nope"]
    assert "error" not in good, good.get("output_tail")
    assert good["processes"] == 2 and good["loss_finite"]
    assert good["tokens_per_s"] == pytest.approx(2 * 2 * 8 / (good["ms_per_step"] / 1000), rel=1e-6)  # processes x batch x block
    bad = report["throughput"]["no_such_variant"]
    assert "no_such_variant" in bad["error"] and not bad.get("timed_out")
