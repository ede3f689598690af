"""``pathlab.path_attention``: PaTH and PaTH-FoX with a choice of backend.

s_ij = scale · q_iᵀ H_i H_{i−1} ⋯ H_{j+1} k_j + (G_i − G_j),   H_t = I − β_t w_t w_tᵀ,   G = cumsum(g)

Backends:
* ``"triton"``: the fused kernel in :mod:`pathlab.kernels` (CUDA tensors);
* ``"torch"``: the blockwise UT algorithm in plain PyTorch (:mod:`pathlab.ops.path_blockwise`), any device,
  O(T·D) memory per head;
* ``"reference"``: the explicit fp64 product (:mod:`pathlab.reference.path`), T×T, for tests;
* ``"auto"``: triton on CUDA when it imports, otherwise torch (with a one-time warning on CUDA). Never a T×T path.

Non-finite inputs. Every backend keeps the sequences of a batch (and the kernel's ``cu_seqlens`` segments) apart:
a NaN or inf in one changes no output or gradient of another. Within a sequence, the reference is causal position
by position: a NaN at position t reaches no output before t. The chunked UT algorithm ("torch" and "triton")
is causal chunk by chunk: the outputs before t's chunk (chunks of ``chunk_size`` tokens, of the kernel's
``block_size`` for "triton", counted from the sequence start) are the clean ones bit for bit, but inside t's
chunk a NaN in v_t, w_t or β_t reaches every row, the earlier ones too: the chunk's dense products multiply the
zeros of their triangular masks by it (0 · NaN = NaN), in P V of the diagonal block, U = A D_β W and the carried
q̃ = Q − tril(Q Wᵀ) U. That is inherent to computing a chunk by matrix products. A NaN in q_t, k_t or g_t stays
at t and later (with 16-bit inputs the fused UT kernels scale each tile by its largest element, which may spread
it over the chunk). ``tests/test_path_isolation.py`` pins this.
"""

from __future__ import annotations

import warnings

import torch

from pathlab._checks import check_path_inputs, check_path_values, check_scale, debug_enabled, normalize_w

BACKENDS = ("auto", "triton", "torch", "reference")
_warned_fallback = False


def _triton_kernel():
    """The Triton entry point, or the ImportError that explains why it is unavailable."""
    try:
        from pathlab.kernels import path_attention_triton
    except ImportError as err:  # triton missing, or the kernel module not built for this install
        return _explained(err)
    return path_attention_triton


def _explained(err: ImportError) -> ImportError:
    """``err``, with what to do when ``pathlab.kernels`` itself is missing: the package maps the checkout's
    ``kernels/`` folder to that name when installed, so a checkout used through ``PYTHONPATH`` alone lacks it."""
    if isinstance(err, ModuleNotFoundError) and err.name == "pathlab.kernels":
        return ImportError(f"{err}: install the project (pip install -e . in the checkout), which maps the "
                           "kernels/ folder to pathlab.kernels")
    return err


def resolve_backend(backend: str, device: torch.device) -> str:
    global _warned_fallback
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    if device.type != "cuda":
        return "torch"
    kernel = _triton_kernel()
    if callable(kernel):
        return "triton"
    if not _warned_fallback:
        warnings.warn(
            f"pathlab.path_attention: the Triton kernel is unavailable ({kernel}); using the blockwise PyTorch "
            "path, which is correct but slower",
            RuntimeWarning,
            stacklevel=3,
        )
        _warned_fallback = True
    return "torch"


def path_attention(q, k, v, w, beta, g=None, *, scale=None, backend: str = "auto", chunk_size: int = 64):
    """PaTH attention (PaTH-FoX when a log forget gate ``g`` is given), causal.

    Args:
        q: ``[B, T, H, D]`` queries.
        k: ``[B, T, Hkv, D]`` keys; H must be a multiple of Hkv (grouped heads).
        v: ``[B, T, Hkv, Dv]`` values.
        w: ``[B, T, Hkv, D]`` Householder directions, unit-normalised here in fp32 (fp64 for fp64 input).
        beta: ``[B, T, Hkv]`` in (0, 2): H_t has eigenvalue 1 − β_t along w_t.
        g: ``[B, T, H]`` log forget gates ≤ 0, or None. Not multiplied by ``scale`` (FoX's convention; the public
            fla kernel multiplies the gate by the scale too).
        scale: logit scale, default 1/√D.
        backend: ``"auto"``, ``"triton"``, ``"torch"`` or ``"reference"``.
        chunk_size: chunk length of the ``"torch"`` backend.

    Returns:
        o ``[B, T, H, Dv]`` in q's dtype.
    """
    check_path_inputs(q, k, v, w, beta, g)
    scale = check_scale(scale, q.shape[-1])
    backend = resolve_backend(backend, q.device)
    if backend == "reference":
        from pathlab.reference.path import path_attention as reference

        return reference(q, k, v, w, beta, g, scale=scale)
    if debug_enabled() and not torch.compiler.is_compiling():  # a synchronising check cannot enter a graph
        check_path_values(beta, g)
    beta = beta.to(torch.promote_types(beta.dtype, torch.float32))
    g = None if g is None else g.to(torch.promote_types(g.dtype, torch.float32))
    if backend == "triton":
        kernel = _triton_kernel()
        if not callable(kernel):
            raise ValueError(f"backend='triton' is unavailable: {kernel}")
        if q.device.type != "cuda":
            raise ValueError(f"backend='triton' needs CUDA tensors, got q on {q.device}")
        # the kernel normalises the raw w in fp32 itself (the fused UT route reads it in place, in its dtype);
        # autocast would run the fp32 UT prep's matrix products in bf16: the dtypes here are chosen explicitly
        with torch.autocast(q.device.type, enabled=False):
            return kernel(q, k, v, w, beta.float(), None if g is None else g.float(), scale=scale)
    w = normalize_w(w)
    from pathlab.ops.path_blockwise import path_attention_blockwise

    with torch.autocast(q.device.type, enabled=False):
        return path_attention_blockwise(q, k, v, w, beta, g, scale=scale, chunk_size=chunk_size)
