"""Benchmark the Triton PaTH kernel against SDPA, FlexAttention(ALiBi) and, when importable, the public fla kernels.

Times are medians of ``triton.testing.do_bench`` in ms (bf16, causal, B·T = 32768 tokens by default); peak is
the extra memory (MiB) of one forward+backward beyond the inputs. Before timing, every PaTH implementation is
checked against the fp64 reference (:func:`pathlab.reference.path_attention`) on a small slice of the same
head shape: relative RMS error of o and of every gradient goes into the result file.

    python benchmarks/bench_kernels.py --out benchmarks/results/kernels-h200.json
    python benchmarks/bench_kernels.py --cases 4096x12x64 --methods path,sdpa --decode 4096,65536
    python benchmarks/bench_kernels.py --cases '' --decode 4096,16384,65536 --out decode.json  # decode only
    python benchmarks/bench_kernels.py --cases '' --decode '' --profile 4096x12x64 --out profile.json
        # fwd+bwd time by kernel: the Triton scan against the per-token work around it
    python benchmarks/bench_kernels.py --cases 4096x12x64 --methods path,path_ut_triton,sdpa --decode ''
        # the UT transform in PyTorch ops against the fused kernels (``ut="triton"``), side by side
    python benchmarks/bench_kernels.py --cases 4096x12x64 --methods path,path@bwd_launch=8,1,1,sdpa
        # a method with KernelConfig settings after '@': variants of one kernel side by side in one call

Needs a CUDA device. The result file is written atomically.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

from pathlab.atomic import atomic_write_text

DEFAULT_CASES = "1024x12x64,4096x12x64,16384x12x64,65536x12x64,1024x16x128,4096x16x128,16384x16x128,65536x16x128"
FLEX_MAX_T = 16384  # FlexAttention is compiled per shape; the anchors stop at 16K
# "path" and "path_fox" take the kernel's default UT route ("auto": on CUDA fused, its factors kept at D ≤ 64 and
# recomputed at D = 128; elsewhere PyTorch);
# the *_ut_triton, *_ut_triton_saved and *_ut_torch methods force one
PATH_METHODS = ("path", "path_fox", "path_ut_triton", "path_fox_ut_triton", "path_ut_torch", "path_fox_ut_torch",
                "path_ut_triton_saved", "path_fox_ut_triton_saved")
METHODS = PATH_METHODS + ("sdpa", "flex_alibi", "fla_path", "fla_path_fox", "fla_fox")


def _config_fields():
    from pathlab.kernels import KernelConfig

    return {f.name: f.type for f in dataclasses.fields(KernelConfig)}


def _setting_value(key, text, kind):
    """A setting's text as its field wants it: a tuple of ints for launches and tiles, a bool (0/1) for routes,
    an int for the rest."""
    try:
        if "tuple" in kind:
            return tuple(int(x) for x in text.split(","))
        if "bool" in kind:
            if text not in ("0", "1"):
                raise ValueError(text)
            return text == "1"
        return int(text)
    except ValueError:
        raise SystemExit(f"setting {key}={text!r}: not a value for a {kind} field") from None


def parse_method(name):
    """``"path@bwd_launch=8,1,1@prefetch=0"`` → ``("path", {"bwd_launch": (8, 1, 1), "prefetch": False})``: a
    method run with :class:`pathlab.kernels.KernelConfig` settings, so that variants of one kernel are timed side
    by side in one call."""
    base, *settings = name.split("@")
    if base not in METHODS:
        raise SystemExit(f"unknown method {base!r}; known: {METHODS}")
    fields = _config_fields()
    out = {}
    for setting in settings:
        key, sep, val = setting.partition("=")
        if not sep or key not in fields:
            raise SystemExit(f"method setting {setting!r} of {name!r} must read FIELD=value with a KernelConfig "
                             f"field: {sorted(fields)}")
        out[key] = _setting_value(key, val, str(fields[key]))
    if settings and base not in PATH_METHODS:
        raise SystemExit(f"method {name!r}: settings apply to the PaTH kernel methods only")
    return base, out


def split_methods(text):
    """The comma list of methods; a piece starting with a digit continues the previous method's setting, so
    that ``path@bwd_launch=4,2,2,sdpa`` reads as two methods."""
    methods = []
    for piece in text.split(","):
        if piece[:1].isdigit() and methods:
            methods[-1] += "," + piece
        elif piece:
            methods.append(piece)
    return methods


def method_config(settings, base=None):
    """The KernelConfig of a method's settings on top of ``base`` (a KernelConfig, e.g. the tuned launches), or
    None when neither sets anything (the kernel's own choices)."""
    from pathlab.kernels import KernelConfig

    if not settings and base is None:
        return None
    return dataclasses.replace(base or KernelConfig(), **settings)


def rel_rms(a, b):
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


W_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
W_DTYPE = torch.float32  # of w in every case (--w-dtype); the language model's PaTH layers pass bf16 w


def make_inputs(B, T, H, D, *, device, dtype=torch.bfloat16, seed=0, beta_range=(0.0, 2.0)):
    gen = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    q, k, v = (r(B, T, H, D).to(dtype) for _ in range(3))
    w = F.normalize(r(B, T, H, D), dim=-1).to(W_DTYPE)
    lo, hi = beta_range
    beta = lo + (hi - lo) * torch.rand(B, T, H, device=device, generator=gen)
    g = F.logsigmoid(2.0 + r(B, T, H))  # forget gates near 0.9
    return q, k, v, w, beta, g


def _fla():
    try:
        from fla.ops.forgetting_attn import parallel_forgetting_attn
        from fla.ops.path_attn import parallel_path_attn
    except Exception as err:  # noqa: BLE001  (fla is optional; any import failure means "not available")
        return None, repr(err)
    return (parallel_path_attn, parallel_forgetting_attn), None


def build_method(name, q, k, v, w, beta, g, config=None):
    """A closure computing o (and its inputs that need grads) for method ``name``; None if unavailable.
    ``config``: a KernelConfig for the PaTH kernel methods (None: the kernel's own choices)."""
    import pathlab

    if name in ("path", "path_fox") and config is None:
        gate = g if name == "path_fox" else None
        return lambda: pathlab.path_attention(q, k, v, w, beta, gate, backend="triton")
    if name in PATH_METHODS:  # the kernel itself: with a config, or the UT transform fused (recomputed or saved)
        from pathlab.kernels import path_attention_triton  # or in PyTorch

        gate = g if name.startswith("path_fox") else None
        ut = name.split("_ut_", 1)[1] if "_ut_" in name else None
        return lambda: path_attention_triton(q, k, v, w, beta, gate, ut=ut, config=config)  # w, β, g fp32 already
    if name == "sdpa":
        qt, kt, vt = (t.transpose(1, 2).contiguous().detach().requires_grad_() for t in (q, k, v))
        return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    if name == "flex_alibi":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        H, T = q.shape[2], q.shape[1]
        slopes = pathlab.alibi_slopes(H).to(q.device, torch.float32)

        def alibi(score, b, h, qi, kj):
            return score - slopes[h] * (qi - kj)

        def causal(b, h, qi, kj):
            return qi >= kj

        mask = create_block_mask(causal, None, None, T, T, device=q.device)
        flex = torch.compile(flex_attention, dynamic=False)
        qt, kt, vt = (t.transpose(1, 2).contiguous().detach().requires_grad_() for t in (q, k, v))
        return lambda: flex(qt, kt, vt, score_mod=alibi, block_mask=mask)
    fns, _ = _fla()
    if fns is None:
        return None
    fla_path, fla_fox = fns
    if name == "fla_path":
        return lambda: fla_path(q, k, v, w, beta, None)[0]
    if name == "fla_path_fox":  # fla computes scale·(s + G_i − G_j): pass g/scale for FoX's scale·s + G_i − G_j
        inv = q.shape[-1] ** 0.5
        return lambda: fla_path(q, k, v, w, beta, g * inv)[0]
    if name == "fla_fox":
        return lambda: fla_fox(q, k, v, g)  # plain FoX (no PaTH): a speed anchor, not checked
    raise ValueError(f"unknown method {name!r}; known: {METHODS}")


def check_correctness(name, H, D, device, T=256):
    """Relative RMS errors of o and every gradient against the fp64 reference (B=1, T=256, β ∈ [1.5, 2])."""
    from pathlab.reference import path_attention as reference

    name, settings = parse_method(name)
    if name not in PATH_METHODS + ("fla_path", "fla_path_fox"):
        return None
    return _errors(name, H, D, device, T, reference, method_config(settings))


def _errors(name, H, D, device, T, reference, config=None):
    q, k, v, w, beta, g = make_inputs(1, T, H, D, device=device, seed=1, beta_range=(1.5, 2.0))
    gate = g if "fox" in name else None
    leaves = [q, k, v, w, beta] + ([gate] if gate is not None else [])
    leaves = [t.detach().requires_grad_() for t in leaves]
    fn = build_method(name, *leaves[:5], leaves[5] if gate is not None else g, config=config)
    if fn is None:
        return None
    o = fn()
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, leaves, do)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    o_ref = reference(*ref_leaves[:5], ref_leaves[5] if gate is not None else None)
    ref_grads = torch.autograd.grad(o_ref, ref_leaves, do.double())
    names = ["o", "dq", "dk", "dv", "dw", "dbeta"] + (["dg"] if gate is not None else [])
    errs = [rel_rms(o, o_ref)] + [rel_rms(a, b) for a, b in zip(grads, ref_grads)]
    return dict(zip(names, errs))


def time_method(fn, leaves, *, backward=True):
    from triton.testing import do_bench

    out = fn()
    do = torch.randn_like(out)
    fwd = do_bench(lambda: fn(), warmup=25, rep=100)
    if not backward:
        return fwd, None, None

    def fwd_bwd():
        o = fn()
        torch.autograd.grad(o, leaves, do)

    fb = do_bench(fwd_bwd, warmup=25, rep=100)
    del out
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    o = fn()
    grads = torch.autograd.grad(o, leaves, torch.randn_like(o))
    finite = bool(torch.isfinite(o).all()) and all(bool(torch.isfinite(x).all()) for x in grads)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return fwd, fb, (peak, finite)


def bench_case(T, H, D, methods, device, tokens, tuned=None):
    """Every method at one case; ``tuned``: a KernelConfig of tuned launches under the PaTH methods' settings."""
    B = max(1, tokens // T)
    rows = []
    for name in methods:
        if name.startswith("flex_alibi") and T > FLEX_MAX_T:
            continue
        q, k, v, w, beta, g = make_inputs(B, T, H, D, device=device)
        for t in (q, k, v, w, beta, g):
            t.requires_grad_()
        row = dict(method=name, T=T, B=B, H=H, D=D)
        base, settings = parse_method(name)
        try:
            config = method_config(settings, tuned if base in PATH_METHODS else None)
            fn = build_method(base, q, k, v, w, beta, g, config=config)
            if fn is None:
                row["skipped"] = _fla()[1]
                rows.append(row)
                continue
            leaves = _leaves(fn, base, q, k, v, w, beta, g)
            fwd, fb, (peak, finite) = time_method(fn, leaves)
            row.update(fwd_ms=fwd, fwd_bwd_ms=fb, peak_mib=peak, finite=finite)
        except torch.OutOfMemoryError as err:
            row["error"] = f"out of memory: {str(err).splitlines()[0]}"
        except Exception as err:  # noqa: BLE001  (record the failure, keep benchmarking the rest)
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        print(json.dumps(row), flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


# the Triton scan (forward; backward by query chunk or by sequence); everything else is per-token work
SCAN_KERNELS = ("_path_fwd_kernel", "_path_bwd_kernel", "_path_bwd_by_sequence_kernel")
UT_KERNELS = ("_ut_inverse_kernel", "_ut_fwd_kernel", "_ut_bwd_heads_kernel", "_ut_bwd_chunk_kernel",  # fused UT
              "_ut_bwd_inverse_kernel", "_ut_bwd_end_kernel", "_ut_bwd_dq_kernel", "_ut_bwd_sums_kernel")


def profile_case(T, H, D, method, device, tokens, *, calls=2, top=25):
    """Time per forward+backward of ``method`` at one case, by kernel (``pathlab.profiling.time_by_kernel``), and
    its split into the Triton scan kernels (``scan_ms``), the fused UT kernels (``ut_ms``, zero when the UT
    transform runs as PyTorch ops) and everything else (``other_ms``: layout, casts, the PyTorch UT transform and
    its backward, buffer fills). One untimed call first (compilation, autotuning)."""
    from pathlab.profiling import time_by_kernel

    device = torch.device(device)
    B = max(1, tokens // T)
    q, k, v, w, beta, g = make_inputs(B, T, H, D, device=device)
    for t in (q, k, v, w, beta, g):
        t.requires_grad_()
    base, settings = parse_method(method)
    fn = build_method(base, q, k, v, w, beta, g, config=method_config(settings))
    if fn is None:
        return dict(method=method, T=T, B=B, H=H, D=D, skipped=_fla()[1])
    leaves = _leaves(fn, base, q, k, v, w, beta, g)

    def fwd_bwd():
        torch.autograd.grad(fn(), leaves, do)

    do = torch.randn_like(fn())
    fwd_bwd()
    prof = time_by_kernel(fwd_bwd, calls, device, top=10_000)
    scan = sum(r["ms_per_call"] for r in prof["kernels"] if r["name"].startswith(SCAN_KERNELS))
    ut = sum(r["ms_per_call"] for r in prof["kernels"] if r["name"].startswith(UT_KERNELS))
    return dict(method=method, T=T, B=B, H=H, D=D, ms_per_call=prof["ms_per_call"], scan_ms=scan, ut_ms=ut,
                other_ms=prof["ms_per_call"] - scan - ut, calls=calls, kernels=prof["kernels"][:top])


def _leaves(fn, name, q, k, v, w, beta, g):
    if name in ("sdpa", "flex_alibi"):
        return _closure_tensors(fn)  # the closure owns [B, H, T, D] copies of q, k, v
    if name in ("path", "path_ut_triton", "path_ut_torch", "path_ut_triton_saved", "fla_path"):
        return [q, k, v, w, beta]
    if name == "fla_fox":
        return [q, k, v, g]
    return [q, k, v, w, beta, g]


def _closure_tensors(fn):
    out = []
    for cell in fn.__closure__ or ():
        x = cell.cell_contents
        if isinstance(x, torch.Tensor) and x.requires_grad and x.is_leaf:
            out.append(x)
    return out


def _now(device):
    if device.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def _elapsed_ms(t0, t1, device):
    if device.type == "cuda":
        t1.synchronize()
        return t0.elapsed_time(t1)
    return (t1 - t0) * 1e3


def _time_runs(run, reset, runs, device):
    """Median and min of ``run()`` in ms over ``runs`` repetitions (one untimed first), ``reset()`` before each."""
    times = []
    for i in range(runs + 1):
        reset()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = _now(device)
        run()
        t1 = _now(device)
        if i:
            times.append(_elapsed_ms(t0, t1, device))
    times.sort()
    return times[len(times) // 2], times[0]


SHADOWS = {"fp16": torch.float16, "bf16": torch.bfloat16, "none": None}


def bench_decode(lengths, H, D, device, *, defer=32, shadow="fp16", runs=10, use_triton=None, graph=True):
    """Decode steps (B=1, bf16 values, no gate) at each cache length: PathDecodeCache.step against plain decoding.

    Each timed run is 2·R consecutive real steps (``defer`` = R, so every run holds two folds) from the prefilled
    cache of ``L`` tokens; the cache state is restored between runs (outside the timing), so every run covers
    lengths L … L + 2R. Time per step = median run time / 2R (CUDA events; wall clock on a CPU). Timed the same
    way: the immediate step (``defer=0``, fp32 keys rewritten every step) and plain decoding (SDPA over a bf16
    key/value cache that grows by one per step). Before timing, the deferred step is checked against the
    immediate fp32 step on the same inputs (fp32 queries) over 2R + 1 steps: relative RMS and max error of o. Runs on a CPU
    too (PyTorch step unless ``use_triton``; for a smoke check with a tiny length).

    With ``graph`` (default) on CUDA, each row also times both steps captured in CUDA graphs, over the same runs:

    * the deferred step of ``PathDecodeCache(..., cuda_graph=True)``: per step, the host validates the inputs,
      copies q, k, v, w, β into the graph's static buffers, replays the one graph (prep, attend, merge) and clones
      its output; the fold runs eagerly every R steps. Its output is checked against the eager deferred step
      over the same 2R + 1 steps (``check_graph_max_abs``).
    * plain decoding, captured *per length*: one graph per step of the run (cache write of k and v at position n,
      SDPA over ``kc[:, :, :n+1]``), captured before timing; per step the host copies q, k, v into static buffers,
      replays that step's graph and clones its output. This is the cheapest plain step a graph can give (exactly
      the eager kernels, no masking, no read past n), so the graphed ratios are, if anything, unfavourable to
      PaTH; a generator would need one graph for every length (or a masked max-length view, which reads more).

    Ratios: ``ratio`` (eager PaTH ÷ eager plain), ``ratio_graph`` (graphed ÷ graphed) and
    ``ratio_graph_vs_eager_plain`` (graphed PaTH ÷ eager plain). Without a CUDA device, with ``graph=False`` or
    when the deferred step does not run in Triton, the graph timings are left out and ``graph_skipped`` says why.
    """
    from pathlab.decoding import PathDecodeCache

    device = torch.device(device)
    if shadow not in SHADOWS:
        raise ValueError(f"shadow must be one of {sorted(SHADOWS)}, got {shadow!r}")
    if not isinstance(defer, int) or defer < 1:
        raise ValueError(f"defer must be an int ≥ 1 (the deferred step is what is benchmarked), got {defer!r}")
    R, steps = defer, 2 * defer
    rows = []
    for L in lengths:
        gen = torch.Generator(device=device).manual_seed(0)
        r = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
        room = L + steps + 1
        opts = dict(device=device, value_dtype=torch.bfloat16, use_triton=use_triton)
        cache = PathDecodeCache(1, H, room, D, D, defer=R, shadow_dtype=SHADOWS[shadow], **opts)
        immediate = PathDecodeCache(1, H, room, D, D, defer=0, **opts)
        skipped = _graph_skipped(graph, device, cache)
        graphed = None if skipped else PathDecodeCache(1, H, room, D, D, defer=R, shadow_dtype=SHADOWS[shadow],
                                                       cuda_graph=True, **opts)
        caches = [c for c in (cache, immediate, graphed) if c is not None]
        q, k, v = (r(1, L, H, D).to(torch.bfloat16) for _ in range(3))
        w, beta = r(1, L, H, D), torch.rand(1, L, H, device=device, generator=gen) * 2
        sq, sk, sv = (r(1, steps + 1, H, D).to(torch.bfloat16) for _ in range(3))
        sw, sb = r(1, steps + 1, H, D), torch.rand(1, steps + 1, H, device=device, generator=gen) * 2
        one = lambda x, t: x[:, t:t + 1]  # noqa: E731
        with torch.no_grad():
            for c in caches:
                c.prefill(q, k, v, w, beta)
            saved = {c: _snapshot(c) for c in caches}
            outs = {c: [] for c in caches}
            for t in range(steps + 1):  # the check (fp32 queries, so o comes out in fp32): two folds and a step
                x = (one(sq, t).float(), one(sk, t), one(sv, t), one(sw, t), one(sb, t))
                for c in caches:
                    outs[c].append(c.step(*x))
            o_def, o_imm = torch.cat(outs[cache], 1), torch.cat(outs[immediate], 1)
            check = dict(check_rel_rms=rel_rms(o_def, o_imm),
                         check_max_rel=float((o_def - o_imm).abs().max() / o_imm.abs().max()))
            if graphed is not None:
                check["check_graph_max_abs"] = float((torch.cat(outs[graphed], 1) - o_def).abs().max())
            outs = None

            def stepper(c):
                def run():
                    for t in range(steps):
                        c.step(one(sq, t), one(sk, t), one(sv, t), one(sw, t), one(sb, t))
                return run

            def timed(c):
                return _time_runs(stepper(c), lambda: _restore(c, saved[c]), runs, device)

            t_def, t_imm = timed(cache), timed(immediate)
            kc = r(1, H, room, D).to(torch.bfloat16)
            vc = r(1, H, room, D).to(torch.bfloat16)

            def plain_run():
                for t in range(steps):
                    n = L + t
                    kc[:, :, n] = sk[:, t]
                    vc[:, :, n] = sv[:, t]
                    F.scaled_dot_product_attention(sq[:, t:t + 1].transpose(1, 2), kc[:, :, :n + 1], vc[:, :, :n + 1])

            t_plain = _time_runs(plain_run, lambda: None, runs, device)
            graph_row = {}
            if graphed is not None:
                t_def_g = timed(graphed)  # the untimed first run captures the graph for bf16 queries
                t_plain_g = _time_runs(_plain_graph_run(kc, vc, sq, sk, sv, L, steps), lambda: None, runs, device)
                graph_row = dict(path_step_graph_ms=t_def_g[0] / steps, path_step_graph_min_ms=t_def_g[1] / steps,
                                 plain_step_graph_ms=t_plain_g[0] / steps,
                                 plain_step_graph_min_ms=t_plain_g[1] / steps,
                                 ratio_graph=t_def_g[0] / t_plain_g[0],
                                 ratio_graph_vs_eager_plain=t_def_g[0] / t_plain[0],
                                 graphs_captured=len(graphed._graphs),
                                 plain_graph="one CUDA graph per length (per step of the run), captured before timing")
            else:
                graph_row = dict(graph_skipped=skipped)
        row = dict(method="decode", cache_len=L, H=H, D=D, defer=R, shadow=shadow, fused=cache.use_triton,
                   steps_per_run=steps, runs=runs,
                   path_step_ms=t_def[0] / steps, path_step_min_ms=t_def[1] / steps,
                   path_step_immediate_ms=t_imm[0] / steps, plain_step_ms=t_plain[0] / steps,
                   plain_step_min_ms=t_plain[1] / steps,
                   ratio=t_def[0] / t_plain[0], ratio_immediate=t_imm[0] / t_plain[0], **graph_row, **check)
        print(json.dumps(row), flush=True)
        rows.append(row)
        cache = immediate = graphed = caches = saved = None  # free the caches before the next length
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _graph_skipped(graph, device, cache):
    """Why the CUDA-graph timings of a decode row are left out (None: they run)."""
    if not graph:
        return "not requested (graph=False, --no-decode-graph)"
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device; this run is on {device.type}"
    if not cache.use_triton:
        return "the deferred step does not run in Triton here (use_triton=False), and only that step is captured"
    return None


def _plain_graph_run(kc, vc, sq, sk, sv, L, steps):
    """Plain decoding from CUDA graphs: one graph per step t of a run (write k, v at n = L + t, SDPA over 0 … n),
    captured here from static q, k, v buffers after an eager warm-up on a side stream; returns the timed run."""
    static = [x[:, :1].clone() for x in (sq, sk, sv)]
    sq_, sk_, sv_ = static

    def plain_step(n):
        kc[:, :, n] = sk_[:, 0]
        vc[:, :, n] = sv_[:, 0]
        return F.scaled_dot_product_attention(sq_.transpose(1, 2), kc[:, :, :n + 1], vc[:, :, :n + 1])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for t in range(steps):  # warm-up: SDPA picks and loads its kernels for every length
            plain_step(L + t)
    torch.cuda.current_stream().wait_stream(side)
    pool = torch.cuda.graph_pool_handle()
    graphs, outs = [], []
    for t in range(steps):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            outs.append(plain_step(L + t))
        graphs.append(g)

    def run():
        for t in range(steps):
            for dst, src in zip(static, (sq, sk, sv)):
                dst.copy_(src[:, t:t + 1])
            graphs[t].replay()
            outs[t].clone()

    return run


def _snapshot(cache):
    """What a run of steps changes in a PathDecodeCache (the values and gates past the prompt are rewritten):
    the keys, M, the recent keys, the device counters of the Triton step, and the host's length and base."""
    live = [getattr(cache, name) for name in ("k", "k_shadow", "M", "rk")] + [getattr(cache._ws, "pos", None)]
    return [(t, t.clone()) for t in live if t is not None], cache.length, cache.base


def _restore(cache, snap):
    tensors, cache.length, cache.base = snap
    for live, saved in tensors:
        live.copy_(saved)


TUNE_FWD = [(4, 3), (8, 2), (4, 2)]
TUNE_BWD = [(4, 1, 2), (8, 1, 2), (8, 1, 4), (4, 1, 4)]


def tune(cases, device, tokens):
    """Forward and backward launch configurations of the PaTH kernel (``KernelConfig.fwd_launch``/``bwd_launch``)."""
    from triton.testing import do_bench

    from pathlab.kernels import KernelConfig, path_attention_triton

    rows = []
    for T, H, D in cases:
        B = max(1, tokens // T)
        q, k, v, w, beta, g = make_inputs(B, T, H, D, device=device)
        leaves = [t.requires_grad_() for t in (q, k, v, w, beta)]
        for kind, configs in (("fwd", TUNE_FWD), ("fwd_bwd", TUNE_BWD)):
            for launch in configs:
                config = KernelConfig(**{"fwd_launch" if kind == "fwd" else "bwd_launch": launch})
                fn = lambda: path_attention_triton(q, k, v, w, beta, config=config)  # noqa: E731
                row = dict(tune=kind, config=",".join(map(str, launch)), T=T, H=H, D=D)
                try:
                    if kind == "fwd":
                        with torch.no_grad():
                            row["ms"] = do_bench(fn, warmup=25, rep=100)
                    else:
                        do = torch.randn_like(fn())
                        row["ms"] = do_bench(lambda: torch.autograd.grad(fn(), leaves, do), warmup=25, rep=100)
                except Exception as err:  # noqa: BLE001
                    row["error"] = f"{type(err).__name__}: {err}"[:200]
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def best_configs(rows):
    """{(kind, D): config} with the lowest time among the tuned launch configs."""
    best = {}
    for r in rows:
        if "ms" not in r:
            continue
        key = (r["tune"], r["D"])
        if key not in best or r["ms"] < best[key][1]:
            best[key] = (r["config"], r["ms"])
    return {k: v[0] for k, v in best.items()}


def tuned_config(chosen, D):
    """The KernelConfig of the tuned launches at head dim D (None when none was tuned)."""
    from pathlab.kernels import KernelConfig

    launches = {("fwd_launch" if kind == "fwd" else "bwd_launch"): tuple(int(x) for x in cfg.split(","))
                for (kind, d), cfg in chosen.items() if d == D}
    return KernelConfig(**launches) if launches else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=DEFAULT_CASES, help="comma list of TxHxD")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--tokens", type=int, default=32768, help="B·T per case")
    ap.add_argument("--decode", default="4096,16384,65536", help="cache lengths for the decode step ('' = none)")
    ap.add_argument("--decode-shape", default="12x64", help="HxD of the decode benchmark")
    ap.add_argument("--decode-defer", type=int, default=32, help="R of the deferred decode step (fold every R)")
    ap.add_argument("--decode-shadow", default="fp16", choices=sorted(SHADOWS),
                    help="precision of the key copy the deferred step attends over")
    ap.add_argument("--decode-runs", type=int, default=10, help="timed runs of 2·R decode steps per length")
    ap.add_argument("--decode-graph", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the deferred step and plain decoding captured in CUDA graphs (default on)")
    ap.add_argument("--check", default=",".join(PATH_METHODS + ("fla_path", "fla_path_fox")),
                    help="methods checked vs reference")
    ap.add_argument("--w-dtype", default="fp32", choices=sorted(W_DTYPES),
                    help="dtype of w (bf16 is the language model's)")
    ap.add_argument("--out", default=None, help="JSON result file")
    ap.add_argument("--tune", default="", help="TxHxD cases on which to sweep the kernel's launch configs first")
    ap.add_argument("--profile", default="",
                    help="TxHxD cases at which to profile path and path_fox fwd+bwd by kernel (scan vs the rest)")
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="seconds; cases that would start after this are recorded as skipped (0 = no limit)")
    args = ap.parse_args(argv)
    global W_DTYPE
    W_DTYPE = W_DTYPES[args.w_dtype]
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    methods = split_methods(args.methods)
    for m in methods:
        parse_method(m)  # unknown names stop here, before any timing
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",") if c]
    result = dict(
        command=" ".join([os.path.basename(sys.executable)] + sys.argv),
        device=torch.cuda.get_device_name(), torch=torch.__version__, python=platform.python_version(),
        fla=_fla()[1] or "importable", started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        w_dtype=args.w_dtype,
        correctness={}, cases=[], decode=[],
        notes="fla_path_fox gets g/scale (fla scales the gate); peak_mib = extra memory of one fwd+bwd",
    )
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        pass
    if args.tune:
        tune_cases = [tuple(int(x) for x in c.split("x")) for c in args.tune.split(",") if c]
        result["tune"] = tune(tune_cases, device, args.tokens)
        chosen = best_configs(result["tune"])
        result["tuned_configs"] = {f"{k[0]}-D{k[1]}": v for k, v in chosen.items()}
        _write(args.out, result)
    else:
        chosen = {}
    for H, D in sorted({(c[1], c[2]) for c in cases}):
        for m in [x for x in split_methods(args.check) if x in methods]:
            try:
                errs = check_correctness(m, H, D, device)
            except Exception as err:  # noqa: BLE001
                errs = {"error": f"{type(err).__name__}: {err}"}
            if errs is not None:
                result["correctness"][f"{m}-{H}x{D}"] = errs
                print(m, H, D, json.dumps(errs), flush=True)
    for case in [c for c in args.profile.split(",") if c]:
        T, H, D = (int(x) for x in case.split("x"))
        for m in [x for x in methods if parse_method(x)[0] in PATH_METHODS]:
            try:
                row = profile_case(T, H, D, m, device, args.tokens)
            except Exception as err:  # noqa: BLE001  (record the failure, keep going)
                row = dict(method=m, T=T, H=H, D=D, error=f"{type(err).__name__}: {err}"[:500])
            result.setdefault("profile", []).append(row)
            print(json.dumps({key: val for key, val in row.items() if key != "kernels"}), flush=True)
        _write(args.out, result)
    if args.decode:  # cheap: before the long cases, so a time limit never loses it
        H, D = (int(x) for x in args.decode_shape.split("x"))
        try:
            result["decode"] = bench_decode([int(x) for x in args.decode.split(",")], H, D, device,
                                            defer=args.decode_defer, shadow=args.decode_shadow,
                                            runs=args.decode_runs, graph=args.decode_graph)
        except Exception as err:  # noqa: BLE001
            result["decode"] = [{"error": f"{type(err).__name__}: {err}"}]
            print(result["decode"], flush=True)
        _write(args.out, result)
    t0 = time.time()
    for T, H, D in cases:
        if args.time_budget and time.time() - t0 > args.time_budget:
            result["cases"].append(dict(T=T, H=H, D=D, skipped=f"time budget of {args.time_budget} s spent"))
            continue
        result["cases"].extend(bench_case(T, H, D, methods, device, args.tokens, tuned_config(chosen, D)))
        _write(args.out, result)
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    _write(args.out, result)
    return 0


def _write(path, result):
    if not path:
        return
    atomic_write_text(path, json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
