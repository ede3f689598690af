"""The A5 word problem (Merrill, Petty & Sabharwal 2024, arXiv:2404.08819; PaTH Fig. 2).

A5 is the group of the 60 even permutations of five points, the smallest non-solvable group: tracking a running
product in A5 is NC1-complete, so a constant-depth transformer with position-only attention cannot do it for every
length, while one PaTH layer can in principle (PaTH Thm A.1).

**Elements.** A permutation is a tuple ``p`` with ``p[i]`` the image of point ``i``. Element indices: 0 is the
identity, then the other even permutations in lexicographic order. (Merrill et al. use the ``abstract_algebra``
ordering; any fixed bijection gives the same task up to a relabelling of the tokens.)

**Product.** ``(a * b)[i] = a[b[i]]`` (composition: apply ``b`` first). ``multiplication_table()[a, b]`` is the
index of ``a * b``; :func:`verify_group` checks closure, associativity, identity and inverses.

**Tagging task** (the primary one, as in ``jopetty/word-problem``): inputs ``[BOS, g_1, ..., g_k]`` with ``g_t``
uniform i.i.d. over the 60 elements, and the target at position ``t`` is the running product
``g_1 * g_2 * ... * g_t`` (left fold from the identity). Tokens: 0..59 the elements, 60 = BOS; the BOS position
has no target (-1). Metrics: token accuracy (every position) and sequence accuracy (all ``k`` positions right);
"solves length k" means sequence accuracy > 90%, as in Merrill et al.

**Identity variant** (PaTH's phrasing): words over the generators ``g1 = (0 1 2)``, ``g2 = (0 1 3)``,
``g3 = (0 1 4)`` (3-cycles, i.e. the paper's (1 2 3), (1 2 4), (1 2 5)) and their inverses; the label at each
position is whether the prefix product equals the identity. Sets are balanced at the last position: half of the
words multiply to the identity (rejection sampling), and the metric is the accuracy of the last label.

**Held-out words.** A word (the whole token sequence after BOS) is a test word when a fixed hash of it falls in one
bucket of ``HELD_OUT`` (:func:`is_test_word`): ``split="train"`` draws only the other words and ``split="test"``
only these, so no test word is ever trained on, at any length and under any seed. Without the split a short
length's words are all seen in training (60³ = 216,000 words at k = 3 against millions of training draws), and
"solving" it can be memorising it.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import torch

N_POINTS = 5
ORDER = 60
IDENTITY = 0
BOS = ORDER  # 60
VOCAB_SIZE = ORDER + 1

# identity variant: 6 generator tokens, then BOS and the two labels
GENERATOR_CYCLES = ((0, 1, 2), (0, 1, 3), (0, 1, 4))
ID_BOS, ID_NO, ID_YES = 6, 7, 8
ID_VOCAB_SIZE = 9

HELD_OUT = 8  # one word in HELD_OUT (by its hash) is a test word
SPLITS = (None, "train", "test")  # None: every word


def _is_even(p: tuple[int, ...]) -> bool:
    inversions = sum(1 for i in range(len(p)) for j in range(i + 1, len(p)) if p[i] > p[j])
    return inversions % 2 == 0


@functools.lru_cache(maxsize=1)
def elements() -> tuple[tuple[int, ...], ...]:
    """The 60 even permutations of 0..4; index 0 is the identity, the rest in lexicographic order."""
    evens = [p for p in itertools.permutations(range(N_POINTS)) if _is_even(p)]
    identity = tuple(range(N_POINTS))
    return (identity,) + tuple(p for p in evens if p != identity)


def compose(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """``a * b`` as permutations: ``(a * b)[i] = a[b[i]]`` (apply ``b`` first)."""
    return tuple(a[b[i]] for i in range(len(b)))


@functools.lru_cache(maxsize=1)
def _tables() -> tuple[np.ndarray, np.ndarray]:
    elems = elements()
    index = {p: i for i, p in enumerate(elems)}
    mul = np.empty((ORDER, ORDER), dtype=np.int64)
    for i, a in enumerate(elems):
        for j, b in enumerate(elems):
            mul[i, j] = index[compose(a, b)]  # KeyError here would mean the set is not closed
    inv = np.argmax(mul == IDENTITY, axis=1).astype(np.int64)
    mul.setflags(write=False)
    inv.setflags(write=False)
    return mul, inv


def multiplication_table() -> np.ndarray:
    """``[60, 60]`` int64, read-only: ``table[a, b]`` = index of ``a * b``."""
    return _tables()[0]


def inverse_table() -> np.ndarray:
    """``[60]`` int64: the index of each element's inverse."""
    return _tables()[1]


def element_index(p) -> int:
    """Index of the permutation ``p`` (a sequence of the images of 0..4); ValueError for an odd permutation."""
    p = tuple(int(x) for x in p)
    try:
        return elements().index(p)
    except ValueError:
        raise ValueError(f"{p} is not an even permutation of 0..{N_POINTS - 1}") from None


def cycle_to_permutation(cycle) -> tuple[int, ...]:
    """The permutation of 0..4 sending cycle[0] -> cycle[1] -> ... -> cycle[0]."""
    p = list(range(N_POINTS))
    for a, b in zip(cycle, tuple(cycle[1:]) + (cycle[0],)):
        p[a] = b
    return tuple(p)


def verify_group(table: np.ndarray) -> None:
    """Raise ``AssertionError`` unless ``table`` is the Cayley table of a group of 60 elements with identity 0."""
    n = table.shape[0]
    assert table.shape == (ORDER, ORDER) and n == ORDER, f"expected a 60x60 table, got {table.shape}"
    assert ((table >= 0) & (table < n)).all(), "not closed"
    assert (table[IDENTITY] == np.arange(n)).all() and (table[:, IDENTITY] == np.arange(n)).all(), "no identity"
    assert all(np.unique(row).size == n for row in table), "rows are not permutations (no cancellation)"
    assert (table == IDENTITY).sum(axis=1).tolist() == [1] * n, "not every element has one inverse"
    # associativity on all 60^3 triples: (ab)c == a(bc)
    assert (table[table, :] == table[:, table]).all(), "not associative"


def running_products(words: np.ndarray, table: np.ndarray | None = None) -> np.ndarray:
    """Prefix products ``[n, k]`` of element words ``[n, k]``: out[:, t] = w_0 * w_1 * ... * w_t."""
    table = multiplication_table() if table is None else table
    out = np.empty_like(words)
    acc = np.full(words.shape[0], IDENTITY, dtype=np.int64)
    for t in range(words.shape[1]):
        acc = table[acc, words[:, t]]
        out[:, t] = acc
    return out


def _rng(seed) -> np.random.Generator:
    return seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)


def _check_sizes(n, length, min_length=1) -> None:
    if not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be a non-negative number of sequences, got {n!r}")
    if not isinstance(length, (int, np.integer)) or length < min_length:
        raise ValueError(f"length must be an int >= {min_length}, got {length!r}")


_MIX = np.uint64(0x9E3779B97F4A7C15)  # 2⁶⁴ / golden ratio, odd


def word_hash(words: np.ndarray) -> np.ndarray:
    """``[n]`` uint64: a fixed hash of each row of ``words [n, k]`` (non-negative ints), the same on every machine
    and numpy version: h ← (h + w_t + 1)·c per token (c odd, arithmetic mod 2⁶⁴), then an xor-shift-multiply
    finaliser so that every bit of h depends on every token."""
    words = np.asarray(words)
    h = np.full(words.shape[0], np.uint64(words.shape[1]), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for t in range(words.shape[1]):
            h = (h + words[:, t].astype(np.uint64) + np.uint64(1)) * _MIX
        h ^= h >> np.uint64(31)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(29)
    return h


def is_test_word(words: np.ndarray) -> np.ndarray:
    """``[n]`` bool: whether each row of ``words [n, k]`` is held out for testing (its hash in one bucket of
    ``HELD_OUT``: about one word in eight, fixed by the word alone)."""
    return word_hash(words) % np.uint64(HELD_OUT) == 0


def _draw_words(rng, n: int, length: int, n_symbols: int, split) -> np.ndarray:
    """``[n, length]`` words drawn uniformly from ``split`` (None: all words; "train"/"test": the words
    :func:`is_test_word` says are not / are held out), by rejection."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if split is None:
        return rng.integers(0, n_symbols, size=(n, length), dtype=np.int64)
    kept, have = [], 0
    for _ in range(1000):
        if have >= n:
            break
        words = rng.integers(0, n_symbols, size=(max(64, 2 * HELD_OUT * (n - have)), length), dtype=np.int64)
        words = words[is_test_word(words) == (split == "test")]
        kept.append(words)
        have += len(words)
    else:
        raise ValueError(f"too few {split} words of length {length} over {n_symbols} symbols to draw {n}")
    return np.concatenate(kept)[:n]


def generate_a5(n: int, length: int, *, seed=0, split=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tagging data: inputs ``[n, length + 1]`` = [BOS, g_1..g_k] and targets ``[n, length + 1]`` =
    [-1, g_1, g_1 g_2, ..., g_1 ... g_k] (int64); words from ``split`` (None: all, "train", "test")."""
    _check_sizes(n, length)
    rng = _rng(seed)
    words = _draw_words(rng, n, length, ORDER, split)
    prods = running_products(words)
    inputs = np.concatenate([np.full((n, 1), BOS, dtype=np.int64), words], axis=1)
    targets = np.concatenate([np.full((n, 1), -1, dtype=np.int64), prods], axis=1)
    return torch.from_numpy(inputs), torch.from_numpy(targets)


@functools.lru_cache(maxsize=1)
def generator_elements() -> tuple[int, ...]:
    """Element indices of the 6 generator tokens: g1, g2, g3, g1^-1, g2^-1, g3^-1."""
    gens = [element_index(cycle_to_permutation(c)) for c in GENERATOR_CYCLES]
    inv = inverse_table()
    return tuple(gens + [int(inv[g]) for g in gens])


def generate_a5_identity(n: int, length: int, *, seed=0, balanced: bool = True,
                         split=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Identity variant: inputs ``[n, length + 1]`` = [ID_BOS, generator tokens 0..5] and targets with ID_YES /
    ID_NO at every word position (prefix product == identity?). With ``balanced`` exactly ``n // 2`` words
    (rounded down) multiply to the identity, the rest do not, in random order. Words from ``split`` (None: all,
    "train", "test"; the hash of the generator tokens decides)."""
    _check_sizes(n, length, min_length=2)
    rng = _rng(seed)
    gen_elems = np.asarray(generator_elements(), dtype=np.int64)

    def draw(m):
        toks = _draw_words(rng, m, length, 6, split)
        return toks, running_products(gen_elems[toks])

    if balanced:
        n_yes = n // 2
        yes, no = [], []
        have_yes = have_no = 0
        while have_yes < n_yes or have_no < n - n_yes:
            toks, prods = draw(max(64, 8 * n))
            hit = prods[:, -1] == IDENTITY
            yes.append((toks[hit], prods[hit]))
            no.append((toks[~hit], prods[~hit]))
            have_yes += int(hit.sum())
            have_no += int((~hit).sum())
        toks = np.concatenate([np.concatenate([t for t, _ in yes])[:n_yes],
                               np.concatenate([t for t, _ in no])[: n - n_yes]])
        prods = np.concatenate([np.concatenate([p for _, p in yes])[:n_yes],
                                np.concatenate([p for _, p in no])[: n - n_yes]])
        order = rng.permutation(n)
        toks, prods = toks[order], prods[order]
    else:
        toks, prods = draw(n)
    labels = np.where(prods == IDENTITY, ID_YES, ID_NO)
    inputs = np.concatenate([np.full((n, 1), ID_BOS, dtype=np.int64), toks], axis=1)
    targets = np.concatenate([np.full((n, 1), -1, dtype=np.int64), labels], axis=1)
    return torch.from_numpy(inputs), torch.from_numpy(targets)
