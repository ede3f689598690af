"""Where the time goes: device time per kernel over a few calls of a function (``torch.profiler``).

Used by the benchmarks to compare two variants, or the parts of one, kernel by kernel.
"""

from __future__ import annotations

import torch


def time_by_kernel(fn, n_calls: int, device, top: int = 30) -> dict:
    """Profile ``n_calls`` calls of ``fn()`` and return the time per call by kernel.

    On CUDA the rows are GPU kernels (device time); on a CPU they are operators (self CPU time). Returns
    ``{"calls", "ms_per_call", "kernels": [{"name", "ms_per_call", "share", "launches_per_call"}, ...]}`` with the
    ``top`` kernels by time; ``ms_per_call`` counts every kernel, not only the top ones.
    """
    from torch.profiler import ProfilerActivity, profile

    if n_calls < 1:
        raise ValueError(f"n_calls must be ≥ 1, got {n_calls!r}")
    device = torch.device(device)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(n_calls):
            fn()
        if cuda:
            torch.cuda.synchronize(device)
    if cuda:
        events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        time_us = lambda e: getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)  # noqa: E731
    else:
        events = list(prof.key_averages())
        time_us = lambda e: e.self_cpu_time_total  # noqa: E731
    total = sum(time_us(e) for e in events)
    rows = sorted(events, key=time_us, reverse=True)[:top]
    return {"calls": n_calls, "ms_per_call": total / 1000 / n_calls,
            "kernels": [{"name": e.key[:160], "ms_per_call": time_us(e) / 1000 / n_calls,
                         "share": time_us(e) / total if total else None, "launches_per_call": e.count / n_calls}
                        for e in rows]}
