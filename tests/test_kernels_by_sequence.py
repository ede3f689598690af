"""The scan's backward by sequence (``kernels/_triton_bwd_by_sequence.py``) on the CPU under the Triton interpreter.

Its six outputs (dq̃, dk̃, dV, dM, dS_d, dG) against the backward by query chunk given the same carried states, on
fresh random inputs: packed sequences of different lengths (one of a single chunk, one ending inside a chunk),
grouped heads, the gate, v in its own layout or in chunks, o and dV in token rows or in the chunk layout, one or
two query chunks to a tile; every buffer it writes starts as NaN here, so an element it never writes fails the
test. Then the saving route end to end against the fp64 reference, and the setting's clear errors.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of the kernels

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter tests run on CPU-only machines; the GPU runs test_kernels_gpu.py"
)

from pathlab.kernels import KernelConfig  # noqa: E402
from pathlab.kernels.layout import build_layout, chunk_gate, slot_tokens, state_rows, to_chunks  # noqa: E402
from pathlab.kernels.scan import _scan_bwd_impl, _scan_fwd_impl, backward_by_sequence  # noqa: E402
from pathlab.kernels.ut_forward import ut_forward  # noqa: E402
from pathlab.testing import random_path_inputs, rel_err  # noqa: E402

NAMES = ("dq̃", "dk̃", "dV", "dM", "dS_d", "dG")


def scan_case(lengths, H, Hkv, D, DV, dtype, gate, token_rows, v_rows, BT=16):
    """The scan backward's inputs for packed sequences of ``lengths`` (B = 1), with the forward run once to fill the
    carried states: (arguments, keyword arguments) of ``_scan_bwd_impl``."""
    T = sum(lengths)
    q, k, v, w, beta, g = random_path_inputs(1, T, H, D, Hkv=Hkv, Dv=DV, dtype=dtype, gate=gate)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    layout = build_layout(1, T, BT, q.device, cu)
    lowp = torch.float32 if dtype == torch.float32 else torch.float16
    tokens = slot_tokens(layout, 1, T)
    qs, ks, m, sd, _ = ut_forward(q, k, w, beta.float(), tokens, BT, lowp)
    gl = go = None
    if gate:
        gl, go = chunk_gate(to_chunks(g.float(), layout), layout)
    meta = (layout.chunk_first, layout.chunk_index, layout.order, layout.max_chunks)
    rows = dict(token_rows=(tokens, 1, T), v_rows=v_rows) if token_rows else {}
    vv = v if token_rows and v_rows else to_chunks(v, layout).contiguous()
    states = torch.zeros((H, state_rows(layout.n_chunks, layout.max_chunks), BT, D), dtype=lowp)
    o, lse = _scan_fwd_impl(qs, ks, vv, m, sd, gl, go, *meta, D ** -0.5, 3, states=states, **rows)
    do = torch.randn_like(o)
    return (do, qs, ks, vv, m, sd, gl, go, o, lse, *meta, D ** -0.5, 3), dict(states=states, **rows)


def both_orders(args, kwargs, R=1):
    by_query_chunk = _scan_bwd_impl(*args, config=KernelConfig(by_sequence=False), **kwargs)
    by_sequence = _scan_bwd_impl(*args, config=KernelConfig(by_sequence=True, by_sequence_launch=(R,)), **kwargs)
    return by_query_chunk, by_sequence


CASES = [
    # lengths, H, Hkv, D, DV, dtype, gate, token rows, v rows
    pytest.param([50, 16, 97, 33, 9], 2, 2, 16, 16, torch.float32, False, True, True, id="packed-v-in-place"),
    pytest.param([50, 16, 97, 33, 9], 4, 2, 16, 32, torch.float32, True, True, True, id="packed-grouped-gate"),
    pytest.param([64, 64, 64], 2, 1, 32, 16, torch.float32, True, True, False, id="whole-chunks-v-chunk-copy"),
    pytest.param([75, 75], 2, 2, 16, 16, torch.float32, True, False, False, id="chunk-layout"),
    pytest.param([80, 5, 41], 2, 2, 32, 32, torch.float16, True, True, True, id="fp16-gate"),
]


@pytest.mark.parametrize("R", [1, 2], ids=["one-query-chunk-a-tile", "two-query-chunks-a-tile"])
@pytest.mark.parametrize("lengths,H,Hkv,D,DV,dtype,gate,token_rows,v_rows", CASES)
def test_backward_by_sequence_matches_by_query_chunk(R, lengths, H, Hkv, D, DV, dtype, gate, token_rows, v_rows):
    args, kwargs = scan_case(lengths, H, Hkv, D, DV, dtype, gate, token_rows, v_rows)
    want, got = both_orders(args, kwargs, R)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for name, a, b in zip(NAMES, want, got):
        if name == "dG" and not gate:
            assert a.numel() == b.numel() == 0
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, name
        err = rel_err(b, a)  # inf where the kernel left a NaN
        assert err <= tol, f"{name}: relative error {err:.3g} > {tol}"


def test_backward_by_sequence_reads_every_state():
    """Zeroed states change dq̃ and dk̃ (the kernel reads them), and states of a wrong shape are refused."""
    args, kwargs = scan_case([70, 40], 2, 2, 16, 16, torch.float32, True, True, True)
    kwargs = dict(kwargs, config=KernelConfig(by_sequence=True))
    read = _scan_bwd_impl(*args, **kwargs)
    zeroed = _scan_bwd_impl(*args, **dict(kwargs, states=torch.zeros_like(kwargs["states"])))
    assert rel_err(zeroed[0], read[0]) > 1e-2 and rel_err(zeroed[1], read[1]) > 1e-2
    with pytest.raises(ValueError, match="states must be"):
        _scan_bwd_impl(*args, **dict(kwargs, states=kwargs["states"][:, 1:]))


@pytest.mark.parametrize("gate", [False, True], ids=["path", "path_fox"])
def test_saving_route_by_sequence_matches_reference(gate):
    """The whole op on the saving route with the backward by sequence, pinned on (too few sequences here for the
    default), against the fp64 reference on packed sequences."""
    from test_kernels import compare, make

    lengths = [50, 16, 97, 9]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    compare(make(1, sum(lengths), 4, 2, 16, 32, torch.float32, gate=gate), tol=1e-5, cu_seqlens=cu,
            ut="triton_saved", config=KernelConfig(forward_states=True, by_sequence=True))


def test_backward_by_sequence_policy():
    """By sequence when the sequences (at least NC / max_chunks of them) times the kv heads give each of the
    device's multiprocessors a program (2 on a CPU), with or without the gate, unless a config pins it; the launch
    tunables' bad values are clear errors."""
    from pathlab.kernels.scan import _by_sequence_launch

    cpu = torch.device("cpu")
    assert backward_by_sequence(8, 8, 2, cpu)  # one sequence, two kv heads
    assert not backward_by_sequence(8, 8, 1, cpu)  # one program for two multiprocessors
    assert backward_by_sequence(64, 8, 12, cpu)  # eight sequences, twelve kv heads
    assert backward_by_sequence(8, 8, 1, cpu, KernelConfig(by_sequence=True))
    assert not backward_by_sequence(64, 8, 12, cpu, KernelConfig(by_sequence=False))
    assert _by_sequence_launch() == (1, 4, 2)
    assert _by_sequence_launch(KernelConfig(by_sequence_launch=(2, 8))) == (2, 8, 2)
    for bad in ((3,), (2, -1)):
        with pytest.raises(ValueError):
            KernelConfig(by_sequence_launch=bad)
