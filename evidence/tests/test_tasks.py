"""Invariants of the benchmark task generators, their train/test streams, and the metrics
(the harness that trains on them: tests/test_harness.py)."""

import numpy as np
import pytest
import torch

from evidence import train
from evidence.tasks import IGNORE, Scores, draw, make_task, split_of, split_rng, validation_set, train_batches
from evidence.tasks.groups import GROUPS, group_table, permutation_elements, permutation_table, running_product
from evidence.tasks.mad import MAD_BASELINES, mad_task

ORDERS = {"a5": 60, "s5": 120, "a4xz5": 60, "z60": 60}


def small(name, **kw):
    """A task at a cheap size: short groups/MQAR, MAD with a small training pool."""
    if name in GROUPS:
        return make_task(name, seq_len=12, num_test=64)
    if name == "mqar":
        return make_task("mqar", seq_len=64, num_kv_pairs=8, vocab_size=64, num_test=64)
    return mad_task(name, num_train=64, num_test=64, **kw)


ALL = [*GROUPS, "mqar", *MAD_BASELINES]


# ---------------------------------------------------------------- groups


@pytest.mark.parametrize("group", GROUPS)
def test_group_table_is_a_group(group):
    t = group_table(group)
    g = ORDERS[group]
    assert t.shape == (g, g)
    assert t.min() >= 0 and t.max() < g                                   # closure
    assert (t[0] == np.arange(g)).all() and (t[:, 0] == np.arange(g)).all()  # 0 is the identity
    for row in (t, t.T):                                                    # Latin square: inverses
        assert all(len(set(r)) == g for r in row)
    a, b, c = np.meshgrid(np.arange(g), np.arange(g), np.arange(g), indexing="ij")
    assert (t[t[a, b], c] == t[a, t[b, c]]).all()                          # associativity


def test_group_structure():
    center = lambda t: [x for x in range(len(t)) if (t[x] == t[:, x]).all()]  # noqa: E731
    assert center(group_table("a5")) == [0]            # A5: trivial centre, non-abelian
    assert len(center(group_table("a4xz5"))) == 5      # A4 x Z5: centre Z5, so not A5
    assert len(center(group_table("z60"))) == 60       # abelian
    assert len(center(group_table("s5"))) == 1
    parity = lambda p: sum(p[i] > p[j] for i in range(5) for j in range(i + 1, 5)) % 2  # noqa: E731
    assert all(parity(p) == 0 for p in permutation_elements(5, even_only=True))
    with pytest.raises(ValueError, match="closed"):
        permutation_table(permutation_elements(5, even_only=False)[:7])


@pytest.mark.parametrize("group", ["a5", "s5"])
def test_running_product_composes_permutations(group):
    elements = permutation_elements(5, even_only=group == "a5")
    x, y = make_task(group, seq_len=9).generate(np.random.default_rng(3), 16, True)
    assert (running_product(group_table(group), x) == y).all()
    for row_x, row_y in zip(x, y):
        acc = np.arange(5)
        for tok, want in zip(row_x, row_y):
            acc = acc[elements[tok]]                     # (P * g)(i) = P[g[i]]
            assert (acc == elements[want]).all()


def test_a4xz5_and_z60_products():
    x, y = make_task("z60", seq_len=20).generate(np.random.default_rng(0), 8, True)
    assert (y == np.cumsum(x, 1) % 60).all()
    x, y = make_task("a4xz5", seq_len=20).generate(np.random.default_rng(0), 8, True)
    assert (y % 5 == np.cumsum(x % 5, 1) % 5).all()      # the Z5 component adds up


# ---------------------------------------------------------------- MQAR


def test_mqar_labels_keys_values():
    task = make_task("mqar", seq_len=128, num_kv_pairs=16, vocab_size=256)
    x, y = task.generate(np.random.default_rng(1), 64, False)
    P, V = 16, 256
    keys, values = x[:, 0 : 2 * P : 2], x[:, 1 : 2 * P : 2]
    assert ((keys >= 1) & (keys < V // 2)).all() and ((values >= V // 2) & (values < V)).all()
    assert all(len(set(r)) == P for r in keys) and all(len(set(r)) == P for r in values)
    labelled = y != IGNORE
    assert (labelled.sum(1) == P).all()
    assert not labelled[:, : 2 * P].any()                          # only after the context
    rows, cols = np.nonzero(labelled)
    assert ((cols - 2 * P) % 2 == 0).all()                         # even offsets
    for r in range(x.shape[0]):
        pos = np.nonzero(labelled[r])[0]
        asked = dict(zip(keys[r], values[r]))
        assert sorted(x[r, pos]) == sorted(keys[r])                # every key asked once
        assert all(y[r, p] == asked[x[r, p]] for p in pos)         # label = the key's value


def test_mqar_power_law_puts_queries_early():
    task = make_task("mqar", seq_len=512, num_kv_pairs=8, vocab_size=512)
    x, y = task.generate(np.random.default_rng(2), 256, False)
    slots = (np.nonzero(y != IGNORE)[1] - 16) // 2
    assert np.mean(slots < 62) > 0.5 + 0.05                         # denser than uniform early
    with pytest.raises(ValueError, match="num_kv_pairs"):
        make_task("mqar", seq_len=60, num_kv_pairs=16)


@pytest.mark.parametrize("filler", ["random", "zero"])
def test_mqar_answer_is_in_the_causal_prefix(filler):
    """What a perfect recaller sees: at every scored position t, the label is the token right after
    the first earlier occurrence of inputs[t] (the key in the context), so the task is solvable
    from inputs[:t + 1] with no shift; and the value is never shown after the query."""
    task = make_task("mqar", seq_len=64, num_kv_pairs=8, vocab_size=64, filler=filler)
    x, y = task.generate(np.random.default_rng(3), 128, True)
    for r, t in zip(*np.nonzero(y != IGNORE)):
        first = int(np.flatnonzero(x[r, :t] == x[r, t])[0])
        assert first < 16 and first % 2 == 0 and y[r, t] == x[r, first + 1]
        assert filler == "random" or x[r, t + 1] == 0                 # odd offset: filler


def test_mqar_zero_filler_is_zoologys_layout():
    task = make_task("mqar", seq_len=16, num_kv_pairs=3, vocab_size=16, power_a=0.5, filler="zero")
    x, y = task.generate(np.random.default_rng(3), 1, True)            # the module doc's example
    assert x[0].tolist() == [1, 10, 5, 8, 2, 11, 0, 0, 1, 0, 2, 0, 0, 0, 5, 0]
    assert {int(t): int(y[0, t]) for t in np.flatnonzero(y[0] != IGNORE)} == {8: 10, 10: 11, 14: 8}
    x, y = make_task("mqar", seq_len=128, num_kv_pairs=16, vocab_size=256, filler="zero").generate(
        np.random.default_rng(4), 32, True)
    assert ((x[:, 32:] == 0) == (y[:, 32:] == IGNORE)).all()          # 0 exactly off the queries
    with pytest.raises(ValueError, match="filler"):
        make_task("mqar", seq_len=64, num_kv_pairs=8, filler="noise")


@pytest.mark.slow  # about 2.5 s of training
def test_mqar_attention_learns_a_tiny_instance_on_cpu(tmp_path):
    """The harness end to end (labels, loss, scoring): a small attention model must get far above
    chance (1/16 of the values) on a tiny MQAR within a few hundred steps (it stops at the
    threshold, 0.6, after 250 of its 400)."""
    argv = ["--task", "mqar", "--len", "32", "--kv-pairs", "4", "--vocab", "32", "--filler", "zero",
            "--mixer", "attention", "--layers", "2", "--d-model", "32", "--steps", "400",
            "--batch", "32", "--lr", "3e-3", "--eval-every", "50", "--eval-size", "256",
            "--threshold", "0.6", "--device", "cpu", "--no-progress", "--weight-init", "torch"]
    record = train.main([*argv, "--out", str(tmp_path / "mqar.json")])   # N(0, 0.02) is slow at width 32
    assert record["best_token_acc"] > 0.5


# ---------------------------------------------------------------- MAD


@pytest.mark.parametrize("name", ["in_context_recall", "noisy_recall"])
def test_recall_labels_repeat_the_stored_value(name):
    task = small(name)
    cfg = MAD_BASELINES[name]
    ns = cfg["vocab_size"] - cfg.get("noise_vocab_size", 0)
    rng = np.random.default_rng(4)
    x, y = task.generate(rng, 32, False)
    xt, yt = task.generate(np.random.default_rng(4), 32, True)
    assert x.shape == (32, cfg["seq_len"] - 1) and (xt == x).all()
    assert (yt[:, :-1] == x[:, 1:]).all()                         # training: next token everywhere
    for row_x, row_y in zip(x, y):
        tokens = list(row_x) + [row_y[-1]]
        seen = {}
        for i in range(0, len(tokens) - 1, 2):
            k, v = tokens[i], tokens[i + 1]
            if k >= ns:                                            # a noise pair: never scored
                assert v >= ns and row_y[i] == IGNORE
                continue
            assert k < ns // 2 <= v < ns                           # disjoint key/value halves
            assert row_y[i] == (seen[k] if k in seen else IGNORE)
            assert seen.setdefault(k, v) == v                      # one value per key
        assert row_y[-1] != IGNORE                                 # the final probe is scored


def test_fuzzy_recall_scores_values_of_repeated_keys():
    task = small("fuzzy_recall")
    x, y = task.generate(np.random.default_rng(5), 16, False)
    pad = 15
    assert x.shape == (16, 128)
    scored = y[y != IGNORE]
    assert ((scored >= 7) & (scored < pad)).all()
    assert (y[:, -1] != IGNORE).all()
    xt, yt = task.generate(np.random.default_rng(5), 16, True)
    assert (yt[:, :-1] == xt[:, 1:]).all()
    assert (x[:, 0] == pad).mean() > 0                             # left padding happens


def test_selective_copying_targets_the_scattered_tokens():
    task = small("selective_copying")
    x, y = task.generate(np.random.default_rng(6), 16, False)
    blank, copy, k = 14, 15, 16
    for row_x, row_y in zip(x, y):
        start = int(np.nonzero(row_x == copy)[0][0])
        assert start == 256 - k - 1
        kept = row_x[:start][row_x[:start] != blank]
        assert (row_y[start + 1 :] == kept).all() and (row_y[: start + 1] == IGNORE).all()
        assert (row_x[start + 1 :] == blank).all()
    with pytest.raises(ValueError, match="seq_len must be at least .* = 33"):
        mad_task("selective_copying", seq_len=32)


def test_compression_and_memorization():
    task = small("compression")
    assert task.head == "autoencoder"
    x, y = task.generate(np.random.default_rng(7), 8, False)
    assert (x[:, -1] == 15).all() and (x[:, :-1] < 15).all() and (x == y).all()
    mem = small("memorization")
    values = mem.value_map()
    assert len(set(values)) == len(values) == 127 and values.min() >= 127 and values.max() < 255
    assert (mad_task("memorization", kv_seed=12345).value_map() == values).all()
    x, y = mem.generate(np.random.default_rng(8), 8, False)
    assert (x[:, 1::2] == 255).all() and (y[:, 0::2] == IGNORE).all()
    assert (y[:, 1::2] == values[x[:, 0::2]]).all()


# ---------------------------------------------------------------- splits and seeds


@pytest.mark.parametrize("name", ALL)
def test_splits_disjoint_and_deterministic(name):
    task = small(name)
    xs, ys = validation_set(task, seed=0)
    xs2, ys2 = validation_set(task, seed=0)
    assert (xs == xs2).all() and (ys == ys2).all()                 # determinism by seed
    assert not (validation_set(task, seed=1)[0] == xs).all()
    xb, _ = next(train_batches(task, 0, 16))
    assert (split_of(xs) == 1).all() and (split_of(xb) == 0).all()
    assert not {r.tobytes() for r in xs} & {r.tobytes() for r in xb}
    assert xs.shape == (64, task.seq_len) and xs.min() >= 0 and xs.max() < task.vocab_size
    targets = ys[ys != IGNORE]
    assert targets.min() >= 0 and targets.max() < task.vocab_size


def test_disjoint_on_a_small_space():
    task = make_task("z60", seq_len=3)                             # 216000 sequences in all
    xs, _ = draw(task, split_rng(0, "test"), 20000, "test")
    xt, _ = draw(task, split_rng(0, "train"), 20000, "train")
    assert not {r.tobytes() for r in xs} & {r.tobytes() for r in xt}
    with pytest.raises(ValueError, match="split"):
        split_rng(0, "valid")


@pytest.mark.parametrize("name,batch", [("a5", 16), ("memorization", 24), ("memorization", 100)])
def test_train_stream_resumes_from_its_state(name, batch, tmp_path):
    """A stream restored from a saved ``state_dict`` serves what the original serves next (fresh
    batches, a pool served in epochs, a batch larger than the pool)."""
    task = small(name)
    first = train_batches(task, 0, batch)
    for _ in range(5):
        next(first)
    torch.save(first.state_dict(), tmp_path / "stream.pt")
    second = train_batches(task, 0, batch)
    second.load_state_dict(torch.load(tmp_path / "stream.pt", weights_only=True))
    for _ in range(5):
        (xa, ya), (xb, yb) = next(first), next(second)
        assert (xa == xb).all() and (ya == yb).all()


def test_fixed_pool_serves_epochs():
    task = small("memorization")                                   # num_train = 64
    batches = train_batches(task, 0, 32)
    first = np.concatenate([next(batches)[0] for _ in range(2)])
    second = np.concatenate([next(batches)[0] for _ in range(2)])
    key = lambda a: sorted(r.tobytes() for r in a)                 # noqa: E731
    assert key(first) == key(second) and len(set(key(first))) == 64


# ---------------------------------------------------------------- metrics


def test_scores():
    pred = torch.tensor([[1, 2, 3, 0], [1, 1, 1, 1], [5, 5, 5, 5]])
    targ = torch.tensor([[1, 2, 0, IGNORE], [1, IGNORE, IGNORE, IGNORE], [IGNORE] * 4])
    s = Scores(6)
    s.update(pred, targ)
    r = s.result()
    assert r["token_acc"] == pytest.approx(3 / 4)
    assert r["seq_acc"] == pytest.approx(1 / 2)                    # row 3 has nothing scored
    assert r["mean_seq_acc"] == pytest.approx((2 / 3 + 1) / 2)
    assert r["macro_acc"] == pytest.approx((1 + 1 + 0) / 3)        # classes 0, 1, 2
