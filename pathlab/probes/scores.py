"""Streamed attention logits of a trained layer for sampled queries: never a T×T matrix.

For a set of sampled query positions of one window, the logits s_ij of every key j ≤ i are produced in key chunks
(O(T·D) memory per query) and folded into running accumulators:

* per distance bin n = i − j (log-spaced): count, Σ s, Σ s², log Σ e^s → μ(n), σ(n), log m(n) = log E e^s (M3);
* per query and near-set width W (one W per head: N = {j : i − j < W_h}, F = {j : i − j ≥ W_h}): log Z_N, log Z_F, log Σ_F e^{2s}, max|s| = λ, max/mean near score and mean
  far score → ρ_D, Γ, Δ^max, Δ^mean, M_eff and the M5 bound (M4, M5);
* per query, for the first W: Σ_F e^s ṽ_j, Σ_N e^s ṽ_j and Σ_F e^s P_{j→i} b̂ (ṽ = transported values for Q/K/V
  rotations) → the coherence ratio κ and ‖o_F‖/‖o_N‖ (M6);
* for rotation models, Σ s·s⁰ and Σ (s⁰)² per bin with s⁰ the same logit without rotation → ρ_s(n) (M2).

Logits of each variant (scale = 1/√D; gates and biases unscaled, as in :mod:`pathlab.reference`):
NoPE q·k; RoPE and accumulated rotations R(−Φ_i)q · R(−Φ_j)k; ALiBi q·k − m_h (i − j); FoX q·k + G_i − G_j;
PaTH q_iᵀ H_i ⋯ H_{j+1} k_j (+ G_i − G_j), computed by carrying the sampled queries leftwards one key at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from pathlab._checks import expand_kv_heads, normalize_w
from pathlab.ops.positions import accumulate_phases, rope_phases, rotate

F64 = torch.float64


def distance_bin_edges(max_distance: int, per_decade: int = 12) -> np.ndarray:
    """Integer bin edges 0, 1, 2, …, roughly log-spaced above 8: bin k holds distances [edge_k, edge_{k+1})."""
    small = np.arange(0, 9)
    if max_distance <= 8:
        return np.arange(0, max_distance + 2)
    large = np.unique(np.round(np.geomspace(9, max_distance + 1, max(2, int(per_decade * math.log10(
        (max_distance + 1) / 9)) + 2))).astype(int))
    return np.unique(np.concatenate([small, large, [max_distance + 1]]))


# ----------------------------------------------------------------------------------------------------------------
# per-variant logits


@dataclass
class PreparedLayer:
    """One window's layer inputs turned into what the logits need (all fp64, heads expanded, ``[T, H, D]``)."""

    kind: str  # "dot" (NoPE, RoPE, rotations, ALiBi, FoX) or "path"
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor  # values as summed: transported ṽ_j = R(−Φ_j) v_j for Q/K/V rotations, else v_j
    scale: float
    phase: torch.Tensor | None = None  # [T, H, D/2] Φ_t for rotations/RoPE (q, k here are already pre-rotated)
    q_raw: torch.Tensor | None = None  # unrotated q, k for ρ_s
    k_raw: torch.Tensor | None = None
    rotate_values: bool = False
    slopes: torch.Tensor | None = None  # [H] ALiBi
    gate_sum: torch.Tensor | None = None  # [T, H] G_t for FoX / PaTH-FoX
    w: torch.Tensor | None = None  # [T, H, D] unit Householder directions (PaTH)
    beta: torch.Tensor | None = None  # [T, H]
    extra: dict = field(default_factory=dict)


def prepare_layer(module, q, k, v, x, idx, b: int, memo: dict | None = None) -> PreparedLayer:
    """Build the logit ingredients of window ``b`` from a positional module's inputs (``q [B, T, H, D]`` …).

    The module's own tensors (angles, Householder directions, gates) are computed once for the whole batch, as in
    the model's forward, and kept in ``memo`` across the windows of a batch.
    """
    memo = {} if memo is None else memo
    cpu = torch.device("cpu")  # the streamed math runs on the CPU in fp64; module tensors are computed on x's device
    from pathlab.attention.alibi import ALiBi
    from pathlab.attention.fox import FoX
    from pathlab.attention.path import PaTH
    from pathlab.attention.rope import RoPE
    from pathlab.attention.rotation import RotationAttention

    H, D = q.shape[2], q.shape[3]
    scale = D ** -0.5
    qb = q[b].to(cpu, F64)
    kb = expand_kv_heads(k, H)[b].to(cpu, F64)
    vb = expand_kv_heads(v, H)[b].to(cpu, F64)
    T = qb.shape[0]
    if isinstance(module, PaTH):
        if "path" not in memo:
            w, beta, g = module.path_inputs(x)  # whole batch: identical rounding to the model's own forward
            memo["path"] = (normalize_w(w).to(cpu), beta.to(cpu), None if g is None else g.to(cpu))
        w, beta, g = memo["path"]
        w = expand_kv_heads(w, H)[b].to(F64)
        beta = expand_kv_heads(beta, H)[b].to(F64)
        gate = torch.cumsum(g[b].to(F64), 0) if g is not None else None
        return PreparedLayer("path", qb, kb, vb, scale, w=w, beta=beta, gate_sum=gate)
    if isinstance(module, RotationAttention) or isinstance(module, RoPE):
        if isinstance(module, RoPE):
            phase = rope_phases(T, D, module.base, device=qb.device)[:, None, :].expand(T, H, D // 2)
            rot_v = False
        else:
            if "phase" not in memo:
                memo["phase"] = accumulate_phases(module.angles(x, idx), dim=1).to(cpu)
            phase = memo["phase"][b]
            rot_v = module.rotate_values
        return PreparedLayer("dot", rotate(qb, -phase), rotate(kb, -phase), rotate(vb, -phase) if rot_v else vb,
                             scale, phase=phase, q_raw=qb, k_raw=kb, rotate_values=rot_v)
    if isinstance(module, ALiBi):
        return PreparedLayer("dot", qb, kb, vb, scale, slopes=module.slopes.to(cpu, F64))
    if isinstance(module, FoX):
        if "gate" not in memo:
            memo["gate"] = module.gate(x).to(cpu)
        return PreparedLayer("dot", qb, kb, vb, scale, gate_sum=torch.cumsum(memo["gate"][b].to(F64), 0))
    if type(module).__name__.lower().startswith("nope"):
        return PreparedLayer("dot", qb, kb, vb, scale)
    raise ValueError(f"no streamed logits for attention module {type(module).__name__}")


def iter_logit_chunks(layer: PreparedLayer, positions: torch.Tensor, chunk: int = 1024, ut_chunk: int = 64):
    """Yield ``(j0, logits [m, H, C], raw [m, H, C] or None)`` for keys j0 … j0 + C − 1, fp64, −inf where j > i.

    ``positions [m]``: sampled query positions. ``raw`` is the logit without rotation (rotation models only).
    ``ut_chunk``: PaTH's UT chunk size left of the earliest query.
    """
    positions = positions.to(torch.long)
    last = int(positions.max()) + 1
    if layer.kind == "dot":
        qs = layer.q[positions]  # [m, H, D]
        q0 = layer.q_raw[positions] if layer.q_raw is not None else None
        for j0 in range(0, last, chunk):
            j1 = min(j0 + chunk, last)
            s = torch.einsum("mhd,chd->mhc", qs, layer.k[j0:j1]) * layer.scale
            j = torch.arange(j0, j1)
            dist = positions[:, None] - j[None, :]  # [m, C]
            if layer.slopes is not None:
                s = s - layer.slopes[None, :, None] * dist[:, None, :].to(F64)
            if layer.gate_sum is not None:
                s = s + layer.gate_sum[positions][:, :, None] - layer.gate_sum[j0:j1].T[None]
            s = s.masked_fill((dist < 0)[:, None, :], -math.inf)
            raw = None
            if q0 is not None:
                raw = torch.einsum("mhd,chd->mhc", q0, layer.k_raw[j0:j1]) * layer.scale
            yield j0, s, raw
        return
    yield from _path_logit_chunks(layer, positions, chunk, ut_chunk)


def _path_logit_chunks(layer: PreparedLayer, positions: torch.Tensor, chunk: int, ut_chunk: int = 64):
    """PaTH logits of sampled queries, right to left.

    Keys at or after the earliest query: carry the queries one key at a time, u ← H_j u after using key j (H is
    symmetric), starting at u = q_i. Keys before it: all queries are carried, so whole chunks of C keys use the UT
    form (docs/kernels.md, "How it works"): with rows W, D = diag(β), A = (I + strictLower(D W Wᵀ))⁻¹ and U = A D W,
    the chunk's keys carried to its right edge are K̃ = K − (A D strictLower(W Kᵀ))ᵀ W, the logits are u·K̃, and
    the queries cross the chunk as u ← u − (u Wᵀ) U.
    """
    last = int(positions.max()) + 1
    first = int(positions.min())
    m, H, D = positions.shape[0], layer.q.shape[1], layer.q.shape[2]
    u = torch.zeros(m, H, D, dtype=F64)
    started = torch.zeros(m, dtype=torch.bool)
    neg_inf = torch.tensor(-math.inf, dtype=F64)
    starts = {int(t): (positions == t) for t in positions.unique()}

    def gated(cols, c_start, c_end):
        if layer.gate_sum is None:
            return cols
        return cols + layer.gate_sum[positions][:, :, None] - layer.gate_sum[c_start:c_end].T[None]

    for c_end in range(last, first, -chunk):  # sequential region [first, last)
        c_start = max(first, c_end - chunk)
        cols = torch.full((m, H, c_end - c_start), -math.inf, dtype=F64)
        for t in range(c_end - 1, c_start - 1, -1):
            if t in starts:
                u[starts[t]] = layer.q[t]
                started |= starts[t]
            cols[:, :, t - c_start] = torch.where(started[:, None], (u * layer.k[t]).sum(-1) * layer.scale, neg_inf)
            wt = layer.w[t]  # [H, D]
            u = u - (layer.beta[t][None, :, None] * (u * wt).sum(-1, keepdim=True)) * wt
        yield c_start, gated(cols, c_start, c_end), None

    pending, pending_start = [], first
    for c_end in range(first, 0, -ut_chunk):  # UT region [0, first): every query is already carried
        c_start = max(0, c_end - ut_chunk)
        W = layer.w[c_start:c_end].transpose(0, 1)  # [H, C, D]
        K = layer.k[c_start:c_end].transpose(0, 1)
        beta = layer.beta[c_start:c_end].T[:, :, None]  # [H, C, 1]
        C = W.shape[1]
        eye = torch.eye(C, dtype=F64)
        strict = torch.tril(torch.ones(C, C, dtype=torch.bool), diagonal=-1)
        lower = eye + torch.where(strict, beta * (W @ W.transpose(1, 2)), torch.zeros((), dtype=F64))
        X = torch.where(strict, W @ K.transpose(1, 2), torch.zeros((), dtype=F64))  # X[s, r] = w_s·k_r, s > r
        M = torch.linalg.solve_triangular(lower, beta * X, upper=False, unitriangular=True)  # A D X
        K_carried = K - M.transpose(1, 2) @ W  # [H, C, D]
        U = torch.linalg.solve_triangular(lower, beta * W, upper=False, unitriangular=True)  # A D W
        pending.insert(0, torch.einsum("mhd,hcd->mhc", u, K_carried) * layer.scale)
        u = u - torch.einsum("mhc,hcd->mhd", torch.einsum("mhd,hcd->mhc", u, W), U)
        pending_start = c_start
        if sum(p.shape[-1] for p in pending) >= chunk or c_start == 0:
            block = torch.cat(pending, dim=-1)
            yield pending_start, gated(block, pending_start, pending_start + block.shape[-1]), None
            pending = []


# ----------------------------------------------------------------------------------------------------------------
# accumulators


class ScoreAccumulator:
    """Running statistics of the logits of ``m`` sampled queries × H heads, fed one key chunk at a time."""

    def __init__(self, positions: torch.Tensor, n_head: int, edges: np.ndarray, windows, value_dim: int,
                 background: torch.Tensor | None = None):
        self.positions = positions.to(torch.long)
        m, H = self.positions.shape[0], n_head
        self.edges = torch.as_tensor(edges, dtype=torch.long)
        nb = len(edges) - 1
        # windows: n_W entries, each an int or [H] per-head widths -> [n_W, H] long
        win = np.stack([np.broadcast_to(np.asarray(w, dtype=np.float64), (H,)) for w in windows])
        if not np.all(np.isfinite(win)) or np.any(win < 1):
            raise ValueError(f"near-set widths must be finite and ≥ 1, got {win.tolist()}")
        self.windows = torch.as_tensor(win, dtype=torch.long)  # [n_W, H]
        self.H, self.m = H, m
        z = lambda *s: torch.zeros(*s, dtype=F64)  # noqa: E731
        self.bin_count, self.bin_sum, self.bin_sumsq = z(nb, H), z(nb, H), z(nb, H)
        self.bin_max = torch.full((nb, H), -math.inf, dtype=F64)
        self.bin_sumexp = z(nb, H)  # Σ e^{s − bin_max}
        self.bin_cross, self.bin_raw_sq = z(nb, H), z(nb, H)  # Σ s·s⁰, Σ (s⁰)²
        self.has_raw = False
        self.run_max = torch.full((m, H), -math.inf, dtype=F64)  # per query/head max logit so far
        nw = len(self.windows)
        self.zn, self.zf, self.zf2 = z(nw, m, H), z(nw, m, H), z(nw, m, H)  # scaled by e^{−max}, e^{−2 max}
        self.near_max = torch.full((nw, m, H), -math.inf, dtype=F64)
        self.near_sum, self.near_cnt, self.far_sum, self.far_cnt = z(nw, m, H), z(nw, m, H), z(nw, m, H), z(nw, m, H)
        self.abs_max = z(m, H)
        self.o_far, self.o_near = z(m, H, value_dim), z(m, H, value_dim)
        self.b_far = z(m, H, value_dim)
        self.background = background  # [H, Dv] b̂ (its norm normalises κ), or None

    def _rescale(self, new_max):
        factor = torch.exp(torch.where(torch.isfinite(self.run_max), self.run_max - new_max,
                                       torch.tensor(-math.inf, dtype=F64)))
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
        j = torch.arange(j0, j0 + C)
        dist = self.positions[:, None] - j[None, :]  # [m, C]
        valid = dist >= 0
        if not valid.any():
            return
        # ---- per distance bin
        bins = torch.bucketize(dist.clamp(min=0), self.edges, right=True) - 1  # [m, C]
        bins = bins.clamp(max=self.bin_count.shape[0] - 1)
        vb = valid[:, None, :].expand(m, H, C)
        sb = torch.where(vb, s, torch.zeros((), dtype=F64))
        idx = bins[:, None, :].expand(m, H, C)
        flat = lambda t: t.permute(1, 0, 2).reshape(H, -1)  # noqa: E731  [H, m·C]
        fidx, fv = flat(idx), flat(vb)
        nb = self.bin_count.shape[0]
        cnt = torch.zeros(H, nb, dtype=F64).scatter_add_(1, fidx, fv.to(F64))
        self.bin_count += cnt.T
        self.bin_sum += torch.zeros(H, nb, dtype=F64).scatter_add_(1, fidx, flat(sb)).T
        self.bin_sumsq += torch.zeros(H, nb, dtype=F64).scatter_add_(1, fidx, flat(sb) ** 2).T
        chunk_max = torch.full((H, nb), -math.inf, dtype=F64).scatter_reduce_(1, fidx, flat(s), "amax").T
        new_bmax = torch.maximum(self.bin_max, chunk_max)
        safe = torch.where(torch.isfinite(new_bmax), new_bmax, torch.zeros((), dtype=F64))
        self.bin_sumexp = self.bin_sumexp * torch.nan_to_num(torch.exp(self.bin_max - safe), nan=0.0)
        e = torch.exp(s - safe.T.gather(1, idx.permute(1, 0, 2).reshape(H, -1)).reshape(H, m, C).permute(1, 0, 2))
        e = torch.where(vb, e, torch.zeros((), dtype=F64))
        self.bin_sumexp += torch.zeros(H, nb, dtype=F64).scatter_add_(1, fidx, flat(e)).T
        self.bin_max = new_bmax
        if raw is not None:
            self.has_raw = True
            rb = torch.where(vb, raw, torch.zeros((), dtype=F64))
            self.bin_cross += torch.zeros(H, nb, dtype=F64).scatter_add_(1, fidx, flat(sb * rb)).T
            self.bin_raw_sq += torch.zeros(H, nb, dtype=F64).scatter_add_(1, fidx, flat(rb ** 2)).T
        # ---- per query: running max, near/far partition sums
        self.abs_max = torch.maximum(self.abs_max, torch.where(vb, s.abs(), torch.zeros((), dtype=F64)).amax(-1))
        self._rescale(torch.maximum(self.run_max, s.amax(-1)))
        e = torch.where(vb, torch.exp(s - self.run_max[..., None]), torch.zeros((), dtype=F64))  # [m, H, C]
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
            zn, zf, zf2 = self.zn.numpy(), self.zf.numpy(), self.zf2.numpy()
            rho = zf / (zf + zn)
            m_far = self.far_cnt.numpy()
            k_near = self.near_cnt.numpy()
            log_zn = np.log(zn) + self.run_max.numpy()[None]
            log_mf = np.log(zf) + self.run_max.numpy()[None] - np.log(m_far)
            gap = log_zn - log_mf
            mean_far = self.far_sum.numpy() / m_far
            d_max = self.near_max.numpy() - mean_far
            d_mean = self.near_sum.numpy() / k_near - mean_far
            lam = np.broadcast_to(self.abs_max.numpy()[None], rho.shape)
            bound = np.where(m_far > 0, far_mass_lower_bound(np.maximum(m_far, 0), np.maximum(k_near, 1), lam), 0.0)
            alpha_sq = zf2 / (zf + zn) ** 2  # Σ_F α²
            m_eff = rho ** 2 / alpha_sq
            of = np.linalg.norm(self.o_far.numpy(), axis=-1)
            on = np.linalg.norm(self.o_near.numpy(), axis=-1)
            kappa = None
            if self.background is not None:
                bn = np.linalg.norm(self.background.numpy(), axis=-1)[None]
                kappa = np.linalg.norm(self.b_far.numpy(), axis=-1) / (zf[0] * bn)
        return {"far_mass": rho, "gap": gap, "log_z_near": log_zn, "log_m_far": log_mf, "delta_max": d_max,
                "delta_mean": d_mean, "lam": lam, "k_near": k_near, "m_far": m_far, "bound": bound, "m_eff": m_eff,
                "far_near_norm_ratio": of / on, "kappa": kappa}

    def per_bin(self) -> dict:
        """Per distance bin ``[n_bins, H]``: count, μ, σ, log m = log E e^s, ρ_s (or None)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            cnt = self.bin_count.numpy()
            mean = self.bin_sum.numpy() / cnt
            var = np.maximum(self.bin_sumsq.numpy() / cnt - mean ** 2, 0.0)
            log_m = self.bin_max.numpy() + np.log(self.bin_sumexp.numpy()) - np.log(cnt)
            rho_s = self.bin_cross.numpy() / self.bin_raw_sq.numpy() if self.has_raw else None
        return {"count": cnt, "mean": mean, "std": np.sqrt(var), "log_mean_exp": log_m, "rho_s": rho_s}


def probe_layer(module, q, k, v, x, idx, positions, *, edges, windows, chunk: int = 1024,
                background: bool = True) -> list[tuple[ScoreAccumulator, PreparedLayer]]:
    """Run the streamed probes of one layer for every window ``b`` of the batch.

    windows: near-set widths, each an int or ``[H]`` per-head widths.
    positions: ``[B, m]`` sampled query positions per window. With ``background``, b̂ = the mean of the window's
    (untransported) values per head is the coherent background of M6: the far sum carries P_{j→i} b̂, i.e.
    R(−Φ_j) b̂ before the final R(Φ_i) for Q/K/V rotations (a norm-preserving rotation, left out) and b̂ otherwise.
    """
    out, memo = [], {}
    for b in range(q.shape[0]):
        layer = prepare_layer(module, q, k, v, x, idx, b, memo)
        bg = expand_kv_heads(v, q.shape[2])[b].to("cpu", F64).mean(0) if background else None  # [H, Dv]
        acc = ScoreAccumulator(positions[b].cpu(), q.shape[2], edges, windows, layer.v.shape[-1], background=bg)
        for j0, s, raw in iter_logit_chunks(layer, positions[b].cpu(), chunk):
            C = s.shape[-1]
            moved = None
            if bg is not None:
                moved = rotate(bg[None].expand(C, *bg.shape), -layer.phase[j0:j0 + C]) if layer.rotate_values \
                    else bg[None].expand(C, *bg.shape)
            acc.update(j0, s, raw, layer.v[j0:j0 + C], moved)
        out.append((acc, layer))
    return out
