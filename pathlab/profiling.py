"""Where the time and the memory go: device time per kernel over a few calls of a function (``torch.profiler``),
and the bytes autograd keeps for the backward (``saved_tensors_hooks``).

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


def saved_for_backward(fn, exclude=()) -> tuple[dict, object]:
    """Run ``fn()`` and count what autograd keeps for its backward: every tensor an op saves, once per storage.

    Storages of the ``exclude`` tensors (the inputs, which exist anyway) are left out. Returns
    ``({"bytes", "storages", "by_dtype": {dtype: bytes}}, fn())``. A saved view counts its whole storage, which
    is what it keeps alive. The count is the same on every device, so it can be taken on a CPU.
    """
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in excluded and storage.nbytes() > 0:
            kept[storage.data_ptr()] = (storage.nbytes(), str(t.dtype).replace("torch.", ""))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    by_dtype = {}
    for nbytes, dtype in kept.values():
        by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
    return {"bytes": sum(by_dtype.values()), "storages": len(kept), "by_dtype": by_dtype}, out
