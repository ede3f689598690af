"""The three state-tracking tasks as trainable specifications.

Each task turns resolved settings (a flat dict, see :mod:`pathlab.tasks.settings`) into:

* ``vocab_size(s)`` and ``seq_len(s)``: what the model must embed and attend over;
* ``train_batch(s, step)``: inputs and targets ``[B, T]`` (int64, target -1 = no loss), seeded by (seed, step);
* ``eval_sets(s, quick)``: named held-out sets ``{split: (x, y)}`` seeded apart from training;
* ``summary(metrics)``: the task's headline numbers from the per-split metrics of :func:`split_metrics`;
* ``primary``: (split, metric) used for early stopping (``stop_at``) and for "solved" decisions.

Every task is scored the same way: at positions with a target (y >= 0), the greedy prediction is the argmax over
the whole vocabulary. Per split we keep the token accuracy, the sequence accuracy (all scored positions of a
sequence right), the accuracy at each sequence's last scored position and the mean cross-entropy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from pathlab.tasks import a5, flipflop, mqrar


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    defaults: dict[str, Any]  # task-specific settings and their default values
    vocab_size: Callable[[dict], int]
    seq_len: Callable[[dict], int]
    train_batch: Callable[[dict, int], tuple[torch.Tensor, torch.Tensor]]
    eval_sets: Callable[[dict, bool], dict[str, tuple[torch.Tensor, torch.Tensor]]]
    summary: Callable[[dict], dict]
    primary: tuple[str, str]


# ------------------------------------------------------------------------------------------------- flip-flop


def _ff_batch(s: dict, step: int):
    tokens = flipflop.generate_flipflop(s["batch_size"], s["p_ignore"], n_instructions=s["n_instructions"],
                                        seed=[s["seed"], 0, step])
    return flipflop.lm_targets(tokens, s["loss"])


def _ff_eval(s: dict, quick: bool):
    sizes = {"in_dist": s["n_eval"], "sparse": s["n_eval_sparse"], "dense": s["n_eval_dense"]}
    out = {}
    for split, n in sizes.items():
        n = min(n, s["eval_batch_size"]) if quick else n
        if quick and split != "in_dist":
            continue
        tokens = flipflop.flipflop_eval_set(split, n, n_instructions=s["n_instructions"], seed=s["seed"])
        out[split] = flipflop.lm_targets(tokens, "clean")  # always scored on the read bits only
    return out


def _ff_summary(m: dict) -> dict:
    return {"read_error": {split: 1.0 - v["accuracy"] for split, v in m.items()},
            "n_reads": {split: v["n_scored"] for split, v in m.items()}}


FLIPFLOP = Task(
    name="flipflop",
    description="flip-flop language modelling FFL(p_i): read errors in distribution (p_i=0.8), sparse (0.98), "
                "dense (0.1)",
    defaults=dict(p_ignore=flipflop.P_IGNORE_TRAIN, n_instructions=flipflop.N_INSTRUCTIONS, loss="clean",
                  n_eval=2000, n_eval_sparse=10000, n_eval_dense=1000),
    vocab_size=lambda s: flipflop.VOCAB_SIZE,
    seq_len=lambda s: 2 * s["n_instructions"] - 1,
    train_batch=_ff_batch,
    eval_sets=_ff_eval,
    summary=_ff_summary,
    primary=("in_dist", "accuracy"),
)


# ------------------------------------------------------------------------------------------------- A5


def _a5_generate(s: dict, n: int, seed, split: str):
    """Words of the ``split`` (``a5.is_test_word``): training never draws a test word."""
    if s["variant"] == "tagging":
        return a5.generate_a5(n, s["length"], seed=seed, split=split)
    return a5.generate_a5_identity(n, s["length"], seed=seed, split=split)


def _a5_eval(s: dict, quick: bool):
    n = min(s["n_eval"], s["eval_batch_size"]) if quick else s["n_eval"]
    return {"test": _a5_generate(s, n, [s["seed"], 1], "test")}


def _a5_summary(m: dict) -> dict:
    t = m["test"]
    return {"token_accuracy": t["accuracy"], "sequence_accuracy": t["sequence_accuracy"],
            "last_accuracy": t["last_accuracy"]}


A5 = Task(
    name="a5",
    description="A5 word problem: running product at every position (variant=tagging) or whether the word equals "
                "the identity (variant=identity); solved = sequence accuracy > 90%",
    defaults=dict(length=16, variant="tagging", n_eval=2000, solved_at=0.9),
    vocab_size=lambda s: a5.VOCAB_SIZE if s["variant"] == "tagging" else a5.ID_VOCAB_SIZE,
    seq_len=lambda s: s["length"] + 1,
    train_batch=lambda s, step: _a5_generate(s, s["batch_size"], [s["seed"], 0, step], "train"),
    eval_sets=_a5_eval,
    summary=_a5_summary,
    primary=("test", "sequence_accuracy"),
)


# ------------------------------------------------------------------------------------------------- MQRAR-N


def _mq_generate(s: dict, n: int, seed):
    return mqrar.generate_mqrar(n, s["n_back"], n_pairs=s["n_pairs"], length=s["length"],
                                vocab_size=s["vocab_size"], p_query=s["p_query"], seed=seed)


def _mq_eval(s: dict, quick: bool):
    n = min(s["n_eval"], s["eval_batch_size"]) if quick else s["n_eval"]
    return {"test": _mq_generate(s, n, [s["seed"], 1])}


MQRAR = Task(
    name="mqrar",
    description="MQRAR-N: answer each query with the N-th most recent value of its variable (accuracy at the "
                "answer positions)",
    defaults=dict(n_back=1, n_pairs=mqrar.N_PAIRS, length=mqrar.LENGTH, vocab_size=mqrar.VOCAB_SIZE,
                  p_query=mqrar.P_QUERY, n_eval=500),
    vocab_size=lambda s: s["vocab_size"],
    seq_len=lambda s: s["length"],
    train_batch=lambda s, step: _mq_generate(s, s["batch_size"], [s["seed"], 0, step]),
    eval_sets=_mq_eval,
    summary=lambda m: {"accuracy": m["test"]["accuracy"], "loss": m["test"]["loss"]},
    primary=("test", "accuracy"),
)


TASKS = {t.name: t for t in (FLIPFLOP, A5, MQRAR)}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    return TASKS[name]


# ------------------------------------------------------------------------------------------------- scoring


def batch_counts(logits: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Sums over one batch: logits ``[B, T, V]``, targets ``[B, T]`` (-1 = unscored)."""
    mask = y >= 0
    right = (logits.argmax(dim=-1) == y) & mask
    ce = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), y.clamp(min=0), reduction="none")
    has = mask.any(dim=1)
    # index of the last scored position of each row
    pos = torch.arange(y.shape[1], device=y.device).expand_as(y)
    last = torch.where(mask, pos, -1).max(dim=1).values.clamp(min=0)
    last_right = right.gather(1, last[:, None])[:, 0] & has
    return {
        "n_scored": float(mask.sum()),
        "n_right": float(right.sum()),
        "ce_sum": float((ce * mask).sum()),
        "n_seq": float(has.sum()),
        "n_seq_right": float(((right | ~mask).all(dim=1) & has).sum()),
        "n_last_right": float(last_right.sum()),
    }


def split_metrics(counts: dict[str, float]) -> dict[str, float]:
    """Accuracy, sequence accuracy, last-position accuracy and mean CE from summed :func:`batch_counts`."""
    n, seqs = max(counts["n_scored"], 1.0), max(counts["n_seq"], 1.0)
    return {
        "accuracy": counts["n_right"] / n,
        "sequence_accuracy": counts["n_seq_right"] / seqs,
        "last_accuracy": counts["n_last_right"] / seqs,
        "loss": counts["ce_sum"] / n,
        "n_scored": int(counts["n_scored"]),
        "n_sequences": int(counts["n_seq"]),
    }
