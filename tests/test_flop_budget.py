"""``benchmarks/flop_budget.py``: the tensor-core work of PaTH's kernels, counted by hand, and its committed result
remade from the committed profiles."""

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import flop_budget  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def test_products_counted_by_hand_at_the_model_shape():
    """T = 512, BT = D = 64: every product is 64×64×64 except the inverse's doubling steps (16³ and 32³ blocks).
    8 chunks, 28 (query chunk, earlier key chunk) pairs."""
    unit = 64**3
    products = {name: macs / unit for name, macs in flop_budget.kernel_macs(512, 64).items()}
    assert products == {
        "_path_fwd_kernel": 8 * 1 + 28 * 3,  # P·V of each diagonal block; S, P·V and the carry per pair
        "_path_bwd_kernel": 28 * 8 + 8 * 2,  # carry, S, dP, dV, dk̃, dM, λMᵀ, λ update; dP and dV of the diagonal
        "_ut_inverse_kernel": 8 * (1 + (2 * 2 * 16**3 + 2 * 32**3) / unit),  # W Wᵀ; 4 blocks at S = 16, 2 at 32
        "_ut_fwd_kernel": 8 * 9,
        "_ut_bwd_heads_kernel": 8 * 16,
        "_ut_bwd_chunk_kernel": 8 * 7,
        "_ut_bwd_inverse_kernel": 8 * 4,
    }


def test_sdpa_counted_over_half_the_square_or_whole_tiles():
    assert flop_budget.sdpa_macs(512, 64) == 3.5 * 512 * 512 * 64
    assert flop_budget.sdpa_macs(512, 64, 64) / flop_budget.sdpa_macs(512, 64) == pytest.approx(36 / 32)


def test_committed_budget_is_what_the_committed_profiles_give():
    committed = json.loads((RESULTS / "flop-budget-owt16-h200.json").read_text())
    args = committed["command"].split()[2:]
    inputs = [json.loads((ROOT / args[args.index(flag) + 1]).read_text())
              for flag in ("--kernels", "--path-step", "--rope-step")]
    remade = json.loads(json.dumps(flop_budget.budget(*inputs)))
    committed.pop("command")
    assert remade == committed
    assert remade["owt16"]["layers"] == 16
    assert remade["op"]["ms"] == pytest.approx(sum(r["ms"] for r in remade["kernels"]))
