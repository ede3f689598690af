"""Streamed attention logits of a trained layer for sampled queries: never a T×T matrix.

For a set of sampled query positions of one window, the logits s_ij of every key j ≤ i are produced in key chunks
(O(T·D) memory per query) and folded into running accumulators:

* per distance bin n = i − j (one fixed grid, :func:`distance_bin_edges`): count, Σ s, Σ s², log Σ e^s → μ(n), σ(n), log m(n) = log E e^s (M3);
* per query and near-set width W (one W per head: N = {j : i − j < W_h}, F = {j : i − j ≥ W_h}): log Z_N, log Z_F, log Σ_F e^{2s}, max|s| = λ, max/mean near score and mean
  far score → ρ_D, Γ, Δ^max, Δ^mean, M_eff and the M5 bound (M4, M5);
* per query, for the first W: Σ_F e^s ṽ_j, Σ_N e^s ṽ_j and Σ_F e^s P_{j→i} b̂ (ṽ = transported values for Q/K/V
  rotations) → the coherence ratio κ and ‖o_F‖/‖o_N‖ (M6);
* for rotation models and PaTH, Σ s·s⁰ and Σ (s⁰)² per bin with s⁰ = q_i·k_j/√D the same logit without its
  transport (no rotation; no Householder product and no gate for PaTH / PaTH-FoX) → ρ_s(n) (M2). For PaTH-FoX, s
  is the full logit, gate included, as in every other statistic of the gated variants, so its ρ_s also carries
  the gate's correlation with s⁰.

Logits of a layer come from its variant's :meth:`~pathlab.attention.base.PositionalAttention.score_terms`
(:class:`~pathlab.attention.base.ScoreTerms`; scale = 1/√D, gates and biases unscaled, as in
:mod:`pathlab.reference`): q·k/√D, with q and k rotated by R(−Φ_t) when the terms have phases (RoPE, accumulated
rotations), plus G_i − G_j with a gate (FoX, gated rotations, PaTH-FoX) and − m_h (i − j) with slopes (ALiBi); with a
Householder transport (PaTH) q_iᵀ H_i ⋯ H_{j+1} k_j, computed by carrying the sampled queries leftwards one key at a
time.

Everything runs in fp64 on the device of the layer's tensors (a GPU when the model is on one, the CPU otherwise):
the work is O(L·m·H·D) per layer and window, best done where q, k, v already are, without copying them. Only the
results (:meth:`ScoreAccumulator.per_query`, :meth:`ScoreAccumulator.per_bin`) come back, as numpy arrays.
Inside the key-chunk loop nothing waits on the device (no ``.item()``, no ``if tensor.any()``): which chunks
hold valid keys is known on the host from the sampled positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from pathlab._checks import expand_kv_heads
from pathlab.ops.positions import rotate

F64 = torch.float64


def distance_bin_edges(max_distance: int, per_decade: int = 12) -> np.ndarray:
    """Integer bin edges for distances 0 … ``max_distance``: bin k holds distances [edge_k, edge_{k+1}).

    One fixed grid, the same at every context length: 0, 1, …, 8 (one distance per bin), then the distinct values
    round(10^{k/p}) > 8 for k = 0, 1, 2, … (p = ``per_decade``, anchored at 10^0 so that 10, 100, 1000, … are
    edges), truncated to the edges ≤ ``max_distance`` and closed by max_distance + 1. Bin k therefore covers the
    same distances at L = 512 and at L = 65,536 (only the last, truncated bin differs), so curves measured at
    different lengths compare bin by bin on their common range; a grid spread between 9 and L would move every
    edge with L.
    """
    if max_distance < 0:
        raise ValueError(f"max_distance must be ≥ 0, got {max_distance}")
    top = max(1, math.ceil(per_decade * math.log10(max_distance + 1)) + 1)
    grid = np.round(10.0 ** (np.arange(top + 1) / per_decade)).astype(np.int64)
    grid = np.concatenate([np.arange(0, 9), grid[grid > 8]])
    return np.unique(np.concatenate([grid[grid <= max_distance], [max_distance + 1]]))


def default_chunk(device, rows: int) -> int:
    """Keys per chunk for ``rows`` = m·H query rows: 1024 on the CPU; on a GPU the largest power of two C ≥ 1024
    with rows·C ≤ 2²³, i.e. 64 MiB per ``[m, H, C]`` fp64 block (the accumulator holds a few tens of them at once),
    so that a 65K-token window takes a handful of chunks instead of 64 small ones."""
    if torch.device(device).type == "cpu":
        return 1024
    return max(1024, 1 << int(math.log2(max(1, (1 << 23) // max(rows, 1)))))


# ----------------------------------------------------------------------------------------------------------------
# per-variant logits


@dataclass
class PreparedLayer:
    """One window's layer inputs turned into what the logits need (all fp64 on the layer's device, heads expanded,
    ``[T, H, D]``)."""

    kind: str  # "path" (Householder transport: PaTH) or "dot" (every other variant)
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor  # values as summed: transported ṽ_j = R(−Φ_j) v_j for Q/K/V rotations, else v_j
    scale: float
    phase: torch.Tensor | None = None  # [T, H, D/2] Φ_t for rotations/RoPE (q, k here are already pre-rotated)
    q_raw: torch.Tensor | None = None  # unrotated q, k for ρ_s (PaTH: q, k themselves)
    k_raw: torch.Tensor | None = None
    rotate_values: bool = False
    slopes: torch.Tensor | None = None  # [H] ALiBi
    gate_sum: torch.Tensor | None = None  # [T, H] G_t for FoX / PaTH-FoX
    w: torch.Tensor | None = None  # [T, H, D] unit Householder directions (PaTH)
    beta: torch.Tensor | None = None  # [T, H]
    extra: dict = field(default_factory=dict)


def prepare_layer(module, q, k, v, x, idx, b: int, memo: dict | None = None) -> PreparedLayer:
    """Build the logit ingredients of window ``b`` from a positional module's inputs (``q [B, T, H, D]`` …).

    The module's own tensors (its :meth:`~pathlab.attention.base.PositionalAttention.score_terms`: phases,
    Householder directions, gates) are computed once for the whole batch, as in the model's forward, and kept in
    ``memo`` across the windows of a batch. Everything stays on q's device.
    """
    memo = {} if memo is None else memo
    dev = q.device
    H, D = q.shape[2], q.shape[3]
    scale = D ** -0.5
    qb = q[b].to(dev, F64)
    kb = expand_kv_heads(k, H)[b].to(dev, F64)
    vb = expand_kv_heads(v, H)[b].to(dev, F64)
    if "terms" not in memo:
        memo["terms"] = module.score_terms(x, idx)  # whole batch: identical rounding to the model's own forward
    terms = memo["terms"]
    if terms.householder is not None and terms.phase is not None:
        raise ValueError(f"{type(module).__name__}.score_terms: a Householder transport and phases together are "
                         "not supported by the streamed logits")
    gate = torch.cumsum(terms.log_gate[b].to(dev, F64), 0) if terms.log_gate is not None else None  # [T, H] G_t
    slopes = terms.slopes.to(dev, F64) if terms.slopes is not None else None
    raw = dict(q_raw=qb, k_raw=kb) if terms.transported else {}  # s⁰ = q·k/√D without the transport, for ρ_s
    if terms.householder is not None:
        w, beta = terms.householder
        w = expand_kv_heads(w, H)[b].to(dev, F64)
        beta = expand_kv_heads(beta, H)[b].to(dev, F64)
        return PreparedLayer("path", qb, kb, vb, scale, w=w, beta=beta, gate_sum=gate, slopes=slopes, **raw)
    if terms.phase is None:
        return PreparedLayer("dot", qb, kb, vb, scale, slopes=slopes, gate_sum=gate, **raw)
    phase = terms.phase[b].to(dev)  # [T, H, D/2]
    rot_v = terms.rotate_values
    return PreparedLayer("dot", rotate(qb, -phase), rotate(kb, -phase), rotate(vb, -phase) if rot_v else vb, scale,
                         phase=phase, rotate_values=rot_v, slopes=slopes, gate_sum=gate, **raw)


def iter_logit_chunks(layer: PreparedLayer, positions: torch.Tensor, chunk: int | None = None, ut_chunk: int = 64):
    """Yield ``(j0, logits [m, H, C], raw [m, H, C] or None)`` for keys j0 … j0 + C − 1, fp64 on the layer's
    device, −inf where j > i.

    ``positions [m]``: sampled query positions (any device; read once on the host). ``raw`` is s⁰, the logit with
    the transport removed, for ρ_s (M2): q_i·k_j/√D for rotation models and PaTH, None for the others (their
    logit has no transport). For FoX-gated PaTH, ``logits`` include the gate G_i − G_j and ``raw`` does not.
    ``raw`` is not masked: only the pairs j ≤ i are ever used. ``chunk``: keys per chunk (None:
    :func:`default_chunk`); ``ut_chunk``: PaTH's UT chunk size left of the earliest query.
    """
    host = positions.detach().to("cpu", torch.long)
    dev = layer.q.device
    pos = host.to(dev)
    chunk = chunk or default_chunk(dev, host.numel() * layer.q.shape[1])
    if layer.kind == "path":
        yield from _path_logit_chunks(layer, host, chunk, ut_chunk)
        return
    last = int(host.max()) + 1
    qs = layer.q[pos]  # [m, H, D]
    q0 = layer.q_raw[pos] if layer.q_raw is not None else None
    g_q = layer.gate_sum[pos][:, :, None] if layer.gate_sum is not None else None  # [m, H, 1]
    for j0 in range(0, last, chunk):
        j1 = min(j0 + chunk, last)
        s = torch.einsum("mhd,chd->mhc", qs, layer.k[j0:j1]) * layer.scale
        dist = pos[:, None] - torch.arange(j0, j1, device=dev)[None, :]  # [m, C]
        if layer.slopes is not None:
            s = s - layer.slopes[None, :, None] * dist[:, None, :].to(F64)
        if g_q is not None:
            s = s + g_q - layer.gate_sum[j0:j1].T[None]
        s = s.masked_fill((dist < 0)[:, None, :], -math.inf)
        raw = None
        if q0 is not None:
            raw = torch.einsum("mhd,chd->mhc", q0, layer.k_raw[j0:j1]) * layer.scale
        yield j0, s, raw


def _path_logit_chunks(layer: PreparedLayer, host: torch.Tensor, chunk: int, ut_chunk: int = 64):
    """PaTH logits of sampled queries (host positions ``host [m]``), right to left, with s⁰ = q_i·k_j/√D as raw.

    Keys at or after the earliest query (at most the sampling span): carry the queries one key at a time,
    u ← H_j u after using key j (H is symmetric), starting at u = q_i; a query not yet started carries u = 0,
    which H keeps at 0, and its columns are masked afterwards. Keys before it: every query is carried, so chunks of
    C = ``ut_chunk`` keys use the UT form (docs/kernels.md, "How it works"): with rows W, D = diag(β),
    A = (I + strictLower(D W Wᵀ))⁻¹ and U = A D W, the chunk's keys carried to its right edge are
    K̃ = K − (A D strictLower(W Kᵀ))ᵀ W, the logits are u·K̃, and the queries cross the chunk as u ← u − (u Wᵀ) U.
    K̃ and U do not depend on u, so they are computed for all the UT chunks of one yielded block at once (one
    batched triangular solve); only the two products that move u are sequential. The leftmost UT chunk is padded
    on the left with w = 0, β = 0 (H = I) and k = 0, whose columns are dropped.
    """
    dev = layer.q.device
    pos = host.to(dev)
    last, first = int(host.max()) + 1, int(host.min())
    m, H, D = host.shape[0], layer.q.shape[1], layer.q.shape[2]
    q0 = layer.q[pos]  # [m, H, D]
    g_q = layer.gate_sum[pos][:, :, None] if layer.gate_sum is not None else None

    def gated(cols, c_start, c_end):  # the additive terms: distance bias and gate sums
        if layer.slopes is not None:
            dist = pos[:, None] - torch.arange(c_start, c_end, device=dev)[None, :]  # [m, C]
            cols = cols - layer.slopes[None, :, None] * dist[:, None, :].to(F64)
        return cols if g_q is None else cols + g_q - layer.gate_sum[c_start:c_end].T[None]

    def raw(c_start, c_end):
        return torch.einsum("mhd,chd->mhc", q0, layer.k[c_start:c_end]) * layer.scale

    rows_at: dict[int, list[int]] = {}
    for r, t in enumerate(host.tolist()):
        rows_at.setdefault(t, []).append(r)
    starts = {t: torch.tensor(r, device=dev) for t, r in rows_at.items()}
    u = torch.zeros(m, H, D, dtype=F64, device=dev)
    for c_end in range(last, first, -chunk):  # sequential region [first, last)
        c_start = max(first, c_end - chunk)
        cols = []
        for t in range(c_end - 1, c_start - 1, -1):
            if t in starts:
                u[starts[t]] = layer.q[t]
            cols.append((u * layer.k[t]).sum(-1))
            wt = layer.w[t]  # [H, D]
            u = u - (layer.beta[t][None, :, None] * (u * wt).sum(-1, keepdim=True)) * wt
        s = torch.stack(cols[::-1], dim=-1) * layer.scale  # [m, H, C]
        ahead = pos[:, None] < torch.arange(c_start, c_end, device=dev)[None, :]
        yield c_start, gated(s.masked_fill(ahead[:, None, :], -math.inf), c_start, c_end), raw(c_start, c_end)

    if first == 0:
        return
    C = ut_chunk
    n_ut = -(-first // C)  # UT chunks, numbered from the right: chunk c covers [first − (c+1)C, first − cC)
    per_block = max(1, chunk // C)
    eye = torch.eye(C, dtype=F64, device=dev)
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=dev), diagonal=-1)
    for c0 in range(0, n_ut, per_block):  # UT region [0, first), one yielded block of ≤ per_block chunks at a time
        n = min(per_block, n_ut - c0)
        b_end, b_start = first - c0 * C, max(0, first - (c0 + n) * C)
        pad = n * C - (b_end - b_start)

        def blocks(t):  # [T, H, ...] -> [n, H, C, ...], zero-padded on the left
            x = t[b_start:b_end]
            if pad:
                x = torch.cat([x.new_zeros((pad,) + x.shape[1:]), x])
            return x.view(n, C, *x.shape[1:]).transpose(1, 2)

        W, K, beta = blocks(layer.w), blocks(layer.k), blocks(layer.beta)[..., None]  # [n, H, C, D], [n, H, C, 1]
        lower = eye + torch.where(strict, beta * (W @ W.transpose(-1, -2)), 0.0)
        X = torch.where(strict, W @ K.transpose(-1, -2), 0.0)  # X[s, r] = w_s·k_r, s > r
        M = torch.linalg.solve_triangular(lower, beta * X, upper=False, unitriangular=True)  # A D X
        K_carried = K - M.transpose(-1, -2) @ W  # [n, H, C, D]
        U = torch.linalg.solve_triangular(lower, beta * W, upper=False, unitriangular=True)  # A D W
        entering = [None] * n  # u at the right edge of each chunk of the block
        for i in range(n - 1, -1, -1):
            entering[i] = u
            u = u - torch.einsum("mhc,hcd->mhd", torch.einsum("mhd,hcd->mhc", u, W[i]), U[i])
        s = torch.einsum("nmhd,nhcd->mhnc", torch.stack(entering), K_carried).reshape(m, H, n * C)[..., pad:]
        yield b_start, gated(s * layer.scale, b_start, b_end), raw(b_start, b_end)


# ----------------------------------------------------------------------------------------------------------------
# accumulators


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


class ScoreAccumulator:
    """Running statistics of the logits of ``m`` sampled queries × H heads, fed one key chunk at a time.

    Every tensor lives on ``device`` (default: the CPU), fp64; :meth:`per_query` and :meth:`per_bin` return numpy.
    """

    def __init__(self, positions: torch.Tensor, n_head: int, edges: np.ndarray, windows, value_dim: int,
                 background: torch.Tensor | None = None, device=None):
        dev = torch.device("cpu") if device is None else torch.device(device)
        host = positions.detach().to("cpu", torch.long)
        self.last = int(host.max())  # chunks starting after it hold no valid key: known without a device sync
        self.positions = host.to(dev)
        m, H = self.positions.shape[0], n_head
        self.edges = torch.as_tensor(np.asarray(edges), dtype=torch.long, device=dev)
        nb = len(edges) - 1
        # windows: n_W entries, each an int or [H] per-head widths -> [n_W, H] long
        win = np.stack([np.broadcast_to(np.asarray(w, dtype=np.float64), (H,)) for w in windows])
        if not np.all(np.isfinite(win)) or np.any(win < 1):
            raise ValueError(f"near-set widths must be finite and ≥ 1, got {win.tolist()}")
        self.windows = torch.as_tensor(win, dtype=torch.long, device=dev)  # [n_W, H]
        self.H, self.m, self.device = H, m, dev
        z = lambda *s: torch.zeros(*s, dtype=F64, device=dev)  # noqa: E731
        self.bin_count, self.bin_sum, self.bin_sumsq = z(nb, H), z(nb, H), z(nb, H)
        self.bin_max = torch.full((nb, H), -math.inf, dtype=F64, device=dev)
        self.bin_sumexp = z(nb, H)  # Σ e^{s − bin_max}
        self.bin_cross, self.bin_raw_sq = z(nb, H), z(nb, H)  # Σ s·s⁰, Σ (s⁰)²
        self.has_raw = False
        self.run_max = torch.full((m, H), -math.inf, dtype=F64, device=dev)  # per query/head max logit so far
        nw = len(self.windows)
        self.zn, self.zf, self.zf2 = z(nw, m, H), z(nw, m, H), z(nw, m, H)  # scaled by e^{−max}, e^{−2 max}
        self.near_max = torch.full((nw, m, H), -math.inf, dtype=F64, device=dev)
        self.near_sum, self.near_cnt, self.far_sum, self.far_cnt = z(nw, m, H), z(nw, m, H), z(nw, m, H), z(nw, m, H)
        self.abs_max = z(m, H)
        self.o_far, self.o_near = z(m, H, value_dim), z(m, H, value_dim)
        self.b_far = z(m, H, value_dim)
        self.background = None if background is None else background.to(dev, F64)  # [H, Dv] b̂ (normalises κ)

    def _rescale(self, new_max):
        factor = torch.exp(torch.where(torch.isfinite(self.run_max), self.run_max - new_max, -math.inf))
        factor = torch.nan_to_num(factor, nan=0.0)
        self.zn *= factor
        self.zf *= factor
        self.zf2 *= factor ** 2
        self.o_far *= factor[..., None]
        self.o_near *= factor[..., None]
        self.b_far *= factor[..., None]
        self.run_max = new_max

    def update(self, j0: int, s: torch.Tensor, raw: torch.Tensor | None, values: torch.Tensor,
               background: torch.Tensor | None = None):
        """s ``[m, H, C]`` logits (−inf where masked), raw the unrotated logits or None, values ``[C, H, Dv]`` as
        summed, background ``[C, H, Dv]`` the transported background of each key (M6) or None."""
        m, H, C = s.shape
        if j0 > self.last:  # no query reaches these keys
            return
        j = torch.arange(j0, j0 + C, device=self.device)
        dist = self.positions[:, None] - j[None, :]  # [m, C]
        valid = dist >= 0
        # ---- per distance bin: reduced per query row into [m, H, n_bins], then over the rows. (A scatter straight
        # into [H, n_bins] would send every key of a wide far bin to one address: on a GPU, ~m·C atomic adds, and
        # compare-and-swap maxima, serialised on it; per row, at most C contend.)
        nb = self.bin_count.shape[0]
        bins = torch.bucketize(dist.clamp(min=0), self.edges, right=True) - 1  # [m, C]
        bins = bins.clamp(max=nb - 1)
        vb = valid[:, None, :].expand(m, H, C)
        sb = torch.where(vb, s, 0.0)
        idx = bins[:, None, :].expand(m, H, C)
        binned = lambda t: s.new_zeros(m, H, nb).scatter_add_(2, idx, t).sum(0).T  # noqa: E731  Σ per bin [nb, H]
        self.bin_count += s.new_zeros(m, nb).scatter_add_(1, bins, valid.to(F64)).sum(0)[:, None]
        self.bin_sum += binned(sb)
        self.bin_sumsq += binned(sb ** 2)
        chunk_max = s.new_full((m, H, nb), -math.inf).scatter_reduce_(2, idx, s, "amax").amax(0).T
        new_bmax = torch.maximum(self.bin_max, chunk_max)
        safe = torch.where(torch.isfinite(new_bmax), new_bmax, 0.0)  # [nb, H]
        self.bin_sumexp = self.bin_sumexp * torch.nan_to_num(torch.exp(self.bin_max - safe), nan=0.0)
        e = torch.where(vb, torch.exp(s - safe.T[:, bins].permute(1, 0, 2)), 0.0)  # e^{s − bin max}, [m, H, C]
        self.bin_sumexp += binned(e)
        self.bin_max = new_bmax
        if raw is not None:
            self.has_raw = True
            rb = torch.where(vb, raw, 0.0)
            self.bin_cross += binned(sb * rb)
            self.bin_raw_sq += binned(rb ** 2)
        # ---- per query: running max, near/far partition sums
        self.abs_max = torch.maximum(self.abs_max, torch.where(vb, s.abs(), 0.0).amax(-1))
        self._rescale(torch.maximum(self.run_max, s.amax(-1)))
        e = torch.where(vb, torch.exp(s - self.run_max[..., None]), 0.0)  # [m, H, C]
        for wi, W in enumerate(self.windows):  # W [H]
            inside = dist[:, None, :] < W[None, :, None]  # [m, H, C]
            near = valid[:, None, :] & inside
            far = valid[:, None, :] & ~inside
            self.zn[wi] += (e * near).sum(-1)
            self.zf[wi] += (e * far).sum(-1)
            self.zf2[wi] += (e ** 2 * far).sum(-1)
            self.near_max[wi] = torch.maximum(self.near_max[wi], s.masked_fill(~near, -math.inf).amax(-1))
            self.near_sum[wi] += (sb * near).sum(-1)
            self.near_cnt[wi] += near.to(F64).sum(-1)
            self.far_sum[wi] += (sb * far).sum(-1)
            self.far_cnt[wi] += far.to(F64).sum(-1)
            if wi == 0:
                self.o_far += torch.einsum("mhc,chd->mhd", e * far, values)
                self.o_near += torch.einsum("mhc,chd->mhd", e * near, values)
                if background is not None:
                    self.b_far += torch.einsum("mhc,chd->mhd", e * far, background)

    def per_query(self) -> dict:
        """Per-window arrays ``[n_windows, m, H]`` (numpy): far mass, gaps, λ, bound, M_eff; M6 ratios ``[m, H]``."""
        from pathlab.probes.bounds import far_mass_lower_bound

        with np.errstate(divide="ignore", invalid="ignore"):
            zn, zf, zf2 = _np(self.zn), _np(self.zf), _np(self.zf2)
            rho = zf / (zf + zn)
            m_far = _np(self.far_cnt)
            k_near = _np(self.near_cnt)
            run_max = _np(self.run_max)[None]
            log_zn = np.log(zn) + run_max
            log_mf = np.log(zf) + run_max - np.log(m_far)
            gap = log_zn - log_mf
            mean_far = _np(self.far_sum) / m_far
            d_max = _np(self.near_max) - mean_far
            d_mean = _np(self.near_sum) / k_near - mean_far
            lam = np.broadcast_to(_np(self.abs_max)[None], rho.shape)
            bound = np.where(m_far > 0, far_mass_lower_bound(np.maximum(m_far, 0), np.maximum(k_near, 1), lam), 0.0)
            alpha_sq = zf2 / (zf + zn) ** 2  # Σ_F α²
            m_eff = rho ** 2 / alpha_sq
            of = np.linalg.norm(_np(self.o_far), axis=-1)
            on = np.linalg.norm(_np(self.o_near), axis=-1)
            kappa = None
            if self.background is not None:
                bn = np.linalg.norm(_np(self.background), axis=-1)[None]
                kappa = np.linalg.norm(_np(self.b_far), axis=-1) / (zf[0] * bn)
        return {"far_mass": rho, "gap": gap, "log_z_near": log_zn, "log_m_far": log_mf, "delta_max": d_max,
                "delta_mean": d_mean, "lam": lam, "k_near": k_near, "m_far": m_far, "bound": bound, "m_eff": m_eff,
                "far_near_norm_ratio": of / on, "kappa": kappa}

    def per_bin(self) -> dict:
        """Per distance bin ``[n_bins, H]``: count, μ, σ, log m = log E e^s, ρ_s = Σ s·s⁰ / Σ (s⁰)² (None for
        variants without transport)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            cnt = _np(self.bin_count)
            mean = _np(self.bin_sum) / cnt
            var = np.maximum(_np(self.bin_sumsq) / cnt - mean ** 2, 0.0)
            log_m = _np(self.bin_max) + np.log(_np(self.bin_sumexp)) - np.log(cnt)
            rho_s = _np(self.bin_cross) / _np(self.bin_raw_sq) if self.has_raw else None
        return {"count": cnt, "mean": mean, "std": np.sqrt(var), "log_mean_exp": log_m, "rho_s": rho_s}


def probe_layer(module, q, k, v, x, idx, positions, *, edges, windows, chunk: int | None = None,
                background: bool = True) -> list[tuple[ScoreAccumulator, PreparedLayer]]:
    """Run the streamed probes of one layer for every window ``b`` of the batch.

    windows: near-set widths, each an int or ``[H]`` per-head widths.
    positions: ``[B, m]`` sampled query positions per window. With ``background``, b̂ = the mean of the window's
    (untransported) values per head is the coherent background of M6: the far sum carries P_{j→i} b̂, i.e.
    R(−Φ_j) b̂ before the final R(Φ_i) for Q/K/V rotations (a norm-preserving rotation, left out) and b̂ otherwise.
    Runs on q's device; ``chunk`` keys per chunk (None: :func:`default_chunk`).
    """
    out, memo = [], {}
    positions = positions.detach().cpu()
    for b in range(q.shape[0]):
        layer = prepare_layer(module, q, k, v, x, idx, b, memo)
        bg = expand_kv_heads(v, q.shape[2])[b].to(q.device, F64).mean(0) if background else None  # [H, Dv]
        acc = ScoreAccumulator(positions[b], q.shape[2], edges, windows, layer.v.shape[-1], background=bg,
                               device=q.device)
        for j0, s, raw in iter_logit_chunks(layer, positions[b], chunk):
            C = s.shape[-1]
            moved = None
            if bg is not None:
                moved = rotate(bg[None].expand(C, *bg.shape), -layer.phase[j0:j0 + C]) if layer.rotate_values \
                    else bg[None].expand(C, *bg.shape)
            acc.update(j0, s, raw, layer.v[j0:j0 + C], moved)
        out.append((acc, layer))
    return out
