"""Positional building blocks: RoPE frequencies, ALiBi slopes, accumulated phases and block rotations.

Rotations act on the pairs (x[..., b], x[..., b + D/2]), b = 0 … D/2 − 1 (the "half split"), with
R(φ) = [[cos φ, −sin φ], [sin φ, cos φ]].

Phases are formed in fp64 and reduced mod 2π; their cos/sin are taken once and the rotation itself
(:func:`rotate_cos_sin`) is only x₁ cos − x₂ sin, x₁ sin + x₂ cos. RoPE's cos/sin depend on the position alone:
:func:`rope_cos_sin` keeps them in a table per (head dim, base, device, dtype), computed once and reused by every
layer and call, and under ``torch.compile`` the table enters the graph as a constant input (nothing of it is
recomputed per element of q and k).
"""

from __future__ import annotations

import math
import operator

import torch

from pathlab.ops import rotate_op

TWO_PI = 2.0 * math.pi
ROTATE_BACKEND = "triton"  # on CUDA; the GPU tests set "torch" to compare the op with the PyTorch expression


def _check_rotary(head_dim: int, base: float) -> None:
    if head_dim % 2 != 0 or head_dim <= 0:
        raise ValueError(f"rotations need an even head dim, got {head_dim}")
    if not base > 1:
        raise ValueError(f"rope base must be > 1, got {base!r}")


def rope_frequencies(head_dim: int, base: float = 10000.0, device=None) -> torch.Tensor:
    """ω_b = base^(−2b/D), b = 0 … D/2 − 1, in fp64: ``[D/2]``."""
    _check_rotary(head_dim, base)
    b = torch.arange(head_dim // 2, dtype=torch.float64, device=device)
    return base ** (-2.0 * b / head_dim)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi head slopes m_h (Press et al.): for H a power of two m_h = 2^(−8h/H), h = 1 … H; otherwise the
    slopes of the nearest lower power of two c, then every other slope of 2c: ``[H]`` fp32."""
    if not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"n_heads must be a positive integer, got {n_heads!r}")

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    c = 2 ** int(math.floor(math.log2(n_heads)))
    slopes = power_of_two(c)
    if c < n_heads:
        slopes += power_of_two(2 * c)[0::2][: n_heads - c]
    return torch.tensor(slopes, dtype=torch.float32)


def accumulate_phases(theta: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Φ_t = Σ_{s≤t} θ_s along ``dim``, summed in fp64 and reduced mod 2π (so fp32 cos/sin stay accurate at 65K)."""
    return torch.remainder(torch.cumsum(theta.to(torch.float64), dim=dim), TWO_PI)


def rope_phases(length: int, head_dim: int, base: float = 10000.0, device=None) -> torch.Tensor:
    """RoPE as an accumulated rotation with constant steps: Φ_t = t·ω (mod 2π), fp64 ``[T, D/2]``."""
    t = torch.arange(length, dtype=torch.float64, device=device)
    return torch.remainder(t[:, None] * rope_frequencies(head_dim, base, device=device)[None, :], TWO_PI)


def rotation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision rotations work in: fp64 for fp64 inputs, fp32 for every other dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def cos_sin(phase: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos φ and sin φ of an already-reduced phase, taken in ``dtype`` (what :func:`rotate` does per call)."""
    phase = phase.to(dtype)
    return torch.cos(phase), torch.sin(phase)


def _on_cuda(x: torch.Tensor) -> bool:
    return x.is_cuda


def _use_rotate_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cached_table: bool) -> bool:
    if not (_on_cuda(x) and ROTATE_BACKEND == "triton"):
        return False
    # RoPE's cached table is an fp32 constant on x's device by construction; under torch.compile it is a constant
    # of the graph whose attributes Dynamo cannot read, so only x is checked
    return rotate_op.supports_input(x) if cached_table else rotate_op.supports(x, cos, sin)


def rotate_cos_sin(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                   inverse: bool = False, cached_table: bool = False) -> torch.Tensor:
    """Apply R(φ_b) (R(−φ_b) with ``inverse``) to each pair (x_b, x_{b+D/2}) given cos φ and sin φ:
    ``x [..., D]``, ``cos``/``sin`` broadcastable to ``[..., D/2]``. The arithmetic runs in cos's dtype; the result
    has x's dtype.

    On CUDA, a ``[B, T, H, D]`` x rotated by fp32 tables that need no gradient (RoPE, random rotations) goes
    through the custom op ``pathlab::rotate_pairs`` (:mod:`pathlab.ops.rotate_op`, a Triton kernel with the same
    arithmetic). ``cached_table``: cos/sin are
    (slices of) :func:`rope_cos_sin`'s table in ``rotation_dtype(x.dtype)`` on x's device.
    """
    if _use_rotate_op(x, cos, sin, cached_table):
        return rotate_op.rotate_pairs(x, cos, sin, -1 if inverse else 1)
    work = cos.dtype
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].to(work), x[..., half:].to(work)
    if inverse:
        return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1).to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


def rotate(x: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
    """Apply R(φ_b) to each pair (x_b, x_{b+D/2}). ``x [..., D]``, ``phase`` broadcastable to ``[..., D/2]``.

    cos/sin are taken in fp32 (fp64 for fp64 inputs) of the already-reduced phase, then cast to x's dtype.
    To rotate several tensors by one phase, take :func:`cos_sin` once and use :func:`rotate_cos_sin`.
    """
    return rotate_cos_sin(x, *cos_sin(phase, rotation_dtype(x.dtype)))


# ----------------------------------------------------------------------------- RoPE's cos/sin table

ROPE_TABLE_ROWS = 1024  # tables grow in whole multiples of this many positions
_rope_tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

# Under torch.compile the two functions below run while the graph is traced (their results are constants of the
# graph): the table enters the compiled graph as an input, never as arithmetic inlined into the rotation kernels.


def _constant_under_compile(fn):
    """``torch.compiler.assume_constant_result`` without its import of ``torch._dynamo`` (and with it of triton)
    at ``import pathlab``: triton reads ``TRITON_INTERPRET`` when it is first imported, so importing it here would
    fix the kernels' interpreter mode before a user or a test could set it. Dynamo reads this marker."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_under_compile
def _rope_table_rows(head_dim: int, base: tuple[int, int], device: torch.device, dtype: torch.dtype) -> int:
    """How many positions the cached table for this key holds now (0 if none)."""
    table = _rope_tables.get((head_dim, base, device, dtype))
    return 0 if table is None else table[0].shape[0]


@_constant_under_compile
def _rope_table(head_dim: int, base: tuple[int, int], rows: int, device: torch.device, dtype: torch.dtype):
    """The cached (cos, sin) table for this key, ``[≥ rows, D/2]`` each; built or rebuilt longer when it holds
    fewer than ``rows`` positions. ``base`` is the exact ratio of integers (``float.as_integer_ratio``). A row's
    values do not depend on the table's length."""
    key = (head_dim, base, device, dtype)
    table = _rope_tables.get(key)
    if table is None or table[0].shape[0] < rows:
        with torch.inference_mode(False):  # a table first built under inference mode must still serve training
            phase = rope_phases(rows, head_dim, base[0] / base[1], device=device)  # fp64, reduced mod 2π
            table = _rope_tables[key] = (torch.cos(phase).to(dtype), torch.sin(phase).to(dtype))
    return table


def rope_cos_sin(length: int, head_dim: int, base: float = 10000.0, *, start: int = 0, device=None,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos Φ_t and sin Φ_t (Φ_t = t·ω mod 2π, from fp64 phases) for t = start … start + length − 1:
    ``[length, D/2]`` each, in ``dtype`` (fp32, or fp64 for fp64 models).

    Served from a table cached per (head dim, base, device, dtype) that grows in steps of ``ROPE_TABLE_ROWS``
    positions; the returned tensors are views of it and must not be modified. With dynamic shapes under
    ``torch.compile`` a symbolic length within the table slices it; only a length past its end is specialised.
    """
    _check_rotary(head_dim, base)
    # constants even where torch.compile made them symbolic (dynamic=True): they key the table
    head_dim, base = operator.index(head_dim), float(base).as_integer_ratio()
    device = torch.device("cpu") if device is None else torch.device(device)
    stop = start + length
    rows = _rope_table_rows(head_dim, base, device, dtype)
    if stop > rows:
        rows = -(-operator.index(stop) // ROPE_TABLE_ROWS) * ROPE_TABLE_ROWS  # a symbolic stop is specialised
    cos, sin = _rope_table(head_dim, base, rows, device, dtype)
    return cos[start:stop], sin[start:stop]
