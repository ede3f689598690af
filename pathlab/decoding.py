"""Generation cache for PaTH and PaTH-FoX: keys carried to a base step, transitions of recent steps deferred.

Scores: s_ij = scale · q_iᵀ H_i ⋯ H_{j+1} k_j + (G_i − G_j) for j ≤ i (the query's own H_i applies to every key
j < i, not to k_i), with H_t = I − β_t w_t w_tᵀ (symmetric).

Deferred step (``defer=R ≥ 1``, default R = 32). The cache holds a base step τ and

* the keys carried to τ, K_j^(τ) = H_τ ⋯ H_{j+1} k_j for j ≤ τ, as an fp32 master copy (never re-rounded) and a
  low-precision shadow of it (fp16 by default on the Triton path) that the attention reads;
* the pending product M = H_{τ+1} ⋯ H_i (D×D per batch and kv head; I when nothing is pending);
* the r ≤ R recent keys carried to the current step, Rk_j = H_i ⋯ H_{j+1} k_j for τ < j ≤ i.

A step i updates M ← M H_i = M − β_i (M w_i) w_iᵀ (O(D²)) and Rk_j ← Rk_j − β_i (Rk_jᵀ w_i) w_iᵀ for j < i (O(R·D)),
appends k_i, and attends: the base keys score with the carried query q_τ = M q_i, because H is symmetric,
q_iᵀ H_i ⋯ H_{τ+1} K_j^(τ) = (H_{τ+1} ⋯ H_i q_i)ᵀ K_j^(τ); the recent keys score with q_i · Rk_j; one softmax over
both. When r reaches R the step folds: K_j^(i) = H_i ⋯ H_{τ+1} K_j^(τ) = Mᵀ K_j^(τ), i.e. rows K ← K M (one batched
fp32 product, no TF32), the Rk rows are appended to the master, the shadow is rewritten, M = I and τ = i.
Bytes per cached element and step: the shadow key and the value (4 with fp16 keys and bf16 values, as plain
decoding) plus 10/R for the fold (fp32 read and write, shadow write).

Immediate step (``defer=0``): every step applies H_i to every cached fp32 key in place,
k_j ← k_j − β_i (k_jᵀ w_i) w_i, appends k_i and attends over the keys as they are (10 bytes per element and step).

Precision.

* Shadow: one rounding of the fp32 master, rewritten at every fold, so it does not accumulate. fp16 has a
  relative error ≤ 2⁻¹¹ per key element (absolute ≤ 2⁻²⁵ below 6·10⁻⁵; bf16, as plain decoding's keys: 2⁻⁸);
  a score moves by at most scale · 2⁻¹¹ · Σ_d |q_τ,d K_j,d| ≤ scale · 2⁻¹¹ · ‖q_i‖ ‖k_j‖ (‖H‖ ≤ 1, so
  ‖q_τ‖ ≤ ‖q_i‖ and ‖K_j‖ ≤ ‖k_j‖).
  fp16 overflows above 65504: keys that large need ``shadow_dtype=torch.bfloat16`` (or None). ``None`` scores
  from the master directly (what fp64 caches do).
* Master (fp32 or fp64): each fold is one length-D dot product per element with M, whose error is that of a
  product of ≤ R factors built by rank-1 updates in the cache precision, ≲ R · c · ε. All factors have norm ≤ 1,
  so errors add at most linearly over the folds: after n steps the relative key error is
  ≲ (n · c + (n / R) · D) · ε with ε ≈ 6e-8 in fp32, and about √(n / R) · √D · ε in practice (random rounding).
  The recent keys see the same ≤ R rank-1 updates as M.
* q_τ = M q_i: one product with M per step, error ≲ (R · c + D) · ε relative, not accumulated.
* The gate sums G are kept in fp64.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

SHADOW_DTYPES = (torch.float16, torch.bfloat16)


def _normalize(w):
    return F.normalize(w.to(torch.promote_types(w.dtype, torch.float32)), dim=-1)


@contextlib.contextmanager
def _full_fp32(device):
    """fp32 matrix products without TF32 on CUDA, whatever ``torch.set_float32_matmul_precision`` says."""
    if device.type != "cuda" or torch.get_float32_matmul_precision() == "highest":
        yield
        return
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


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
    """Per-layer generation cache for PaTH / PaTH-FoX (see the module docstring for the algorithm).

    Args:
        batch, n_kv_heads, max_len, head_dim, value_dim: sizes of the preallocated cache.
        n_heads: query heads (a multiple of ``n_kv_heads``; default equal). Query head h reads kv head
            h // (n_heads / n_kv_heads).
        dtype: precision of the master keys, of M and of the recent keys; fp32 by default (fp64 for exact tests).
        value_dtype: value cache dtype (default ``dtype``; bf16 halves the value traffic of a step).
        defer: R, the number of steps whose transitions are deferred before they are folded into the master
            keys (default 32; any R ≥ 1 gives the same result up to rounding; R = 1 folds at every step).
            0 = the immediate step: H_t is applied to every cached key in place at every step (10 bytes per
            element and step).
        shadow_dtype: precision of the copy of the base keys that the attention reads: ``torch.float16`` or
            ``torch.bfloat16``; None = score from the master directly. "auto" (default) = fp16 when the step runs
            in Triton (fp32 keys on CUDA), None otherwise (the PyTorch step would only upcast it again).
            Needs ``defer ≥ 1``.
        use_triton: run :meth:`step` as Triton kernels (:mod:`pathlab.kernels.decode`: three launches per step,
            one more every R steps for the fold; the fused update-and-attend kernel when ``defer=0``). None = on
            CUDA when the shapes allow it (fp32 keys, power-of-two head dims ≥ 16 and group size); False = plain
            PyTorch ops (what the CPU always uses).
        cuda_graph: capture the deferred Triton step (prep, attend, merge) in a ``torch.cuda.CUDAGraph`` and replay
            it at every step (default False). Needs CUDA, the Triton path and ``defer ≥ 1``. The first step with a
            given input signature (gated or not, scale, input dtypes) runs eagerly on a side stream (it compiles
            the kernels, and it is a real step) and captures the graph; each later :meth:`step` copies its inputs
            into the graph's static buffers (skipped for an input that *is* the static buffer, see
            :meth:`graph_inputs`), replays it and returns a clone of the static output. The fold (every R steps)
            runs eagerly between replays. The step's counters live on the device, so the one graph is right at
            every position; :meth:`reset` and :meth:`prefill` keep it valid.
        kernel_config: a :class:`pathlab.kernels.KernelConfig` for the Triton step's attention launch
            (``decode_attend``, ``decode_native``; benchmarks and tests); None: chosen by the code.

    ``w`` passed to :meth:`prefill` and :meth:`step` is the raw direction: it is normalised here in fp32.
    """

    def __init__(self, batch, n_kv_heads, max_len, head_dim, value_dim, *, n_heads=None, device=None,
                 dtype=torch.float32, value_dtype=None, use_triton=None, defer=32, shadow_dtype="auto",
                 cuda_graph=False, kernel_config=None):
        for name, x in (("batch", batch), ("n_kv_heads", n_kv_heads), ("max_len", max_len),
                        ("head_dim", head_dim), ("value_dim", value_dim)):
            if not isinstance(x, int) or x < 1:
                raise ValueError(f"{name} must be a positive int, got {x!r}")
        n_heads = n_kv_heads if n_heads is None else n_heads
        if not isinstance(n_heads, int) or n_heads < 1 or n_heads % n_kv_heads:
            raise ValueError(f"n_heads must be a positive multiple of n_kv_heads ({n_kv_heads}), got {n_heads!r}")
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype must be torch.float32 or torch.float64 (keys are updated in place), got {dtype}")
        if isinstance(defer, bool) or not isinstance(defer, int) or defer < 0:
            raise ValueError(f"defer must be an int ≥ 0 (0 = immediate update, R ≥ 1 = fold every R steps), "
                             f"got {defer!r}")
        if not (shadow_dtype is None or (isinstance(shadow_dtype, str) and shadow_dtype == "auto")
                or shadow_dtype in SHADOW_DTYPES):
            raise ValueError(f"shadow_dtype must be 'auto', None, torch.float16 or torch.bfloat16, "
                             f"got {shadow_dtype!r}")
        if defer == 0 and shadow_dtype not in ("auto", None):
            raise ValueError("shadow_dtype needs defer ≥ 1: the immediate step (defer=0) rewrites every key "
                             "at every step and scores the fp32 keys")
        self.batch, self.n_kv_heads, self.n_heads = batch, n_kv_heads, n_heads
        self.max_len, self.head_dim, self.value_dim = max_len, head_dim, value_dim
        self.defer = defer
        self.k = torch.zeros(batch, n_kv_heads, max_len, head_dim, dtype=dtype, device=device)  # master keys
        self.v = torch.zeros(batch, n_kv_heads, max_len, value_dim, dtype=value_dtype or dtype, device=device)
        self.G = torch.zeros(batch, n_heads, max_len, dtype=torch.float64, device=device)  # cumsum of g
        self.length = 0  # cached tokens
        self.base = 0  # tokens folded into the master keys (τ + 1 in 0-based positions)
        pow2 = lambda x: x >= 1 and (x & (x - 1)) == 0  # noqa: E731
        fusable = dtype == torch.float32 and pow2(n_heads // n_kv_heads) and all(
            pow2(x) and x >= 16 for x in (head_dim, value_dim))
        if use_triton and not fusable:
            raise ValueError("use_triton=True needs fp32 keys, head dims in {16, 32, 64, 128} and a power-of-two "
                             "group size n_heads / n_kv_heads")
        self.use_triton = fusable and (self.k.device.type == "cuda" if use_triton is None else bool(use_triton))
        if isinstance(shadow_dtype, str):  # "auto"
            shadow_dtype = torch.float16 if defer and self.use_triton else None
        self.shadow_dtype = shadow_dtype
        self.k_shadow = (None if shadow_dtype is None else
                         torch.zeros(batch, n_kv_heads, max_len, head_dim, dtype=shadow_dtype, device=device))
        self.M = self.rk = self._ws = None
        if defer:
            self._eye = torch.eye(head_dim, dtype=dtype, device=device)
            self.M = self._eye.repeat(batch, n_kv_heads, 1, 1)  # H_{τ+1} ⋯ H_i (its own memory)
            self.rk = torch.zeros(batch, n_kv_heads, defer, head_dim, dtype=dtype, device=device)
            if self.use_triton:
                from pathlab.kernels.decode import DeferredWorkspace

                self._ws = DeferredWorkspace(batch, n_kv_heads, n_heads // n_kv_heads, head_dim, value_dim,
                                             max_len, defer, self.k.device, kernel_config)
        if cuda_graph:
            if self.k.device.type != "cuda":
                raise ValueError(f"cuda_graph=True needs a CUDA device; the cache is on {self.k.device}")
            if not (defer and self.use_triton):
                raise ValueError("cuda_graph=True needs the deferred Triton step: defer ≥ 1 and use_triton "
                                 "(fp32 keys, head dims in {16, 32, 64, 128}, a power-of-two group size)")
        self.cuda_graph = bool(cuda_graph)
        self._graphs = {}  # input signature → _StepGraph

    def __len__(self):
        return self.length

    @property
    def pending(self):
        """Tokens whose transitions are not folded into the master keys yet (r; always 0 when ``defer=0``)."""
        return self.length - self.base

    def reset(self):
        self.length = self.base = 0
        if self.M is not None:
            self._reset_m()
        if self._ws is not None:
            self._ws.set_pos(0, 0)

    def _reset_m(self):
        self.M.copy_(self._eye)  # broadcast over batch and heads

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

        The output comes from :func:`pathlab.path_attention` (Triton on CUDA, blockwise PyTorch elsewhere). The
        prompt's keys become the base keys (τ = the last prompt token) and fill the shadow.
        """
        import pathlab

        if self.length:
            raise ValueError("prefill needs an empty cache; call reset() first")
        self._check(q, k, v, w, beta, g)
        T = q.shape[1]
        o = pathlab.path_attention(q, k, v, w, beta, g, scale=scale)
        kd = self.k.dtype
        with _full_fp32(self.k.device):
            self.k[:, :, :T] = carry_keys_to_end(k.to(kd), _normalize(w).to(kd), beta.to(kd))
        if self.k_shadow is not None:
            self.k_shadow[:, :, :T] = self.k[:, :, :T]
        self.v[:, :, :T] = v.transpose(1, 2).to(self.v.dtype)
        if g is not None:
            self.G[:, :, :T] = torch.cumsum(g.to(torch.float64), dim=1).transpose(1, 2)
        self.length = self.base = T
        if self._ws is not None:
            self._ws.set_pos(T, T)
        return o

    @torch.no_grad()
    def step(self, q, k, v, w, beta, g=None, *, scale=None):
        """One new token (``[B, 1, ...]`` inputs): carry the cache by its H_t (deferred or in place), append k_t,
        attend. Returns o ``[B, 1, H, Dv]`` in q's dtype.
        """
        self._check(q, k, v, w, beta, g, T=1)
        scale = self.head_dim ** -0.5 if scale is None else float(scale)
        if self.defer and self.use_triton:
            return self._step_deferred_triton(q, k, v, w, beta, g, scale)
        wn = _normalize(w[:, 0]).to(self.k.dtype)  # [B, Hkv, D]
        if self.use_triton:
            return self._step_immediate_triton(q, k, v, wn, beta, g, scale)
        with _full_fp32(self.k.device):
            if self.defer:
                return self._step_deferred_torch(q, k, v, wn, beta, g, scale)
            return self._step_immediate_torch(q, k, v, wn, beta, g, scale)

    def _append(self, v, g, n):
        self.v[:, :, n] = v[:, 0].to(self.v.dtype)
        if g is not None:
            prev = self.G[:, :, n - 1] if n else 0.0
            self.G[:, :, n] = prev + g[:, 0].to(torch.float64)

    def _step_deferred_torch(self, q, k, v, wn, beta, g, scale):
        n, r = self.length, self.pending
        kd = self.k.dtype
        w_col = wn[..., None]  # [B, Hkv, D, 1]
        bw_row = (beta[:, 0].to(kd)[..., None] * wn)[..., None, :]  # β w as a row   [B, Hkv, 1, D]
        self.M -= (self.M @ w_col) @ bw_row  # M ← M H_n
        if r:
            rk = self.rk[:, :, :r]  # a view: rows Rk_j ← Rk_j H_n
            rk -= (rk @ w_col) @ bw_row
        self.rk[:, :, r] = k[:, 0].to(kd)
        self._append(v, g, n)
        self.length = n + 1
        o = self.attend(q, scale=scale, gated=g is not None)
        if self.pending == self.defer:
            self._fold()
        return o

    def _step_deferred_triton(self, q, k, v, w, beta, g, scale):
        if self.cuda_graph:
            o = self._replay(q, k, v, w, beta, g, scale)
        else:
            o = self._launch_step(q, k, v, w, beta, g, scale)
        self.length += 1
        if self.pending == self.defer:
            self._fold()
        return o

    def _launch_step(self, q, k, v, w, beta, g, scale):
        """The three step kernels; the position comes from the device counters, which the merge advances."""
        from pathlab.kernels.decode import deferred_step_triton

        keys = self.k_shadow if self.k_shadow is not None else self.k
        return deferred_step_triton(self._ws, keys, self.v, self.G if g is not None else None, self.M, self.rk,
                                    q, k, v, w, beta, g, scale)

    @staticmethod
    def _signature(q, k, v, w, beta, g, scale):
        return (g is not None, scale) + tuple(t.dtype for t in (q, k, v, w, beta, g) if t is not None)

    def graph_inputs(self, q, k, v, w, beta, g=None, *, scale=None):
        """The static input buffers (q, k, v, w, beta, g or None) of the graph for inputs like these, captured by
        the first step with them; None before that. Writing a step's inputs into them and passing them to
        :meth:`step` skips the copies."""
        scale = self.head_dim ** -0.5 if scale is None else float(scale)
        graph = self._graphs.get(self._signature(q, k, v, w, beta, g, scale))
        return None if graph is None else graph.inputs

    def _replay(self, q, k, v, w, beta, g, scale):
        key = self._signature(q, k, v, w, beta, g, scale)
        graph = self._graphs.get(key)
        if graph is None:  # first step of this signature: run it eagerly (a real step), then capture
            graph = self._graphs[key] = _StepGraph(self, (q, k, v, w, beta, g), scale)
            return graph.first_output
        for static, x in zip(graph.inputs, (q, k, v, w, beta, g)):
            if x is not None and x is not static:
                static.copy_(x)
        graph.graph.replay()
        return graph.output.clone()

    def _fold(self):
        """Carry the base keys to the current step (rows K ← K M), append the pending keys, refresh the shadow."""
        base, n = self.base, self.length
        if self.use_triton:
            from pathlab.kernels.decode import fold_triton

            fold_triton(self._ws, self.k, self.k_shadow, self.M, self.rk, n, base)
        else:
            with _full_fp32(self.k.device):
                if base:
                    self.k[:, :, :base] = self.k[:, :, :base] @ self.M
            self.k[:, :, base:n] = self.rk[:, :, :n - base]
            if self.k_shadow is not None:
                self.k_shadow[:, :, :n] = self.k[:, :, :n]
        self._reset_m()
        self.base = n

    def _step_immediate_torch(self, q, k, v, wn, beta, g, scale):
        B, Hkv, D = self.batch, self.n_kv_heads, self.head_dim
        n, kd = self.length, self.k.dtype
        if n:
            keys = self.k[:, :, :n].reshape(B * Hkv, n, D)  # a view into the cache
            coef = torch.bmm(keys, wn.reshape(B * Hkv, D, 1))  # k_jᵀ w_t           [B·Hkv, n, 1]
            keys.baddbmm_(coef, (-beta[:, 0].to(kd)[..., None] * wn).reshape(B * Hkv, 1, D))
        self.k[:, :, n] = k[:, 0].to(kd)
        self._append(v, g, n)
        self.length = self.base = n + 1
        return self.attend(q, scale=scale, gated=g is not None)

    def _step_immediate_triton(self, q, k, v, wn, beta, g, scale):
        from pathlab.kernels.decode import decode_step_triton

        n = self.length
        self.k[:, :, n] = k[:, 0].to(self.k.dtype)
        self._append(v, g, n)
        gate_t = self.G[:, :, n] if g is not None else None
        o = decode_step_triton(self.k, self.v, self.G if g is not None else None, q[:, 0], wn,
                               beta[:, 0].float(), gate_t, n, scale)
        self.length = self.base = n + 1
        return o[:, None].to(q.dtype)

    def carried_keys(self):
        """All cached keys carried to the last token, H_i ⋯ H_{j+1} k_j, ``[B, Hkv, length, D]`` (master precision;
        computed, the cache is left as it is)."""
        base, r = self.base, self.pending
        with _full_fp32(self.k.device):
            old = self.k[:, :, :base] @ self.M if r else self.k[:, :, :base]
        return torch.cat([old, self.rk[:, :, :r]], 2) if r else old.clone()

    def attend(self, q, *, scale, gated):
        """Softmax attention of q ``[B, 1, H, D]`` (the query of the last cached token) over the cache.

        The base keys score with q_τ = M q (the shadow when there is one, else the master), the pending keys with
        q itself; one softmax over both. PyTorch ops in the master precision.
        """
        B, Hkv, H, D = self.batch, self.n_kv_heads, self.n_heads, self.head_dim
        n, base, r, kd = self.length, self.base, self.pending, self.k.dtype
        qg = q[:, 0].to(kd).reshape(B, Hkv, H // Hkv, D)
        keys = self.k_shadow[:, :, :base].to(kd) if self.k_shadow is not None else self.k[:, :, :base]
        q_base = qg @ self.M.transpose(-1, -2) if r else qg  # rows q_τᵀ = (M q)ᵀ
        logits = q_base @ keys.transpose(-1, -2)  # [B, Hkv, G, base]
        if r:
            logits = torch.cat([logits, qg @ self.rk[:, :, :r].transpose(-1, -2)], -1)  # [B, Hkv, G, n]
        logits = logits * scale
        if gated:
            G = self.G[:, :, :n]
            gate = (G[:, :, -1:] - G).to(kd).reshape(B, Hkv, H // Hkv, n)
            logits = logits + gate
        probs = torch.softmax(logits, dim=-1)
        o = probs @ self.v[:, :, :n].to(kd)  # [B, Hkv, G, Dv]
        return o.reshape(B, 1, H, self.value_dim).to(q.dtype)


class _StepGraph:
    """One captured deferred Triton step of a :class:`PathDecodeCache` (``cuda_graph=True``).

    Built at the first step with a given input signature: the inputs are copied into static buffers, the step runs
    eagerly from them on a side stream (it is that step's real computation, and it compiles the kernels for
    exactly these buffers, so nothing compiles during the capture), then the same launches are captured. Capturing
    runs nothing, so the cache's state is that of one step. The graph reads and writes the cache's tensors in place
    (their addresses never change) and its counters on the device, so replaying it is the next step wherever the
    cache stands.
    """

    def __init__(self, cache, inputs, scale):
        self.inputs = tuple(None if x is None else x.clone(memory_format=torch.contiguous_format) for x in inputs)
        current = torch.cuda.current_stream(cache.k.device)
        side = torch.cuda.Stream(cache.k.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            o = cache._launch_step(*self.inputs, scale)
        current.wait_stream(side)
        o.record_stream(current)
        self.first_output = o
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = cache._launch_step(*self.inputs, scale)
