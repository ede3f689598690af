"""Invariants of the state-tracking generators: flip-flop, A5 word problems, MQRAR-N."""

import itertools
import math

import numpy as np
import pytest
import torch

from pathlab.tasks import a5, flipflop, mqrar


# ------------------------------------------------------------------------------------------------- flip-flop


def _last_written_bits(tokens: torch.Tensor) -> list[list[tuple[int, int]]]:
    """(position of the read bit, stored bit) for every read, by a plain left-to-right scan."""
    out = []
    for seq in tokens.tolist():
        stored, reads = None, []
        for p in range(0, len(seq), 2):
            op, bit = seq[p], seq[p + 1]
            if op == flipflop.WRITE:
                stored = bit
            elif op == flipflop.READ:
                reads.append((p + 1, stored))
        out.append(reads)
    return out


@pytest.mark.parametrize("p_ignore", [0.8, 0.98, 0.1])
def test_flipflop_reads_equal_last_write(p_ignore):
    tokens = flipflop.generate_flipflop(64, p_ignore, n_instructions=101, seed=3)
    assert tokens.shape == (64, 202) and tokens.dtype == torch.int64
    assert set(tokens[:, 0::2].unique().tolist()) <= {flipflop.WRITE, flipflop.READ, flipflop.IGNORE}
    assert set(tokens[:, 1::2].unique().tolist()) <= {flipflop.ZERO, flipflop.ONE}
    assert (tokens[:, 0] == flipflop.WRITE).all() and (tokens[:, -2] == flipflop.READ).all()
    n_reads = 0
    for seq, reads in zip(tokens.tolist(), _last_written_bits(tokens)):
        for pos, stored in reads:
            assert stored is not None and seq[pos] == stored
            n_reads += 1
    assert n_reads >= 64  # at least the final read of every sequence


@pytest.mark.parametrize("p_ignore", [0.8, 0.98, 0.1])
def test_flipflop_instruction_frequencies_within_bounds(p_ignore):
    n, n_instr = 400, 256
    tokens = flipflop.generate_flipflop(n, p_ignore, n_instructions=n_instr, seed=11)
    inner = tokens[:, 2:-2:2]  # the free instructions (first is w, last is r)
    m = inner.numel()
    for op, p in ((flipflop.IGNORE, p_ignore), (flipflop.WRITE, (1 - p_ignore) / 2),
                  (flipflop.READ, (1 - p_ignore) / 2)):
        freq = (inner == op).float().mean().item()
        sigma = math.sqrt(p * (1 - p) / m)
        assert abs(freq - p) < 5 * sigma, (op, freq, p)
    # the noise bits after w and i are fair coins
    bits = tokens[:, 1::2][tokens[:, 0::2] != flipflop.READ]
    freq_one = (bits == flipflop.ONE).float().mean().item()
    assert abs(freq_one - 0.5) < 5 * math.sqrt(0.25 / bits.numel())


def test_flipflop_determinism_and_streams():
    a = flipflop.generate_flipflop(8, seed=5)
    assert torch.equal(a, flipflop.generate_flipflop(8, seed=5))
    assert not torch.equal(a, flipflop.generate_flipflop(8, seed=6))
    s1, s2 = flipflop.flipflop_stream(4, seed=1), flipflop.flipflop_stream(4, seed=1)
    b1, b2 = [next(s1) for _ in range(3)], [next(s2) for _ in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(b1, b2))
    assert not torch.equal(b1[0], b1[1])
    ev = flipflop.flipflop_eval_set("sparse", 16, seed=1)
    assert torch.equal(ev, flipflop.flipflop_eval_set("sparse", 16, seed=1))
    assert not any(torch.equal(ev, b[: len(ev)]) for b in b1)


def test_flipflop_targets_and_read_error():
    tokens = flipflop.generate_flipflop(10, seed=2)
    x, y = flipflop.lm_targets(tokens, "clean")
    assert x.shape == y.shape == (10, 511)
    scored = y >= 0
    assert torch.equal(scored, flipflop.read_mask(tokens)[:, :-1])
    assert torch.equal(y[scored], tokens[:, 1:][scored])
    _, y_full = flipflop.lm_targets(tokens, "full")
    assert torch.equal(y_full, tokens[:, 1:])
    # perfect logits: zero errors; flipped read bits: every read wrong
    logits = torch.nn.functional.one_hot(tokens[:, 1:], flipflop.VOCAB_SIZE).float()
    wrong, total = flipflop.read_errors(logits, tokens)
    assert wrong == 0 and total == int(scored.sum())
    flipped = tokens[:, 1:].clone()
    flipped[scored] = flipflop.ZERO + flipflop.ONE - flipped[scored]
    wrong, total = flipflop.read_errors(torch.nn.functional.one_hot(flipped, 5).float(), tokens)
    assert wrong == total


def test_flipflop_bad_input():
    with pytest.raises(ValueError, match="p_ignore"):
        flipflop.generate_flipflop(4, 1.0)
    with pytest.raises(ValueError, match="n_instructions"):
        flipflop.generate_flipflop(4, n_instructions=1)
    with pytest.raises(ValueError, match="loss"):
        flipflop.lm_targets(flipflop.generate_flipflop(1), "read")
    with pytest.raises(ValueError, match="split"):
        flipflop.flipflop_eval_set("medium", 4)


# ------------------------------------------------------------------------------------------------- A5


def test_a5_table_is_the_alternating_group():
    table = a5.multiplication_table()
    a5.verify_group(table)  # closure, identity, cancellation, inverses, associativity on all 60^3 triples
    elems = a5.elements()
    assert len(elems) == 60 == len(set(elems)) and elems[0] == (0, 1, 2, 3, 4)
    # exactly the even permutations of S5
    evens = {p for p in itertools.permutations(range(5))
             if sum(p[i] > p[j] for i in range(5) for j in range(i + 1, 5)) % 2 == 0}
    assert set(elems) == evens
    # the table agrees with composing the permutations directly, on every pair
    for i, j in itertools.product(range(60), repeat=2):
        assert elems[table[i, j]] == tuple(elems[i][elems[j][x]] for x in range(5))
    inv = a5.inverse_table()
    assert (table[np.arange(60), inv] == 0).all()
    assert not (table == table.T).all()  # non-abelian
    # element orders in A5: 1 (x1), 2 (x15), 3 (x20), 5 (x24)
    orders = []
    for g in range(60):
        acc, k = g, 1
        while acc != 0:
            acc, k = table[acc, g], k + 1
        orders.append(k)
    assert sorted(np.bincount(orders).nonzero()[0].tolist()) == [1, 2, 3, 5]
    assert np.bincount(orders)[[1, 2, 3, 5]].tolist() == [1, 15, 20, 24]


def test_verify_group_rejects_a_broken_table():
    table = a5.multiplication_table().copy()
    table[3, 7], table[3, 8] = table[3, 8], table[3, 7]
    with pytest.raises(AssertionError):
        a5.verify_group(table)


def test_a5_targets_are_running_products():
    x, y = a5.generate_a5(50, 13, seed=4)
    assert x.shape == y.shape == (50, 14)
    assert (x[:, 0] == a5.BOS).all() and (y[:, 0] == -1).all()
    assert int(x[:, 1:].max()) < 60 and int(x[:, 1:].min()) >= 0
    elems = a5.elements()
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        acc = elems[0]
        for g, target in zip(row_x[1:], row_y[1:]):
            acc = a5.compose(acc, elems[g])  # left fold, acc * g
            assert elems[target] == acc
    assert torch.equal(x, a5.generate_a5(50, 13, seed=4)[0])
    assert not torch.equal(x, a5.generate_a5(50, 13, seed=5)[0])


def test_a5_identity_variant_balanced_and_correct():
    x, y = a5.generate_a5_identity(40, 9, seed=0)
    assert x.shape == y.shape == (40, 10)
    assert int((y[:, -1] == a5.ID_YES).sum()) == 20 and int((y[:, -1] == a5.ID_NO).sum()) == 20
    gens = [a5.cycle_to_permutation(c) for c in a5.GENERATOR_CYCLES]
    inverses = [tuple(np.argsort(p).tolist()) for p in gens]
    perms = gens + inverses
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        assert row_x[0] == a5.ID_BOS
        acc = (0, 1, 2, 3, 4)
        for tok, lab in zip(row_x[1:], row_y[1:]):
            acc = a5.compose(acc, perms[tok])
            assert lab == (a5.ID_YES if acc == (0, 1, 2, 3, 4) else a5.ID_NO)
    assert cycle_sanity(gens)


def cycle_sanity(gens) -> bool:
    # each generator is a 3-cycle: order 3, fixes two points
    return all(a5.compose(g, a5.compose(g, g)) == (0, 1, 2, 3, 4) and sum(g[i] == i for i in range(5)) == 2
               for g in gens)


def _word_set(x: torch.Tensor) -> set:
    return set(map(tuple, x[:, 1:].tolist()))


@pytest.mark.parametrize("variant", ["tagging", "identity"])
def test_a5_train_and_test_words_never_overlap(variant):
    """At k = 3 (216,000 words; for the identity variant k = 4, 1296 words) a training stream of 100,000 words
    covers a third of the test words or more unless the split holds them out; the negative control (split=None)
    shows the overlap this test would catch."""
    gen, k = (a5.generate_a5, 3) if variant == "tagging" else (a5.generate_a5_identity, 4)
    test = _word_set(gen(2000, k, seed=1, split="test")[0])
    train = _word_set(gen(100_000, k, seed=2, split="train")[0])
    leaky = _word_set(gen(100_000, k, seed=2)[0])
    assert test and not test & train
    assert len(test & leaky) > len(test) // 4
    assert a5.is_test_word(np.array(sorted(test))).all() and not a5.is_test_word(np.array(sorted(train))).any()


def test_a5_task_trains_and_evaluates_on_disjoint_words():
    from pathlab.tasks.settings import resolve_settings
    from pathlab.tasks.specs import TASKS

    s = resolve_settings("a5", preset="tiny-cpu", overrides={"length": 3})
    task = TASKS["a5"]
    test = _word_set(task.eval_sets(s, False)["test"][0])
    train = set().union(*(_word_set(task.train_batch(s, step)[0]) for step in range(50)))
    assert test and train and not test & train


def test_a5_word_hash_is_fixed():
    """The split is a function of the word alone: pinned values, so that a change of the hash (which would move
    words between the splits of earlier results) fails here."""
    words = np.array([[0, 1, 2], [59, 59, 59], [7, 0, 0]])
    assert a5.word_hash(words).tolist() == [18031394344351942275, 7064108328896554264, 4828809168341235857]
    draws = np.random.default_rng(0).integers(0, 60, size=(200_000, 5))
    assert abs(a5.is_test_word(draws).mean() - 1 / a5.HELD_OUT) < 0.005


def test_a5_split_errors():
    with pytest.raises(ValueError, match="split"):
        a5.generate_a5(3, 4, split="validation")
    with pytest.raises(ValueError, match="too few"):  # one word of one symbol: one split of the two is empty
        a5._draw_words(np.random.default_rng(0), 2, 1, 1, "train" if a5.is_test_word(np.zeros((1, 1))) else "test")


def test_a5_bad_input():
    with pytest.raises(ValueError, match="length"):
        a5.generate_a5(3, 0)
    with pytest.raises(ValueError, match="length"):
        a5.generate_a5_identity(3, 1)
    with pytest.raises(ValueError, match="even permutation"):
        a5.element_index((1, 0, 2, 3, 4))


# ------------------------------------------------------------------------------------------------- MQRAR-N


@pytest.mark.parametrize("n_back", [1, 2, 3, 4])
def test_mqrar_labels_match_brute_force(n_back):
    x, y = mqrar.generate_mqrar(6, n_back, seed=n_back)
    assert x.shape == y.shape == (6, 768)
    for row_x, row_y in zip(x, y):
        answers = row_y[row_y >= 0].tolist()
        assert answers == mqrar.nth_recent_brute_force(row_x, n_back)
        assert all(a >= 512 for a in answers)  # every query has an N-th most recent value
        keys = set(row_x[0::2].tolist())
        assert len(keys) == 32 and all(1 <= k < 512 for k in keys)
        qpos = (row_x == mqrar.QUERY).nonzero().flatten()
        assert torch.equal(qpos, (row_y >= 0).nonzero().flatten())
        assert (qpos % 2 == 1).all() and (qpos >= 2 * 32 * n_back).all()


def test_mqrar_prefix_assigns_every_key_each_round_and_query_rate():
    n_back = 3
    x, y = mqrar.generate_mqrar(200, n_back, seed=0)
    for r in range(n_back):
        round_keys = x[:, 64 * r:64 * (r + 1):2]
        assert all(len(set(row.tolist())) == 32 for row in round_keys)
    body_values = x[:, 2 * 32 * n_back + 1::2]
    frac_query = (body_values == mqrar.QUERY).float().mean().item()
    m = body_values.numel()
    assert abs(frac_query - 0.5) < 5 * math.sqrt(0.25 / m)


def test_mqrar_determinism_small_settings_and_bad_input():
    a = mqrar.generate_mqrar(3, 2, n_pairs=4, length=40, vocab_size=32, seed=9)
    b = mqrar.generate_mqrar(3, 2, n_pairs=4, length=40, vocab_size=32, seed=9)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for row_x, row_y in zip(*a):
        assert row_y[row_y >= 0].tolist() == mqrar.nth_recent_brute_force(row_x, 2)
    with pytest.raises(ValueError, match="n_back"):
        mqrar.generate_mqrar(1, 0)
    with pytest.raises(ValueError, match="length"):
        mqrar.generate_mqrar(1, 4, n_pairs=32, length=256)
    with pytest.raises(ValueError, match="vocab_size"):
        mqrar.generate_mqrar(1, 1, vocab_size=31)


def test_mqrar_answer_accuracy():
    x, y = mqrar.generate_mqrar(2, 1, seed=0)
    perfect = torch.nn.functional.one_hot(y.clamp(min=0), 1024).float()
    correct, total = mqrar.answer_accuracy(perfect, y)
    assert correct == total == int((y >= 0).sum()) > 0
    correct, _ = mqrar.answer_accuracy(torch.zeros_like(perfect), y)  # argmax 0 = the query marker, never right
    assert correct == 0


def test_mqrar_blind_baselines_by_hand():
    # keys 1, 2; values 4..7 (V = 8). Steps: 1←4, 2←5, 2←5, then "1 ?" (answer 4) and "2 ?" (answer 5).
    x = torch.tensor([[1, 4, 2, 5, 2, 5, 1, 0, 2, 0]])
    y = torch.tensor([[-1, -1, -1, -1, -1, -1, -1, 4, -1, 5]])
    assert mqrar.nth_recent_brute_force(x[0], 1) == [4, 5]
    got = mqrar.blind_baselines(x, y, 1)
    # most frequent value so far is 5 (twice): wrong for key 1, right for key 2
    assert got["frequent_value"] == pytest.approx(0.5)
    # table of current values {1: 4, 2: 5}: a tie of two, either answer half right
    assert got["key_blind"] == pytest.approx(0.5)
    # the mode is guessed, not a value drawn in proportion to its count (which would score 1/3 on "1 ?")
    assert mqrar.blind_baselines(x[:, :8], y[:, :8], 1)["frequent_value"] == 0.0
    # N = 2 after 1←4, 2←5, 2←5 and "2 ?": only key 2 has a second value, so the table is {5}: always right
    x2 = torch.tensor([[1, 4, 2, 5, 2, 5, 2, 0]])
    y2 = torch.tensor([[-1, -1, -1, -1, -1, -1, -1, 5]])
    assert mqrar.nth_recent_brute_force(x2[0], 2) == [5]
    assert mqrar.blind_baselines(x2, y2, 2)["key_blind"] == pytest.approx(1.0)
    # a query without a target is not scored; one with nothing to guess from yet (no key has two values) scores 0
    x3, y3 = torch.tensor([[1, 0, 1, 4, 1, 0]]), torch.tensor([[-1, -1, -1, -1, -1, 4]])
    assert mqrar.blind_baselines(x3, y3, 1) == {"frequent_value": 1.0, "key_blind": 1.0}
    assert mqrar.blind_baselines(x3, y3, 2)["key_blind"] == 0.0


def test_mqrar_blind_baselines_sit_between_chance_and_recall():
    x, y = mqrar.generate_mqrar(40, 2, vocab_size=256, seed=3)
    got = mqrar.blind_baselines(x, y, 2)
    chance = 1 / 128
    assert chance < got["frequent_value"] < got["key_blind"] < 0.2
    with pytest.raises(ValueError, match="both be"):
        mqrar.blind_baselines(x[0], y, 2)
