"""Training on two GPUs (NCCL) against one GPU with the same global batch. Run with ``pytest -m gpu`` on a machine
with at least two CUDA devices.

The CPU twin is ``test_train.py::test_two_processes_match_one_process`` (gloo). Here the model uses PaTH through
the Triton kernel. Losses, gradient norms and validation losses must agree: AdamW is nearly blind to the scale
of the gradient, so the logged gradient norm is what shows a wrong average over processes.
"""

import json

import numpy as np
import pytest
import torch

from test_train import _losses, corpus, tiny_config, train_one_and_two_processes  # noqa: F401  (corpus: fixture)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (e.g. torchrun on 2 GPUs)"),
]


def _grad_norms(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["grad_norm"] for r in rows if "grad_norm" in r]


@pytest.mark.parametrize("strategy,dtype,compile_,rtol", [
    ("ddp", "float32", False, 1e-4),
    ("fsdp", "float32", False, 1e-4),
    ("ddp", "auto", "auto", 1e-2),  # what a GPU run uses: bf16 autocast and torch.compile
])
def test_two_gpus_match_one_gpu(corpus, tmp_path, strategy, dtype, compile_, rtol):  # noqa: F811
    cfg = tiny_config(corpus, max_iters=4, eval_interval=0, ckpt_interval=0, grad_accum=2, distributed=strategy,
                      device="cuda", dtype=dtype, compile=compile_)
    cfg["model"] = {"n_layer": 2, "n_head": 2, "n_embd": 64, "attention": "path"}
    cfg["data"]["block_size"] = 128
    single, two = train_one_and_two_processes(cfg, tmp_path)
    a, va = _losses(single)
    b, vb = _losses(two)
    assert len(b) == 4 and np.isfinite(b).all()
    np.testing.assert_allclose(b, a, rtol=rtol)
    np.testing.assert_allclose(vb, va, rtol=rtol)
    np.testing.assert_allclose(_grad_norms(two), _grad_norms(single), rtol=10 * rtol)
