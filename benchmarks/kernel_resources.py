"""Registers, spills and shared memory of the PaTH kernels as built for an H200 (sm_90), without a GPU.

Each kernel is compiled by Triton for ``GPUTarget("cuda", 90, 32)`` and its PTX assembled by the ``ptxas`` that
Triton ships (``ptxas -v``); the PTX is also searched for barriers (``bar.sync``), atomic reductions
(``red.``, ``atom.``) and tensor-core instructions (``mma.sync``, ``wgmma``). Spills and barriers inside the scan's loop
over chunk pairs are what a profile of the backward cannot show by itself; this runs on any machine with triton.
Triton versions allocate differently: for the numbers of the H200's Triton 3.6, run it in an environment of its own
with ``pip install torch==2.13.0 triton==3.6.0 numpy`` (they match what the GPU reports).

    python benchmarks/kernel_resources.py --out kernel-resources-sm90.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# Pointer arguments by name (the kernels spell pointers in capitals; any other is fp32), and the capitalised
# integer arguments.
POINTERS = {"Q": "*bf16", "K": "*bf16", "W": "*bf16", "V": "*bf16", "DO": "*bf16", "O": "*bf16", "KS_SCAN": "*fp16",
            "M_SCAN": "*fp16", "SCRATCH": "*fp16", "STATES": "*fp16", "GO": "*fp64", "TOK": "*i64", "CHUNK_FIRST": "*i64",
            "CHUNK_INDEX": "*i64", "ORDER": "*i64", "SEQ_ORDER": "*i32", "SEQ_CHUNKS": "*i32", "DVO": "*bf16"}
INTEGERS = ("NC", "NH", "T", "NTOK")
FLOATS = ("wide",)  # fp32 scalars besides the scales
NARROW_SCRATCH = ("DU", "DX", "DKP", "DWP", "DAD")  # the UT backward's scratch, fp16 with NARROW


def signature(kernel, constexprs, scan: bool):
    """Triton signature of ``kernel``: constexprs, typed pointers (capitalised names) and i32/fp32 scalars."""
    sig = {}
    for p in kernel.params:
        name = p.name
        if p.is_constexpr or name in constexprs:
            sig[name] = "constexpr"
        elif name.isupper() and name not in INTEGERS:
            key = f"{name}_SCAN" if scan and name in ("KS", "M") else name
            narrow = constexprs.get("NARROW") and name in NARROW_SCRATCH
            sig[name] = "*fp16" if narrow else POINTERS.get(key, "*fp32")
        else:
            sig[name] = "fp32" if "scale" in name or name in FLOATS else "i32"
    return sig


def ptxas_path() -> pathlib.Path:
    import triton.backends.nvidia as nvidia

    bin_dir = pathlib.Path(nvidia.__file__).parent / "bin"
    for name in ("ptxas-blackwell", "ptxas"):
        if (bin_dir / name).exists():
            return bin_dir / name
    raise FileNotFoundError(f"no ptxas under {bin_dir}")


def resources(kernel, constexprs, num_warps, num_stages=1, scan=False):
    src = ASTSource(fn=kernel, signature=signature(kernel, constexprs, scan), constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    ptx = compiled.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        log = subprocess.run([str(ptxas_path()), "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                             capture_output=True, text=True).stderr

    def number(pattern):
        found = re.findall(pattern, log)
        return int(found[0]) if found else None

    return dict(num_warps=num_warps, num_stages=num_stages, shared_bytes=compiled.metadata.shared,
                registers=number(r"Used (\d+) registers"), spill_store_bytes=number(r"(\d+) bytes spill stores"),
                spill_load_bytes=number(r"(\d+) bytes spill loads"), bar_sync=ptx.count("bar.sync"),
                red=len(re.findall(r"\sred\.", ptx)), atom=len(re.findall(r"\satom\.", ptx)),
                mma_sync=ptx.count("mma.sync"), wgmma=ptx.count("wgmma.mma_async"))


def cases(dims, GROUP=1):
    from pathlab.kernels import scan_backward_by_chunk, scan_backward_by_sequence, scan_forward
    from pathlab.kernels import ut_backward, ut_common, ut_forward

    class _UT:  # the UT kernels and their launch choices, wherever each lives
        def __getattr__(self, name):
            for module in (ut_common, ut_forward, ut_backward):
                if hasattr(module, name):
                    return getattr(module, name)
            raise AttributeError(name)

    _triton_ut = _UT()

    for D in dims:
        for gate in (False, True):
            for lam_bf16 in (True, False):  # λ's products on bf16 operands (the GPU default) or tf32
                for warps in (4, 8):
                    yield (f"scan_bwd D{D} gate={gate} lambda={'bf16' if lam_bf16 else 'tf32'}",
                           scan_backward_by_chunk._path_bwd_kernel,
                           dict(GROUP=1, HAS_GATE=gate, BT=64, D=D, DV=D, PREC="tf32", PREC32="tf32",
                                LAMBDA_BF16=lam_bf16, PREFETCH=D <= 64, GATHER=False,
                                SV_T=D, V_ROWS=D <= 64),
                           warps, True)
            # the carried states read from the forward instead of replayed (at 4 warps, λ in bf16)
            yield (f"scan_bwd D{D} gate={gate} lambda=bf16 forward-states", scan_backward_by_chunk._path_bwd_kernel,
                   dict(GROUP=1, HAS_GATE=gate, BT=64, D=D, DV=D, PREC="tf32", PREC32="tf32", LAMBDA_BF16=True,
                        PREFETCH=D <= 64, GATHER=False, SV_T=D, V_ROWS=D <= 64,
                        FWD_STATES=True),
                   4, True)
            # the backward by sequence (R query chunks a tile, warps, pipeline stages)
            for R, warps, stages in ((1, 4, 1), (1, 4, 2), (1, 4, 3), (1, 8, 2), (2, 8, 1), (2, 8, 2)):
                yield (f"scan_bwd_by_sequence D{D} gate={gate} R={R} warps={warps} stages={stages}",
                       scan_backward_by_sequence._path_bwd_by_sequence_kernel,
                       dict(GROUP=1, HAS_GATE=gate, BT=64, D=D, DV=D, R=R, PREC="tf32", PREC32="tf32",
                            LAMBDA_BF16=True, GATHER=False, V_GATHER=False),
                       warps, True, stages)
            for keep in (False, True):  # the forward keeping its carried states for the backward
                yield (f"scan_fwd D{D} gate={gate}{' keep-states' if keep else ''}", scan_forward._path_fwd_kernel,
                       dict(GROUP=1, HAS_GATE=gate, BT=64, D=D, DV=D, PREC="tf32", GATHER=False, SV_T=D,
                            V_ROWS=D <= 64, KEEP_STATES=keep),
                       4, True)
        for gram16 in (False, True):  # W Wᵀ by 3 tf32 passes on fp32 rows, or one pass on the bf16 rows
            yield (f"ut_inverse D{D} gram16={gram16}", _triton_ut._ut_inverse_kernel,
                   dict(BT=64, D=D, GRAM16=gram16), _triton_ut._INVERSE_NUM_WARPS, False)
        # q̃, k̃, S_d again from split fp16 products where a chunk's bound asks for them
        yield (f"ut_fwd_split_kernel D{D}", _triton_ut._ut_fwd_split_kernel, dict(GROUP=GROUP, BT=64, D=D),
               _triton_ut.num_warps(D), False)
        for half in (False, True):  # tf32 products, or fp16 on operands scaled by powers of two
            tag = " half" if half else ""
            yield (f"ut_fwd_kernel D{D}{tag}", _triton_ut._ut_fwd_kernel, dict(GROUP=GROUP, BT=64, D=D, HALF=half),
                   _triton_ut.num_warps(D), False)
            # the backward in three kernels (heads, chunk, inverse), or split in five (end, dq, sums, chunk,
            # inverse; D = 128)
            yield (f"ut_bwd_heads_kernel D{D}{tag}", _triton_ut._ut_bwd_heads_kernel,
                   dict(GROUP=GROUP, BT=64, D=D, HALF=half), _triton_ut.num_warps(D), False)
            yield (f"ut_bwd_chunk_kernel D{D}{tag}", _triton_ut._ut_bwd_chunk_kernel,
                   dict(BT=64, D=D, HALF=half), _triton_ut.num_warps(D), False)
            for name in ("_ut_bwd_end_kernel", "_ut_bwd_dq_kernel", "_ut_bwd_sums_kernel", "_ut_bwd_inverse_kernel"):
                kernel = getattr(_triton_ut, name)
                group = {"GROUP": GROUP} if "GROUP" in [p.name for p in kernel.params] else {}
                yield (f"{name.strip('_')} D{D}{tag}", kernel, dict(BT=64, D=D, HALF=half, **group),
                       _triton_ut.num_warps(D), False)
            if half:  # the three-kernel backward with its scratch in scaled fp16 (``ut_backward.narrow_scratch``)
                for name in ("_ut_bwd_heads_kernel", "_ut_bwd_chunk_kernel", "_ut_bwd_inverse_kernel"):
                    kernel = getattr(_triton_ut, name)
                    group = {"GROUP": GROUP} if "GROUP" in [p.name for p in kernel.params] else {}
                    warps = (_triton_ut.inverse_grads_warps if "inverse" in name else _triton_ut.num_warps)(D)
                    yield (f"{name.strip('_')} D{D} half narrow-scratch", kernel,
                           dict(BT=64, D=D, HALF=half, NARROW=True, **group), warps, False)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="64,128", help="comma list of head dims")
    ap.add_argument("--group", type=int, default=1, help="query heads per kv head of the UT kernels")
    ap.add_argument("--only", default="", help="build only the kernels whose label contains this text")
    ap.add_argument("--out", default=None, help="JSON result file")
    args = ap.parse_args(argv)
    from pathlab.kernels.runtime import interpreting

    if interpreting():
        raise SystemExit("kernel_resources builds GPU code: run it without TRITON_INTERPRET")
    rows = []
    for label, kernel, constexprs, warps, scan, *stages in cases([int(d) for d in args.dims.split(",")], args.group):
        if args.only not in label:
            continue
        try:
            row = dict(kernel=label, **resources(kernel, constexprs, warps, *stages, scan=scan))
        except Exception as err:  # noqa: BLE001  (a kernel that does not build for sm_90: record why, go on)
            row = dict(kernel=label, num_warps=warps, error=f"{type(err).__name__}: {str(err)[:300]}")
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        from pathlab.results import write_benchmark_result

        write_benchmark_result(args.out, "benchmarks/kernel_resources.py", sys.argv[1:] if argv is None else argv,
                               triton=triton.__version__, target="cuda sm_90", rows=rows)


if __name__ == "__main__":
    main()
