"""Generation cache for PaTH and PaTH-FoX: keys carried to the current step, updated in place.

With s_tj = scale · q_tᵀ H_t ⋯ H_{j+1} k_j + (G_t − G_j), keep every cached key already carried to the last
token, k_j⁽ᵗ⁾ = H_t ⋯ H_{j+1} k_j. A new token t+1 then costs one pass over the cache:

    k_j ← k_j − β_{t+1} (k_jᵀ w_{t+1}) w_{t+1}   for all cached j ≤ t      (H_{t+1} applied in place)
    append k_{t+1} unchanged;   o = softmax(scale · K q_{t+1} + G_{t+1} − G) V   (ordinary decoding)

Precision. Keys live in fp32 (``dtype``) and are rewritten in place, never re-rounded to bf16. Each H_t has
eigenvalues 1 and 1 − β_t ∈ (−1, 1), so ‖H_t‖ ≤ 1 and the rounding errors add up at most linearly: after n
steps ‖Δk_j‖ ≲ n · c · ε_fp32 · ‖k_j‖ with ε_fp32 ≈ 6e-8 and c a small constant (one dot product of length D
and one axpy per step), i.e. ≲ 1e-3 relative even after 64K steps, and about √n · ε in practice (random
rounding). The gate sums G are kept in fp64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _normalize(w):
    return F.normalize(w.to(torch.promote_types(w.dtype, torch.float32)), dim=-1)


def carry_keys_to_end(k, w, beta, chunk: int = 64):
    """Keys carried to the end of the sequence, H_T ⋯ H_{j+1} k_j, for every j.

    k, w ``[B, T, Hkv, D]`` (w unit-norm), beta ``[B, T, Hkv]``; computed in ``k``'s dtype (use fp32/fp64).
    Chunks are visited right to left with the UT form H_last ⋯ H_first = I − Wᵀ U of each chunk and the D×D
    product S of every later chunk: O(T·C·D + T·D²) work, O(T·D) memory.
    Returns ``[B, Hkv, T, D]``.
    """
    B, T, Hkv, D = k.shape
    dt = k.dtype
    k, w, beta = k.transpose(1, 2), w.to(dt).transpose(1, 2), beta.to(dt).transpose(1, 2)  # [B, Hkv, T, ·]
    out = torch.empty_like(k)
    eye_d = torch.eye(D, dtype=dt, device=k.device)
    S = eye_d.expand(B, Hkv, D, D).clone()  # product of the transitions after the current chunk
    for end in range(T, 0, -chunk):
        start = max(0, end - chunk)
        C = end - start
        Wc, Kc, bc = w[:, :, start:end], k[:, :, start:end], beta[:, :, start:end]
        strict = torch.ones(C, C, dtype=torch.bool, device=k.device).tril(-1)
        eye = torch.eye(C, dtype=dt, device=k.device)
        L = eye + (bc[..., :, None] * (Wc @ Wc.transpose(-1, -2))).masked_fill(~strict, 0.0)
        A = torch.linalg.solve_triangular(L, eye.expand_as(L), upper=False, unitriangular=True)
        AD = A * bc[..., None, :]
        k_end = Kc - (AD @ (Wc @ Kc.transpose(-1, -2)).masked_fill(~strict, 0.0)).transpose(-1, -2) @ Wc
        out[:, :, start:end] = k_end @ S.transpose(-1, -2)
        S = S - (S @ Wc.transpose(-1, -2)) @ (AD @ Wc)  # S ← S (I − Wᵀ U)
    return out


class PathDecodeCache:
    """Per-layer generation cache for PaTH / PaTH-FoX; keys kept in fp32, updated in place.

    Args:
        batch, n_kv_heads, max_len, head_dim, value_dim: sizes of the preallocated cache.
        n_heads: query heads (a multiple of ``n_kv_heads``; default equal). Query head h reads kv head
            h // (n_heads / n_kv_heads).
        dtype: key (and gate) cache precision; fp32 by default (fp64 for exact tests).
        value_dtype: value cache dtype (default ``dtype``; bf16 halves the value traffic of a step).
        use_triton: fuse the key update and the attention of :meth:`step` in one Triton kernel
            (:mod:`pathlab.kernels.decode`). None = on CUDA when the shapes allow it (fp32 keys, power-of-two
            head dims ≥ 16 and group size); False = plain PyTorch ops (what the CPU always uses).

    ``w`` passed to :meth:`prefill` and :meth:`step` is the raw direction: it is normalised here in fp32.
    """

    def __init__(self, batch, n_kv_heads, max_len, head_dim, value_dim, *, n_heads=None, device=None,
                 dtype=torch.float32, value_dtype=None, use_triton=None):
        for name, x in (("batch", batch), ("n_kv_heads", n_kv_heads), ("max_len", max_len),
                        ("head_dim", head_dim), ("value_dim", value_dim)):
            if not isinstance(x, int) or x < 1:
                raise ValueError(f"{name} must be a positive int, got {x!r}")
        n_heads = n_kv_heads if n_heads is None else n_heads
        if not isinstance(n_heads, int) or n_heads < 1 or n_heads % n_kv_heads:
            raise ValueError(f"n_heads must be a positive multiple of n_kv_heads ({n_kv_heads}), got {n_heads!r}")
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype must be torch.float32 or torch.float64 (keys are updated in place), got {dtype}")
        self.batch, self.n_kv_heads, self.n_heads = batch, n_kv_heads, n_heads
        self.max_len, self.head_dim, self.value_dim = max_len, head_dim, value_dim
        self.k = torch.zeros(batch, n_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(batch, n_kv_heads, max_len, value_dim, dtype=value_dtype or dtype, device=device)
        self.G = torch.zeros(batch, n_heads, max_len, dtype=torch.float64, device=device)  # cumsum of g
        self.length = 0
        pow2 = lambda x: x >= 1 and (x & (x - 1)) == 0  # noqa: E731
        fusable = dtype == torch.float32 and pow2(n_heads // n_kv_heads) and all(
            pow2(x) and x >= 16 for x in (head_dim, value_dim))
        if use_triton and not fusable:
            raise ValueError("use_triton=True needs fp32 keys, head dims in {16, 32, 64, 128} and a power-of-two "
                             "group size n_heads / n_kv_heads")
        self.use_triton = fusable and (self.k.device.type == "cuda" if use_triton is None else bool(use_triton))

    def __len__(self):
        return self.length

    def reset(self):
        self.length = 0

    def _check(self, q, k, v, w, beta, g, T=None):
        B, Hkv, D, Dv, H = self.batch, self.n_kv_heads, self.head_dim, self.value_dim, self.n_heads
        T = q.shape[1] if T is None else T
        want = {"q": (B, T, H, D), "k": (B, T, Hkv, D), "v": (B, T, Hkv, Dv), "w": (B, T, Hkv, D), "beta": (B, T, Hkv)}
        for name, t in (("q", q), ("k", k), ("v", v), ("w", w), ("beta", beta)) + ((("g", g),) if g is not None else ()):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.device != self.k.device:
                raise ValueError(f"{name} is on {t.device} but the cache is on {self.k.device}")
        if g is not None:
            want["g"] = (B, T, H)
        for name, t in (("q", q), ("k", k), ("v", v), ("w", w), ("beta", beta), ("g", g)):
            if t is not None and tuple(t.shape) != want[name]:
                raise ValueError(f"{name} must have shape {want[name]}, got {tuple(t.shape)}")
        if self.length + T > self.max_len:
            raise ValueError(f"cache full: {self.length} + {T} tokens exceed max_len={self.max_len}")

    def prefill(self, q, k, v, w, beta, g=None, *, scale=None):
        """Run the prompt in parallel form and cache its keys carried to the prompt end. Returns o ``[B, T, H, Dv]``.

        The output comes from :func:`pathlab.path_attention` (Triton on CUDA, blockwise PyTorch elsewhere).
        """
        import pathlab

        if self.length:
            raise ValueError("prefill needs an empty cache; call reset() first")
        self._check(q, k, v, w, beta, g)
        T = q.shape[1]
        o = pathlab.path_attention(q, k, v, w, beta, g, scale=scale)
        kd = self.k.dtype
        self.k[:, :, :T] = carry_keys_to_end(k.to(kd), _normalize(w).to(kd), beta.to(kd))
        self.v[:, :, :T] = v.transpose(1, 2).to(self.v.dtype)
        if g is not None:
            self.G[:, :, :T] = torch.cumsum(g.to(torch.float64), dim=1).transpose(1, 2)
        self.length = T
        return o

    @torch.no_grad()
    def step(self, q, k, v, w, beta, g=None, *, scale=None):
        """One new token (``[B, 1, ...]`` inputs): apply its H_t to every cached key, append k_t, attend.

        Returns o ``[B, 1, H, Dv]`` in q's dtype.
        """
        self._check(q, k, v, w, beta, g, T=1)
        B, Hkv, H, D = self.batch, self.n_kv_heads, self.n_heads, self.head_dim
        n = self.length
        kd = self.k.dtype
        scale = D ** -0.5 if scale is None else float(scale)
        wn = _normalize(w[:, 0]).to(kd)  # [B, Hkv, D]
        if self.use_triton:
            return self._step_triton(q, k, v, wn, beta, g, scale)
        if n:
            keys = self.k[:, :, :n].reshape(B * Hkv, n, D)  # a view into the cache
            coef = torch.bmm(keys, wn.reshape(B * Hkv, D, 1))  # k_jᵀ w_t           [B·Hkv, n, 1]
            keys.baddbmm_(coef, (-beta[:, 0].to(kd)[..., None] * wn).reshape(B * Hkv, 1, D))
        self.k[:, :, n] = k[:, 0].to(kd)
        self.v[:, :, n] = v[:, 0].to(self.v.dtype)
        if g is not None:
            prev = self.G[:, :, n - 1] if n else 0.0
            self.G[:, :, n] = prev + g[:, 0].to(torch.float64)
        self.length = n + 1
        return self.attend(q, scale=scale, gated=g is not None)

    def _step_triton(self, q, k, v, wn, beta, g, scale):
        from pathlab.kernels.decode import decode_step_triton

        n = self.length
        self.k[:, :, n] = k[:, 0].to(self.k.dtype)
        self.v[:, :, n] = v[:, 0].to(self.v.dtype)
        gate_t = None
        if g is not None:
            prev = self.G[:, :, n - 1] if n else 0.0
            self.G[:, :, n] = prev + g[:, 0].to(torch.float64)
            gate_t = self.G[:, :, n]
        o = decode_step_triton(self.k, self.v, self.G if g is not None else None, q[:, 0], wn,
                               beta[:, 0].float(), gate_t, n, scale)
        self.length = n + 1
        return o[:, None].to(q.dtype)

    def attend(self, q, *, scale, gated):
        """Softmax attention of q ``[B, 1, H, D]`` over the cached (already carried) keys."""
        B, Hkv, H, D = self.batch, self.n_kv_heads, self.n_heads, self.head_dim
        n, kd = self.length, self.k.dtype
        qg = q[:, 0].to(kd).reshape(B, Hkv, H // Hkv, D)
        logits = (qg @ self.k[:, :, :n].transpose(-1, -2)) * scale  # [B, Hkv, G, n]
        if gated:
            G = self.G[:, :, :n]
            gate = (G[:, :, -1:] - G).to(kd).reshape(B, Hkv, H // Hkv, n)
            logits = logits + gate
        probs = torch.softmax(logits.float(), dim=-1)
        o = probs.to(self.v.dtype) @ self.v[:, :, :n]  # [B, Hkv, G, Dv]
        return o.reshape(B, 1, H, self.value_dim).to(q.dtype)
