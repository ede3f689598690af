"""Poisoned inputs: one sequence must not reach another, and a later position must not reach earlier ones.

* Independence (every backend): a NaN in one sequence's q, k, v, w, β or g, or a gate of −1e12 there, leaves
  every other sequence of the batch (and every other ``cu_seqlens`` segment of a packed batch) bit for bit as in a
  run without the poison: outputs and all the gradients of their inputs.
* Causality: the reference (explicit products) keeps every output before a poisoned position bit for bit. The
  chunked UT algorithm (blockwise PyTorch and Triton) keeps every output before the poisoned position's *chunk*
  bit for bit; inside that chunk a NaN in v, w or β reaches every row, the earlier ones included, through the
  chunk's dense products (a zero of a triangular mask times a NaN is NaN: P V of the diagonal block, U = A D_β W,
  q̃ = Q − tril(Q Wᵀ) U). A NaN in q, k or g stays at and after its position. The tests pin exactly that.

The Triton kernel runs under the interpreter here (fp32, small sizes); ``test_kernels_gpu.py`` repeats the
independence test on a GPU.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of the kernels

import pathlab  # noqa: E402
from pathlab.reference import path_attention as reference  # noqa: E402

NAMES = ("q", "k", "v", "w", "beta", "g")
# (input, value): NaN in each input, and a gate of −1e12 (finite: the reference accepts it)
POISONS = [(name, float("nan")) for name in NAMES] + [("g", -1e12)]
POISON_IDS = [f"nan-{n}" for n in NAMES] + ["g-minus-1e12"]

interpreter = pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="interpreter tests run on CPU-only machines; the GPU runs test_kernels_gpu.py")


def make_inputs(B, T, H=2, Hkv=1, D=16, seed=0):
    """q ``[B, T, H, D]``, k, v, w ``[B, T, Hkv, D]``, β ``[B, T, Hkv]`` in (0, 2), g ``[B, T, H]`` ≤ 0 (fp32)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v, w = r(B, T, H, D), r(B, T, Hkv, D), r(B, T, Hkv, D), r(B, T, Hkv, D)
    beta = 2 * torch.rand(B, T, Hkv, generator=gen)
    g = torch.nn.functional.logsigmoid(1.0 + r(B, T, H))
    return [q, k, v, w, beta, g]


def poisoned(inputs, name, value, b, t):
    """A copy of ``inputs`` with ``inputs[name][b, t]`` (every head and feature) set to ``value``."""
    out = [x.clone() for x in inputs]
    out[NAMES.index(name)][b, t] = value
    return out


def outputs_and_grads(fn, inputs, do):
    """[o, dq, dk, dv, dw, dβ, dg] of ``fn`` for the output gradient ``do``."""
    leaves = [x.detach().requires_grad_() for x in inputs]
    o = fn(*leaves)
    return [o.detach()] + [x.detach() for x in torch.autograd.grad(o, leaves, do)]


def assert_same(clean, dirty, select, what):
    """Every tensor of ``clean`` and ``dirty`` (o and the gradients) equal bit for bit where ``select`` points."""
    for name, a, b in zip(("o",) + tuple("d" + n for n in NAMES), clean, dirty):
        a, b = select(a), select(b)
        assert torch.isfinite(a).all(), f"{name} of the clean run is not finite ({what})"
        assert torch.equal(a, b), f"{name} changed ({what}): max |Δ| = {(a - b).abs().nan_to_num(float('inf')).max()}"


# ---------------------------------------------------------------------------------------------------------
# 1. Independence of the sequences of a batch and of the segments of a packed batch


def _triton(ut, cu_seqlens=None, block_size=16):
    from pathlab.kernels import path_attention_triton

    def fn(q, k, v, w, beta, g):
        return path_attention_triton(q, k, v, w, beta, g, cu_seqlens=cu_seqlens, block_size=block_size, ut=ut,
                                     programs=2)
    return fn


def _dispatch(backend, chunk_size=16):
    def fn(q, k, v, w, beta, g):
        return pathlab.path_attention(q, k, v, w, beta, g, backend=backend, chunk_size=chunk_size)
    return fn


def _check_batch(fn, B, T, poison, positions, seed=0):
    """Sequence 1 of a [B, T] batch poisoned at ``positions``; sequences 0, 2, … must not move."""
    inputs = make_inputs(B, T, seed=seed)
    do = torch.randn(B, T, inputs[0].shape[2], inputs[2].shape[3], generator=torch.Generator().manual_seed(1))
    clean = outputs_and_grads(fn, inputs, do)
    name, value = poison
    dirty = outputs_and_grads(fn, poisoned(inputs, name, value, 1, positions), do)
    others = [b for b in range(B) if b != 1]
    assert_same(clean, dirty, lambda x: x[others], f"{name} = {value} in sequence 1")
    assert not torch.equal(dirty[0][1], clean[0][1])  # the poison did reach sequence 1


def _check_packed(fn, lengths, poison, positions, seed=0):
    """Segment 1 of packed sequences (B = 1, ``cu_seqlens`` from ``lengths``) poisoned at ``positions`` (relative
    to its start); the other segments must not move."""
    starts = torch.tensor([0] + lengths).cumsum(0)
    inputs = make_inputs(1, sum(lengths), seed=seed)
    do = torch.randn(1, sum(lengths), inputs[0].shape[2], inputs[2].shape[3],
                     generator=torch.Generator().manual_seed(1))
    clean = outputs_and_grads(fn, inputs, do)
    name, value = poison
    dirty = outputs_and_grads(fn, poisoned(inputs, name, value, 0, positions + int(starts[1])), do)
    keep = torch.ones(sum(lengths), dtype=torch.bool)
    keep[int(starts[1]):int(starts[2])] = False
    assert_same(clean, dirty, lambda x: x[:, keep], f"{name} = {value} in segment 1")


# T = 37 at BT = 16: three chunks per sequence, the last one padded; two poisoned positions, in chunks 0 and 1
BATCH_POSITIONS = torch.tensor([5, 20])


@interpreter
@pytest.mark.parametrize("poison", POISONS, ids=POISON_IDS)
@pytest.mark.parametrize("ut", ["torch", "triton", "triton_saved"])
def test_triton_batch_sequences_are_independent(ut, poison):
    """Padded batch of 3 (``triton_saved`` runs its backward by sequence here: 3 sequences ≥ 2 programs)."""
    _check_batch(_triton(ut), 3, 37, poison, BATCH_POSITIONS)


PACKED = [21, 29, 20]  # segment 1 spans chunks 0 and 1 of its own (BT = 16), the others one short of 2 chunks


@interpreter
@pytest.mark.parametrize("poison", POISONS, ids=POISON_IDS)
@pytest.mark.parametrize("ut", ["torch", "triton", "triton_saved"])
def test_triton_packed_segments_are_independent(ut, poison):
    _check_packed(_triton(ut, cu_seqlens=torch.tensor([0, 21, 50, 70], dtype=torch.int32)), PACKED, poison,
                  torch.tensor([3, 17]))


@pytest.mark.parametrize("poison", POISONS, ids=POISON_IDS)
def test_blockwise_batch_sequences_are_independent(poison):
    _check_batch(_dispatch("torch"), 3, 37, poison, BATCH_POSITIONS)


FINITE_BETA_AND_GATE = [i for i, (name, value) in enumerate(POISONS) if name not in ("beta", "g") or value == value]


@pytest.mark.parametrize("poison", [POISONS[i] for i in FINITE_BETA_AND_GATE],
                         ids=[POISON_IDS[i] for i in FINITE_BETA_AND_GATE])
def test_reference_batch_sequences_are_independent(poison):
    """The reference rejects a non-finite β or g (``check_path_values``); the other poisons must stay put."""
    _check_batch(_dispatch("reference"), 3, 21, poison, torch.tensor([4, 13]))


def test_reference_rejects_non_finite_beta_and_gate():
    q, k, v, w, beta, g = make_inputs(1, 8)
    beta[0, 3] = float("nan")
    with pytest.raises(ValueError, match="beta"):
        reference(q, k, v, w, beta, g)
    beta[0, 3] = 1.0
    g[0, 3] = float("nan")
    with pytest.raises(ValueError, match="g must be"):
        reference(q, k, v, w, beta, g)


def test_segmented_gate_offsets_do_not_cross_sequences():
    """``_layout.chunk_gate``: each sequence's fp64 offsets are sums over its own earlier chunks only, so a NaN
    or a −1e12 gate in one sequence (or in a chunk) changes neither another sequence's offsets nor the offset of
    the poisoned chunk itself (which counts only the chunks before it), and their gradients stay apart too."""
    from pathlab.kernels.layout import build_layout, chunk_gate, to_chunks

    for cu in (None, torch.tensor([0, 21, 50, 70, 71], dtype=torch.int32)):
        B, T = (3, 37) if cu is None else (1, 71)
        layout = build_layout(B, T, 16, "cpu", cu)
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, 2))
        clean_local, clean_offset = chunk_gate(to_chunks(g, layout), layout)
        seq_of_chunk = torch.cumsum(layout.chunk_index == 0, 0) - 1
        for value in (float("nan"), -1e12):
            bad = g.clone()
            bad[(1, slice(None)) if cu is None else (0, slice(21, 50))] = value  # all of sequence 1
            local, offset = chunk_gate(to_chunks(bad, layout), layout)
            other = seq_of_chunk != 1
            assert torch.equal(offset[:, other], clean_offset[:, other])
            assert torch.equal(local[:, other], clean_local[:, other])
            first = (layout.chunk_index == 0) & ~other  # sequence 1's first chunk: offset 0, whatever its gate
            assert (offset[:, first] == 0).all()
        # gradients: a NaN upstream gradient on sequence 1's offsets reaches no other sequence's gate
        gr = g.clone().requires_grad_()
        local, offset = chunk_gate(to_chunks(gr, layout), layout)
        up = torch.ones_like(offset)
        up[:, seq_of_chunk == 1] = float("nan")
        (dg,) = torch.autograd.grad(offset, gr, up)
        other_tokens = (torch.arange(B) != 1)[:, None].expand(B, T) if cu is None else \
            (torch.arange(T) < 21) | (torch.arange(T) >= 50)
        assert torch.isfinite(dg[other_tokens.reshape(B, T)]).all()


# ---------------------------------------------------------------------------------------------------------
# 2. Causality: what a poisoned position t can reach


def _outputs(fn, inputs):
    with torch.no_grad():
        return fn(*inputs)


def _check_causal(fn, T, t, chunk, poison, *, reaches_chunk_start):
    """Poison position t: outputs before t's chunk start (before t itself for the reference, ``chunk = 1``) are
    bit for bit the clean ones; outputs from t on are not finite (for a NaN); the rows between the chunk start
    and t are the clean ones, or (``reaches_chunk_start``) all not finite."""
    inputs = make_inputs(1, T, seed=3)
    name, value = poison
    clean, dirty = _outputs(fn, inputs), _outputs(fn, poisoned(inputs, name, value, 0, t))
    start = t // chunk * chunk
    assert torch.equal(dirty[:, :start], clean[:, :start]), f"{name}: an output before t's chunk changed"
    between = dirty[:, start:t]
    if reaches_chunk_start:
        assert not torch.isfinite(between).any(dim=(0, 2, 3)).any(), \
            f"{name}: some row of t's chunk before t stayed finite (the pinned behaviour changed)"
    else:
        assert torch.equal(between, clean[:, start:t]), f"{name}: an output of t's chunk before t changed"
    if value != value:  # NaN reaches o_t itself
        assert not torch.isfinite(dirty[:, t]).any()


CAUSAL_POISONS = [(name, float("nan")) for name in NAMES]
# a NaN in v_t, w_t or β_t enters the chunk's dense products (P V, U = A D_β W, q̃): every row of the chunk
CHUNK_WIDE = {"v", "w", "beta"}


@pytest.mark.parametrize("poison", [p for p in CAUSAL_POISONS if p[0] not in ("beta", "g")],
                         ids=[f"nan-{p[0]}" for p in CAUSAL_POISONS if p[0] not in ("beta", "g")])
def test_reference_later_nan_never_reaches_earlier_outputs(poison):
    """The explicit-product reference is causal position by position: o_i for every i < t is the clean one
    (a NaN in β or g it rejects, ``test_reference_rejects_non_finite_beta_and_gate``)."""
    _check_causal(_dispatch("reference"), 24, 13, 1, poison, reaches_chunk_start=False)


@pytest.mark.parametrize("t", [21, 16, 31], ids=["mid-chunk", "chunk-start", "chunk-end"])
@pytest.mark.parametrize("poison", CAUSAL_POISONS, ids=[f"nan-{p[0]}" for p in CAUSAL_POISONS])
def test_blockwise_nan_reaches_back_to_its_chunk_start_only(poison, t):
    _check_causal(_dispatch("torch", chunk_size=16), 40, t, 16, poison,
                  reaches_chunk_start=poison[0] in CHUNK_WIDE and t % 16 > 0)


@interpreter
@pytest.mark.parametrize("poison", CAUSAL_POISONS, ids=[f"nan-{p[0]}" for p in CAUSAL_POISONS])
@pytest.mark.parametrize("ut", ["torch", "triton", "triton_saved"])
def test_triton_nan_reaches_back_to_its_chunk_start_only(ut, poison):
    _check_causal(_triton(ut), 40, 21, 16, poison, reaches_chunk_start=poison[0] in CHUNK_WIDE)
