"""MQRAR-N: multi-query repeated associative recall with N-back (PaTH §4.1; Tan et al. 2024, arXiv:2410.17980).

Variables are assigned and re-assigned values; a query asks for the **N-th most recent** value assigned to a
variable (N = 1 is ordinary recall of the current value). The exact token format of the paper is not public; this
is our reconstruction (docs/state-tracking.md), in Zoology's vocabulary layout (``vocab_size`` V, default 1024)::

    0              ?   the query marker
    1 .. V/2 - 1       keys (variables)
    V/2 .. V - 1       values

A sequence draws ``n_pairs`` = 32 distinct keys and is made of 2-token steps, ``length`` = 768 tokens in all:

* **prefix**: N rounds; in each round every key gets a fresh uniform value (``k v``), keys shuffled per round, so
  that every key has at least N assignments before any query;
* **body**: each step is, with probability ``p_query`` = 1/2, a query ``k ?`` (key uniform over the 32), and
  otherwise a re-assignment ``k v`` (key uniform, value uniform).

The target at a ``?`` position is the value of the N-th most recent assignment of its key; every other position
has target -1 (no loss). Loss and accuracy are taken at the answer positions only (a tagging task: the answer is
predicted *at* the ``?`` token, after the model has seen the key).
"""

from __future__ import annotations

import numpy as np
import torch

QUERY = 0
N_PAIRS = 32
LENGTH = 768
VOCAB_SIZE = 1024
P_QUERY = 0.5


def _rng(seed) -> np.random.Generator:
    return seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)


def check_mqrar_args(n_back: int, *, n_pairs: int = N_PAIRS, length: int = LENGTH, vocab_size: int = VOCAB_SIZE,
                     p_query: float = P_QUERY) -> None:
    """ValueError naming the argument when the settings cannot make a valid sequence."""
    def is_int(x):
        return isinstance(x, (int, np.integer)) and not isinstance(x, bool)

    if not is_int(n_back) or n_back < 1:
        raise ValueError(f"n_back must be an int >= 1 (the N of MQRAR-N), got {n_back!r}")
    if not is_int(vocab_size) or vocab_size < 4 or vocab_size % 2:
        raise ValueError(f"vocab_size must be an even int >= 4 (half keys, half values), got {vocab_size!r}")
    if not is_int(n_pairs) or not 1 <= n_pairs <= vocab_size // 2 - 1:
        raise ValueError(f"n_pairs must be an int in [1, vocab_size/2 - 1 = {vocab_size // 2 - 1}], got {n_pairs!r}")
    if not is_int(length) or length % 2:
        raise ValueError(f"length must be an even int (2-token steps), got {length!r}")
    if length <= 2 * n_pairs * n_back:
        raise ValueError(f"length must exceed the prefix of N rounds, 2 * n_pairs * n_back = "
                         f"{2 * n_pairs * n_back}, got {length}")
    if not (isinstance(p_query, (int, float)) and 0.0 < p_query < 1.0):
        raise ValueError(f"p_query must lie in (0, 1), got {p_query!r}")


def generate_mqrar(n: int, n_back: int, *, n_pairs: int = N_PAIRS, length: int = LENGTH,
                   vocab_size: int = VOCAB_SIZE, p_query: float = P_QUERY, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` MQRAR-``n_back`` sequences: inputs and targets, both int64 ``[n, length]`` (targets -1 off answers)."""
    if not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be a non-negative number of sequences, got {n!r}")
    check_mqrar_args(n_back, n_pairs=n_pairs, length=length, vocab_size=vocab_size, p_query=p_query)
    rng = _rng(seed)
    half = vocab_size // 2
    n_steps = length // 2
    n_prefix = n_pairs * n_back
    rows = np.arange(n)

    # the 32 variables of each sequence: distinct keys from 1 .. V/2 - 1
    keys = np.argsort(rng.random((n, half - 1)), axis=1)[:, :n_pairs] + 1  # [n, P]
    # which variable each step touches (slot 0..P-1), whether it is a query, and the fresh value
    slot = np.empty((n, n_steps), dtype=np.int64)
    slot[:, :n_prefix] = np.concatenate(
        [np.argsort(rng.random((n, n_pairs)), axis=1) for _ in range(n_back)], axis=1)
    slot[:, n_prefix:] = rng.integers(0, n_pairs, size=(n, n_steps - n_prefix))
    is_query = np.zeros((n, n_steps), dtype=bool)
    is_query[:, n_prefix:] = rng.random((n, n_steps - n_prefix)) < p_query
    values = rng.integers(half, vocab_size, size=(n, n_steps), dtype=np.int64)

    # history[:, s, m] = the (m+1)-th most recent value of slot s; a ring updated in step order
    history = np.zeros((n, n_pairs, n_back), dtype=np.int64)
    answers = np.full((n, n_steps), -1, dtype=np.int64)
    for t in range(n_steps):
        s = slot[:, t]
        q = is_query[:, t]
        answers[q, t] = history[rows[q], s[q], n_back - 1]
        w = ~q
        history[rows[w], s[w], 1:] = history[rows[w], s[w], :-1]
        history[rows[w], s[w], 0] = values[w, t]

    inputs = np.empty((n, length), dtype=np.int64)
    inputs[:, 0::2] = np.take_along_axis(keys, slot, axis=1)
    inputs[:, 1::2] = np.where(is_query, QUERY, values)
    targets = np.full((n, length), -1, dtype=np.int64)
    targets[:, 1::2] = answers
    return torch.from_numpy(inputs), torch.from_numpy(targets)


def nth_recent_brute_force(tokens, n_back: int) -> list[int]:
    """Answers of one sequence by a plain backward scan (the test oracle): for each ``?`` at position t, walk back
    over the ``k v`` steps before t and return the n_back-th value assigned to the queried key (-1 if none)."""
    tokens = [int(x) for x in tokens]
    out = []
    for t in range(1, len(tokens), 2):
        if tokens[t] != QUERY:
            continue
        key, seen = tokens[t - 1], 0
        answer = -1
        for u in range(t - 2, 0, -2):
            if tokens[u] != QUERY and tokens[u - 1] == key:
                seen += 1
                if seen == n_back:
                    answer = tokens[u]
                    break
        out.append(answer)
    return out


def blind_baselines(inputs: torch.Tensor, targets: torch.Tensor, n_back: int) -> dict[str, float]:
    """Expected answer accuracy of two predictors that never bind a value to the queried key.

    * ``"frequent_value"``: the value seen most often so far in the sequence (ties shared evenly); it reads
      neither keys nor recency.
    * ``"key_blind"``: the best guess of a reader that knows every key's ``n_back``-th most recent value but not
      which key is asked: the most common entry of that table, one entry per key (ties shared evenly).

    A model whose accuracy sits at these levels has learned which tokens answers are drawn from, not the recall
    itself; chance is 2 / V over the V/2 values. ``inputs``/``targets``: ``[n, T]`` from :func:`generate_mqrar`.
    """
    if inputs.shape != targets.shape or inputs.dim() != 2:
        raise ValueError(f"inputs and targets must both be [n, T], got {tuple(inputs.shape)} and "
                         f"{tuple(targets.shape)}")
    x, y = inputs.cpu().numpy(), targets.cpu().numpy()
    scores: dict[str, list[float]] = {"frequent_value": [], "key_blind": []}

    def share_of_modes(counts: dict[int, int], answer: int) -> float:
        if not counts:  # nothing to guess from yet
            return 0.0
        top = max(counts.values())
        modes = [v for v, c in counts.items() if c == top]
        return (answer in modes) / len(modes)

    for row_x, row_y in zip(x, y):
        recent: dict[int, list[int]] = {}  # key -> its values, most recent first
        seen: dict[int, int] = {}  # value -> how often it was assigned so far
        for t in range(1, row_x.shape[0], 2):
            key, value = int(row_x[t - 1]), int(row_x[t])
            if value != QUERY:
                recent.setdefault(key, []).insert(0, value)
                seen[value] = seen.get(value, 0) + 1
                continue
            answer = int(row_y[t])
            if answer < 0:  # not scored, as in answer_accuracy
                continue
            table: dict[int, int] = {}
            for values in recent.values():
                if len(values) >= n_back:
                    table[values[n_back - 1]] = table.get(values[n_back - 1], 0) + 1
            scores["frequent_value"].append(share_of_modes(seen, answer))
            scores["key_blind"].append(share_of_modes(table, answer))
    if not scores["key_blind"]:
        raise ValueError("the sequences hold no query")
    return {name: float(np.mean(values)) for name, values in scores.items()}


def answer_accuracy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[int, int]:
    """(correct answers, answers) of ``logits [n, T, V]``: argmax over the whole vocabulary at ``targets >= 0``."""
    mask = targets >= 0
    correct = (logits.argmax(dim=-1) == targets) & mask
    return int(correct.sum()), int(mask.sum())
