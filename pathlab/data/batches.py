"""Random training windows that depend only on (seed, iteration, micro-step): resumable and rank-independent.

Micro-batch ``m`` of iteration ``it`` is drawn from ``np.random.default_rng([seed, it, m])``; the global batch of
an iteration is micro-batches ``0 .. grad_accum-1``, and process ``r`` of ``N`` takes micro-batches
``r * grad_accum/N .. (r+1) * grad_accum/N - 1``. So a 2-process run sees exactly the data of a 1-process run with
the same global batch, and the sampler's whole state is the iteration number.
"""

from __future__ import annotations

import numpy as np
import torch


class WindowSampler:
    """``x, y`` pairs of shape ``[batch_size, block_size]`` (``y`` = ``x`` shifted by one) from a token memmap."""

    def __init__(self, tokens: np.ndarray, block_size: int, batch_size: int, seed: int):
        if len(tokens) < block_size + 2:
            raise ValueError(
                f"data.block_size: the split has {len(tokens)} tokens, fewer than one window of {block_size} + 1"
            )
        self.tokens, self.block_size, self.batch_size, self.seed = tokens, block_size, batch_size, seed

    def starts(self, iteration: int, micro: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, iteration, micro])
        return rng.integers(0, len(self.tokens) - self.block_size - 1, size=self.batch_size)

    def batch(self, iteration: int, micro: int, device: torch.device | str = "cpu"):
        starts = self.starts(iteration, micro)
        win = np.stack([np.asarray(self.tokens[s : s + self.block_size + 1], dtype=np.int64) for s in starts])
        win = torch.from_numpy(win)
        x, y = win[:, :-1], win[:, 1:]
        if torch.device(device).type == "cuda":
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x.contiguous().to(device), y.contiguous().to(device)

    def state(self, iteration: int) -> dict:
        return {"kind": "window", "seed": self.seed, "iteration": iteration, "block_size": self.block_size,
                "batch_size": self.batch_size}
