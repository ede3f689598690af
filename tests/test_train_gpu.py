"""Training on two GPUs (NCCL) against one GPU with the same global batch. Run with ``pytest -m gpu`` on a machine
with at least two CUDA devices.

The CPU twin is ``test_train.py::test_two_processes_match_one_process`` (gloo). Here the model uses PaTH through
the Triton kernel. Losses, gradient norms and validation losses must agree: AdamW is nearly blind to the scale
of the gradient, so the logged gradient norm is what shows a wrong average over processes.
"""

import numpy as np
import pytest
import torch
import yaml

from test_train import _losses, _torchrun, corpus, tiny_config  # noqa: F401  (corpus: module-scoped fixture)
from pathlab.train import train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (e.g. torchrun on 2 GPUs)"),
]


def _grad_norms(run_dir):
    import json

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
    single = train(cfg, run_dir=tmp_path / "single", progress=False)
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    _torchrun("-m", "pathlab.cli", "train", "--config", str(cfg_path), "--run-dir", str(tmp_path / "two"),
              "--no-progress")
    a, va = _losses(single)
    b, vb = _losses(tmp_path / "two")
    assert len(b) == 4 and np.isfinite(b).all()
    np.testing.assert_allclose(b, a, rtol=rtol)
    np.testing.assert_allclose(vb, va, rtol=rtol)
    np.testing.assert_allclose(_grad_norms(tmp_path / "two"), _grad_norms(single), rtol=10 * rtol)
