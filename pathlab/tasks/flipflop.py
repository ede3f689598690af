"""Flip-flop language modelling, FFL(p_i) (Liu et al. 2023, arXiv:2306.00946; PaTH Table 1).

A sequence is 256 (instruction, bit) pairs over the alphabet of the official dataset ``synthseq/flipflop``::

    w = 0   write   the bit that follows becomes the stored bit (uniform)
    r = 1   read    the bit that follows must equal the last written bit (deterministic)
    i = 2   ignore  the bit that follows is noise (uniform)
    0 = 3, 1 = 4    the bits

Instructions are i.i.d. Categorical(p_w, p_r, p_i) with p_w = p_r = (1 - p_i) / 2, except that the first
instruction is always ``w`` (so every read has a defined answer; PaTH Thm A.1) and the last is always ``r`` (as
in Liu et al.). Three distributions are standard:

    train / in-distribution  FFL(0.8)   p_i = 0.8
    sparse (out of distr.)   FFL(0.98)  98% of the instructions are ignores
    dense  (out of distr.)   FFL(0.1)   10% of the instructions are ignores

The model is trained with next-token prediction. ``lm_targets(tokens, loss="clean")`` keeps the loss only on the
deterministic read bits (Liu et al.'s "clean" loss, the default here); ``loss="full"`` is the plain LM loss on
every next token. The metric is the **read error**: the fraction of read bits for which the greedy next-token
prediction after ``r`` (argmax over the whole vocabulary) is not the last written bit.

Generation is vectorised numpy and seeded: the same ``seed`` gives the same tokens on every machine.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

WRITE, READ, IGNORE, ZERO, ONE = 0, 1, 2, 3, 4
VOCAB_SIZE = 5
TOKEN_NAMES = ("w", "r", "i", "0", "1")

N_INSTRUCTIONS = 256  # -> 512 tokens, the official length
P_IGNORE_TRAIN = 0.8
SPLITS = {"in_dist": 0.8, "sparse": 0.98, "dense": 0.1}  # p_i of each evaluation set (PaTH Table 1 columns)
# official split sizes (synthseq/flipflop): train 1.6M, val 16K, val_sparse 160K, val_dense 4K sequences


def _rng(seed) -> np.random.Generator:
    if isinstance(seed, np.random.Generator):
        return seed
    return np.random.default_rng(seed)


def _check(n: int, n_instructions: int, p_ignore: float) -> None:
    if not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be a non-negative number of sequences, got {n!r}")
    if not isinstance(n_instructions, (int, np.integer)) or n_instructions < 2:
        raise ValueError(f"n_instructions must be an int >= 2 (first is w, last is r), got {n_instructions!r}")
    if not (isinstance(p_ignore, (int, float)) and 0.0 <= p_ignore < 1.0):
        raise ValueError(f"p_ignore must lie in [0, 1), got {p_ignore!r}")


def generate_flipflop(n: int, p_ignore: float = P_IGNORE_TRAIN, *, n_instructions: int = N_INSTRUCTIONS,
                      seed=0) -> torch.Tensor:
    """``n`` FFL(p_ignore) sequences as int64 tokens ``[n, 2 * n_instructions]``.

    ``seed`` is anything ``numpy.random.default_rng`` accepts (an int, a list of ints) or a Generator.
    """
    _check(n, n_instructions, p_ignore)
    rng = _rng(seed)
    p_rw = (1.0 - p_ignore) / 2.0
    instr = rng.choice(3, size=(n, n_instructions), p=[p_rw, p_rw, p_ignore]).astype(np.int64)  # [n, I]
    instr[:, 0] = WRITE
    instr[:, -1] = READ
    bits = rng.integers(0, 2, size=(n, n_instructions), dtype=np.int64)  # [n, I], uniform for w and i
    # a read repeats the bit of the most recent write: index of the last write at or before each instruction
    pos = np.arange(n_instructions, dtype=np.int64)
    last_write = np.maximum.accumulate(np.where(instr == WRITE, pos, 0), axis=1)  # [n, I]
    stored = np.take_along_axis(bits, last_write, axis=1)
    bits = np.where(instr == READ, stored, bits)
    tokens = np.empty((n, 2 * n_instructions), dtype=np.int64)
    tokens[:, 0::2] = instr
    tokens[:, 1::2] = bits + ZERO
    return torch.from_numpy(tokens)


def read_mask(tokens: torch.Tensor) -> torch.Tensor:
    """Boolean ``[n, T]``: True at the positions holding a read instruction ``r`` (whose next token is scored)."""
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, 0::2] = tokens[:, 0::2] == READ
    return mask


def lm_targets(tokens: torch.Tensor, loss: str = "clean") -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token inputs and targets ``(x, y)``, both ``[n, T - 1]``, with ``y = -1`` where no loss is taken.

    ``loss="clean"``: loss only at read instructions (the target is the read bit). ``loss="full"``: every position.
    """
    if loss not in ("clean", "full"):
        raise ValueError(f"loss must be 'clean' (read bits only) or 'full' (every next token), got {loss!r}")
    x, y = tokens[:, :-1], tokens[:, 1:].clone()
    if loss == "clean":
        y[~read_mask(tokens)[:, :-1]] = -1
    return x.contiguous(), y


def read_errors(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[int, int]:
    """(number of wrong read bits, number of read bits) for next-token ``logits [n, T - 1, V]`` on ``tokens``.

    A read bit is wrong when the argmax over the whole vocabulary at the ``r`` position is not the stored bit.
    """
    mask = read_mask(tokens)[:, :-1]
    pred = logits.argmax(dim=-1)
    wrong = (pred != tokens[:, 1:]) & mask
    return int(wrong.sum()), int(mask.sum())


def flipflop_stream(batch_size: int, p_ignore: float = P_IGNORE_TRAIN, *, n_instructions: int = N_INSTRUCTIONS,
                    seed: int = 0) -> Iterator[torch.Tensor]:
    """Endless training batches ``[batch_size, 2 * n_instructions]``; batch ``b`` is seeded by ``(seed, b)``."""
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    b = 0
    while True:
        yield generate_flipflop(batch_size, p_ignore, n_instructions=n_instructions, seed=[int(seed), 0, b])
        b += 1


def flipflop_eval_set(split: str, n: int, *, n_instructions: int = N_INSTRUCTIONS, seed: int = 0) -> torch.Tensor:
    """A fixed evaluation set: ``split`` in ``SPLITS`` ("in_dist", "sparse", "dense"), seeded apart from training."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    stream_id = 1 + sorted(SPLITS).index(split)
    return generate_flipflop(n, SPLITS[split], n_instructions=n_instructions, seed=[int(seed), stream_id])


def decode(tokens) -> str:
    """Human-readable string of one sequence, e.g. ``"w1 i0 r1"``."""
    t = [TOKEN_NAMES[int(x)] for x in tokens]
    return " ".join(a + b for a, b in zip(t[0::2], t[1::2]))
