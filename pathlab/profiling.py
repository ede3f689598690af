"""Where the time and the memory go: device time per kernel over a few calls of a function (``torch.profiler``),
the bytes autograd keeps for the backward (``saved_tensors_hooks``), and the tensor bytes alive and their peak
on any device (a dispatch mode).

Used by the benchmarks to compare two variants, or the parts of one, kernel by kernel.
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


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


class LiveTensorBytes(TorchDispatchMode):
    """Inside ``with LiveTensorBytes() as meter:``, the bytes of tensor storage that ops have made and that are
    still alive (``meter.live``) and their peak (``meter.peak``; ``reset_peak()`` sets it to ``live``).

    This is what a CUDA caching allocator's ``memory_allocated`` counts (less its rounding to 512 bytes), taken
    op by op on any device, so a CPU can measure where a GPU's memory would peak. Storages made before the block
    are not counted. A custom op is one op to a dispatch mode, its own buffers unseen: ``inside`` maps its name
    (``"ns::op"``) to its Python implementation, run under the mode so that they count. ``collect=True`` collects
    Python's young garbage before every op, so that a tensor held only by a reference cycle counts as freed when its
    last real reference goes (Triton's interpreter makes such cycles; without it they would not exist).
    """

    def __init__(self, inside=None, collect=False):
        super().__init__()
        self.inside = dict(inside or {})
        self.collect = collect
        self.live = self.peak = 0
        self._sizes = {}  # storage data_ptr -> bytes

    def reset_peak(self):
        self.peak = self.live

    def _count(self, tensor):
        storage = tensor.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or key in self._sizes:
            return
        self._sizes[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key)

    def _free(self, key):
        self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        impl = self.inside.get(func._schema.name)
        if impl is not None:
            with self:  # the mode is off while an op runs: back on for the op's own ops
                return impl(*args, **(kwargs or {}))
        if self.collect:
            gc.collect(1)  # the young generations: where a cycle made since the last op lies
        out = func(*args, **(kwargs or {}))
        if all(ret.alias_info is None for ret in func._schema.returns):  # views and in-place ops make nothing
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._count(t)
        return out
