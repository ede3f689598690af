"""Chunk layout for the PaTH kernels: every sequence cut into chunks of BT tokens, heads first.

The kernels see one tensor per quantity of shape ``[heads, NC, BT, ...]`` where NC counts the chunks of all
sequences together (B·⌈T/BT⌉ for a padded batch, Σ_s ⌈L_s/BT⌉ for packed ``cu_seqlens``). A chunk never
straddles two sequences. The tail of a sequence's last chunk is padding: q = k = v = w = 0 and β = g = 0, so
each padded transition is the identity, and a padded key is seen only by padded queries (causality within the
chunk), whose rows are dropped. Per chunk the kernels read two integers:

* ``chunk_index[n]`` = c, the chunk's position inside its sequence (its query block scans key chunks c−1 … 0);
* ``chunk_first[n]`` = the global index of its sequence's chunk 0 (key chunk m lives at chunk_first + m).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ChunkLayout:
    chunk: int  # BT
    n_chunks: int  # NC
    max_chunks: int  # most chunks in one sequence
    batch: int
    length: int  # T (padded batch) or total tokens (packed, batch == 1)
    simple: bool  # padded batch of equal lengths: gather = pad + reshape
    chunk_index: torch.Tensor  # int32 [NC]
    chunk_first: torch.Tensor  # int32 [NC]
    order: torch.Tensor  # int32 [NC]: chunks by decreasing chunk_index (longest scans first)
    token_of_slot: torch.Tensor | None  # int64 [NC·BT]: flat token index, or n_tokens for padding
    slot_of_token: torch.Tensor | None  # int64 [n_tokens]


_CACHE: dict = {}


def build_layout(batch: int, length: int, chunk: int, device, cu_seqlens: torch.Tensor | None = None) -> ChunkLayout:
    """Layout for ``[B, T]`` tokens, or for packed sequences given by ``cu_seqlens`` (then B must be 1)."""
    if cu_seqlens is not None and torch.compiler.is_compiling():
        # packed sequences need the boundaries on the host: build the layout eagerly (one graph break)
        return _build_layout_eager(batch, length, chunk, device, cu_seqlens)
    # Under torch.compile the padded layout is traced (no cache: a traced tensor must not leak into it) and
    # its sizes are computed from the shapes, so no data-dependent integer enters the graph.
    cache = cu_seqlens is None and not torch.compiler.is_compiling()
    if cu_seqlens is None:
        key = (batch, length, chunk, str(device))
        if cache and key in _CACHE:
            return _CACHE[key]
        n_per = -(-length // chunk)
        max_chunks = max(1, n_per) if batch else 1
        c = torch.arange(n_per, dtype=torch.int32).repeat(batch)
        first = (torch.arange(batch, dtype=torch.int32) * n_per).repeat_interleave(n_per)
        lengths = [length] * batch
        simple = True
    else:
        starts = [int(x) for x in cu_seqlens.tolist()]  # one host sync, like FlashAttention's max_seqlen
        if starts[0] != 0 or starts[-1] != length or any(b < a for a, b in zip(starts[:-1], starts[1:])):
            raise ValueError(
                f"cu_seqlens must start at 0, never decrease and end at the number of tokens ({length}); "
                f"got {starts[:4]}{' …' if len(starts) > 4 else ''} ending at {starts[-1]}"
            )
        lengths = [b - a for a, b in zip(starts[:-1], starts[1:])]
        n_per_seq = [max(1, -(-L // chunk)) for L in lengths]
        c = torch.cat([torch.arange(n, dtype=torch.int32) for n in n_per_seq])
        offsets = torch.tensor([0] + n_per_seq[:-1]).cumsum(0)
        first = torch.cat([torch.full((n,), int(o), dtype=torch.int32) for n, o in zip(n_per_seq, offsets)])
        simple = False
        max_chunks = int(c.max()) + 1 if c.numel() else 1
    nc = int(c.numel())
    order = torch.argsort(c, descending=True, stable=True).to(torch.int32)
    token_of_slot = slot_of_token = None
    if not simple:
        n_tokens = starts[-1]
        tos = torch.full((nc * chunk,), n_tokens, dtype=torch.int64)
        sot = torch.empty(n_tokens, dtype=torch.int64)
        slot = 0
        for s, L in enumerate(lengths):
            n = max(1, -(-L // chunk))
            tok = torch.arange(starts[s], starts[s] + L)
            slots = torch.arange(slot * chunk, slot * chunk + L)
            tos[slots] = tok
            sot[tok] = slots
            slot += n
        token_of_slot, slot_of_token = tos.to(device), sot.to(device)
    layout = ChunkLayout(
        chunk=chunk, n_chunks=nc, max_chunks=max_chunks, batch=batch, length=length,
        simple=simple, chunk_index=c.to(device), chunk_first=first.to(device), order=order.to(device),
        token_of_slot=token_of_slot, slot_of_token=slot_of_token,
    )
    if cache:
        if len(_CACHE) >= 64:  # padded layouts are reused across steps; keep a bounded set
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = layout
    return layout


_build_layout_eager = torch.compiler.disable(build_layout)


# The forward's carried query states, kept for the backward (``scan.forward_states``): chunk c of a sequence
# whose chunk 0 is chunk ``first`` holds c states (q⁽ᶜ⁻¹⁾ … q⁽⁰⁾), at rows base(first) + c(c−1)/2 + m of its
# head, with base(f) = ⌈f·(max_chunks − 1)/2⌉. A sequence of L ≤ max_chunks chunks needs L(L−1)/2 rows and
# base(f + L) − base(f) ≥ L(max_chunks − 1)/2 − 1/2 ≥ L(L−1)/2 (equality when L = max_chunks, where the first
# difference is a whole number), so sequences never share a row, and every row lies below base(NC): the kernels
# find a chunk's rows from its two layout integers alone. For equal lengths no row is left unused.


def state_base(first: int, c: int, max_chunks: int) -> int:
    """First state row of chunk c of a sequence starting at chunk ``first`` (as the kernels compute it)."""
    return (first * (max_chunks - 1) + 1) // 2 + c * (c - 1) // 2


def state_rows(n_chunks: int, max_chunks: int) -> int:
    """State rows per head for ``n_chunks`` chunks whose sequences span at most ``max_chunks``: base(NC), and
    one more, which an item without key chunks (c = 0, no states; at the end when its sequence is one chunk)
    may read and never use, since the backward loads a first state before it knows c."""
    return (n_chunks * (max_chunks - 1) + 1) // 2 + 1


def slot_tokens(layout: ChunkLayout, batch: int, length: int) -> torch.Tensor:
    """int64 ``[NC·BT]``: the flat token index b·T + t that each row of the chunk layout holds, ``B·T`` for padding.

    Kernels that gather their rows straight from ``[B, T, ...]`` tensors read this instead of a chunk copy.
    """
    if not layout.simple:
        return layout.token_of_slot  # packed: B == 1, padding = the number of tokens
    rows_per_seq = layout.n_chunks // max(batch, 1) * layout.chunk
    slot = torch.arange(layout.n_chunks * layout.chunk, device=layout.chunk_index.device)
    b, t = slot // rows_per_seq, slot % rows_per_seq
    return torch.where(t < length, b * length + t, batch * length)


def gather_chunks(x: torch.Tensor, tokens: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[B, T, H, ...]`` -> ``[H, NC, BT, ...]`` through :func:`slot_tokens`' index (zeros in the padding).

    :func:`to_chunks` for code that holds the token index rather than the layout (inside custom ops). Without
    padding (as many slots as tokens) slot s holds token s, and the gather is one copy.
    """
    flat = x.reshape(-1, *x.shape[2:])
    if tokens.numel() == flat.shape[0]:
        rows = flat.reshape(tokens.numel() // chunk, chunk, *flat.shape[1:])
    else:
        flat = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])  # row B·T: the padding
        rows = flat.index_select(0, tokens).reshape(tokens.numel() // chunk, chunk, *flat.shape[1:])
    return rows.permute((2, 0, 1) + tuple(range(3, rows.ndim))).contiguous()


def scatter_chunks(x: torch.Tensor, tokens: torch.Tensor, batch: int, length: int, dtype=None) -> torch.Tensor:
    """The inverse of :func:`gather_chunks`: ``[H, NC, BT, ...]`` -> ``[B, T, H, ...]`` in ``dtype`` (default x's),
    dropping the padding. Without padding it is one copy (with the cast)."""
    H, tail = x.shape[0], x.shape[3:]
    rows = x.permute((1, 2, 0) + tuple(range(3, x.ndim)))  # [NC, BT, H, ...]
    if tokens.numel() == batch * length:
        out = torch.empty((batch, length, H, *tail), dtype=dtype or x.dtype, device=x.device)
        out.view(rows.shape).copy_(rows)
        return out
    rows = rows.reshape(-1, H, *tail).to(dtype or x.dtype)
    out = rows.new_empty((batch * length + 1, H, *tail))  # every padding row lands on the extra last row
    out.index_copy_(0, tokens, rows)
    return out[:-1].reshape(batch, length, H, *tail)


def to_chunks(x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """``[B, T, H, ...]`` -> ``[H, NC, BT, ...]`` (zeros in the padding). Differentiable."""
    BT = layout.chunk
    if not layout.simple:
        return gather_chunks(x, layout.token_of_slot, BT)
    B, T = x.shape[:2]
    pad = layout.n_chunks // B * BT - T
    if pad:
        x = F.pad(x, (0, 0) * (x.ndim - 2) + (0, pad))
    x = x.reshape(B * (layout.n_chunks // B), BT, *x.shape[2:])
    return x.permute((2, 0, 1) + tuple(range(3, x.ndim))).contiguous()


def from_chunks(x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """``[H, NC, BT, ...]`` -> ``[B, T, H, ...]``, dropping the padding. Differentiable."""
    H, NC, BT = x.shape[:3]
    tail = x.shape[3:]
    dims = (1, 2, 0) + tuple(range(3, 3 + len(tail)))
    x = x.permute(dims).reshape(NC * BT, H, *tail)
    if layout.simple:
        B = layout.batch
        return x.reshape(B, NC // B * BT, H, *tail)[:, : layout.length]
    return x.index_select(0, layout.slot_of_token).reshape(1, -1, H, *tail)


def chunk_gate(g_chunks: torch.Tensor, layout: ChunkLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Split G = cumsum(g) along each sequence into a local part and a per-chunk offset.

    ``g_chunks`` ``[H, NC, BT]`` fp32 -> (G_local ``[H, NC, BT]`` fp32, offset ``[H, NC]`` fp64) with
    G_i = offset[chunk(i)] + G_local[i]. The offsets are summed in fp64, so G_i − G_j keeps its precision at any
    distance (an fp32 cumsum over 64K tokens loses about 3 digits). Differentiable.

    Each sequence's offsets are sums over its own earlier chunks only: no sum mixes two sequences, so a NaN or a
    huge gate in one sequence leaves the other sequences' offsets and dg untouched (a difference of two running
    sums over the whole batch would not: one NaN would reach every later sequence, and a gate of −1e12 would
    round the others' offsets by ~1e-4).
    """
    local = torch.cumsum(g_chunks, dim=-1)
    totals = local[..., -1].to(torch.float64)  # [H, NC]
    return local, _sums_before(totals, layout)


def _sums_before(totals: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """``[H, NC]`` → for each chunk the sum of ``totals`` over the earlier chunks of its own sequence (0 at a
    sequence's chunk 0), with no arithmetic that mixes two sequences (:func:`chunk_gate`)."""
    H, NC = totals.shape
    if NC == 0:
        return totals
    if layout.simple:  # B sequences of NC / B chunks each, in order
        per = totals.reshape(H, layout.batch, -1)
        before = torch.cumsum(per[..., :-1], dim=-1)
        return torch.cat([torch.zeros_like(per[..., :1]), before], dim=-1).reshape(H, NC)
    # packed: a segmented scan (Hillis–Steele) of x_n = totals_{n−1} (0 at a sequence's chunk 0); in round s
    # chunk n adds x_{n−s} where both are one sequence's (chunk_index_n ≥ s). torch.where rather than a product
    # with a mask, so that another sequence's NaN stays out, in the backward as well (0 · NaN would be NaN).
    c = layout.chunk_index.long()
    zero = totals.new_zeros(())
    x = torch.where(c > 0, F.pad(totals, (1, 0))[:, :NC], zero)
    s = 1
    while s < layout.max_chunks:
        x = torch.where(c >= s, x + F.pad(x, (s, 0))[:, :NC], x)
        s *= 2
    return x
