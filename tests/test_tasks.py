"""Invariants of the benchmark task generators, the metrics, and a CPU smoke run of the harness."""

import json
from itertools import product

import numpy as np
import pytest
import torch

from benchmarks import plots, protocols, train
from benchmarks.tasks import IGNORE, Scores, draw, make_task, split_of, split_rng, validation_set, train_batches
from benchmarks.tasks.groups import (
    GROUPS, group_table, permutation_elements, permutation_table, running_product,
)
from benchmarks.tasks.mad import MAD_BASELINES, mad_task

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


def test_mqar_attention_learns_a_tiny_instance_on_cpu(tmp_path):
    """The harness end to end (labels, loss, scoring): a small attention model must get far above
    chance (1/16 of the values) on a tiny MQAR within a few hundred steps."""
    argv = ["--task", "mqar", "--len", "32", "--kv-pairs", "4", "--vocab", "32", "--filler", "zero",
            "--mixer", "attention", "--layers", "2", "--d-model", "32", "--steps", "400",
            "--batch", "32", "--lr", "3e-3", "--eval-every", "50", "--eval-size", "256",
            "--threshold", "0.9", "--device", "cpu", "--no-progress"]
    record = train.main([*argv, "--out", str(tmp_path / "mqar.json")])
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


# ---------------------------------------------------------------- harness


def test_autoencoder_and_noise_zero_models():
    args = train.parse_args(["--task", "compression", "--mixer", "kla", "--layers", "1",
                             "--d-model", "16", "--d-state", "4", "--noise-zero"])
    task = small("compression")
    model = train.build_model(task, args)
    logits = model(torch.from_numpy(task.generate(np.random.default_rng(0), 2, False)[0]))
    assert logits.shape == (2, 32, 16)
    kla = model.encoder.blocks[0].mixer
    assert not kla.log_sigma.requires_grad and (kla.discretized()[1] == 0).all()
    groups = train.param_groups(model, 0.1)
    decayed = {id(p) for p in groups[0]["params"]}
    assert id(kla.log_dt) not in decayed and id(kla.in_proj.weight) in decayed
    with pytest.raises(ValueError, match="noise-zero"):
        train.build_model(task, train.parse_args(["--task", "compression", "--mixer", "attention",
                                                  "--layers", "1", "--d-model", "16", "--noise-zero"]))


def test_protocol_commands():
    runs = protocols.a5_min_depth(lengths=(16, 32), depths=(1, 2), mixers=("kla", "gla"), steps=10)
    assert len(runs) == 2 * 2 * 2 + 2                              # plus Z60 at depth 1 per mixer
    labels = {r.label for r in runs}
    assert len(labels) == len(runs)
    args = train.parse_args(runs[0].argv)
    assert args.task in ("a5", "z60") and args.steps == 10
    for spec in protocols.MIXER_SPECS:
        train.parse_args(["--task", "a5", *protocols.MIXER_SPECS[spec]])
    assert len(protocols.ou_ablation(depths=(2, 4, 8))) == 6
    assert len(protocols.mqar_protocol(mixers=("kla",))) == 2 * 2 * 2
    assert len(protocols.mad_protocol(mixers=("kla",))) == 6
    tagged = protocols.with_kla_options(runs, ["backend=torch"])
    assert all(("backend=torch" in r.argv) == ("kla" in r.argv) for r in tagged)


def test_a5_protocol_no_control(capsys):
    base = ["a5", "--lengths", "16", "--depths", "1", "--mixers", "kla", "attention", "--dry-run"]
    protocols.main(base)
    assert sum("--task z60" in line for line in capsys.readouterr().out.splitlines()) == 2
    protocols.main([*base, "--no-control"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all("--task a5" in line for line in lines)


def test_ou_protocol_task_option(capsys):
    protocols.main(["ou", "--dry-run"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6 and all("--task a5 --len 64" in line for line in lines)
    protocols.main(["ou", "--task", "in_context_recall", "--depths", "2", "--dry-run"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all("--len" not in line for line in lines)    # the MAD length
    assert "ou_in_context_recall_n2_kla_zoh_s0.json" in lines[1]
    assert "discretization=zoh" in lines[1] and "discretization" not in lines[0]
    with pytest.raises(ValueError, match="ou"):
        protocols.main(["mad", "--task", "compression", "--dry-run"])


def test_launch_smoke_run_on_cpu_and_failures(tmp_path):
    """End to end: a 3-step KLA run with a two-rate sweep, launched as a process, writes its JSON."""
    argv = ["--task", "a5", "--len", "8", "--mixer", "kla", "--layers", "1", "--d-model", "16",
            "--d-state", "4", "--steps", "3", "--batch", "4", "--eval-every", "2",
            "--eval-size", "8", "--lrs", "1e-3,3e-3", "--device", "cpu"]
    (saved,) = protocols.launch([protocols.Run("ok", argv)], str(tmp_path), poll_s=0.1)
    assert saved["label"] == "a5_L8_kla_n1_d16_s0" and saved["device"] == "cpu" and saved["commit"]
    assert json.loads((tmp_path / "ok.json").read_text())["best_lr"] == saved["best_lr"]
    assert [r["lr"] for r in saved["runs"]] == [1e-3, 3e-3]
    assert all(r["steps_run"] == 3 and r["stopped"] == "steps" for r in saved["runs"])
    assert 0 <= saved["best_token_acc"] <= 1 and saved["config"]["seed"] == 0
    bad = protocols.launch([protocols.Run("bad", argv)] * 2, str(tmp_path / "b"), parallel=2,
                           poll_s=0.1, python="false")               # an interpreter that fails
    assert all(r["returncode"] != 0 for r in bad) and (tmp_path / "b" / "bad.log").exists()


TINY_A5 = ["--task", "a5", "--len", "8", "--mixer", "kla", "--layers", "1", "--d-model", "16",
           "--d-state", "4", "--steps", "7", "--batch", "4", "--eval-every", "2", "--eval-size", "8",
           "--device", "cpu", "--no-progress"]


def test_paused_and_resumed_run_equals_an_uninterrupted_one(tmp_path):
    """Paused after 3 and 6 of 7 steps (between and at evaluations), resumed twice: the same
    history, record and bitwise the same weights as one uninterrupted run."""
    def run(name, *extra):
        return train.main([*TINY_A5, "--out", str(tmp_path / f"{name}.json"), *extra])["runs"][0]

    whole = run("whole", "--checkpoint", str(tmp_path / "whole.pt"))
    plain = run("plain")
    part = ["--checkpoint", str(tmp_path / "part.pt")]
    first = run("part", *part, "--stop-after-steps", "3")
    assert first["stopped"] == "paused" and first["steps_run"] == 3 and first["calibration"] is None
    assert run("part", *part, "--stop-after-steps", "3")["steps_run"] == 6
    resumed = run("part", *part)
    assert resumed["stopped"] == "steps" and resumed["steps_run"] == 7
    assert resumed["history"] == whole["history"] == plain["history"] and len(whole["history"]) == 4
    drop = lambda r: {k: v for k, v in r.items() if k != "wall_s"}          # noqa: E731
    assert drop(resumed) == drop(whole) == drop(plain)
    saved = [torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in ("whole", "part")]
    assert all(s["finished"] and "optimizer" not in s for s in saved)
    assert saved[0]["model"].keys() == saved[1]["model"].keys()
    assert all(torch.equal(saved[0]["model"][k], saved[1]["model"][k]) for k in saved[0]["model"])
    assert run("part", *part) == resumed                                     # finished: no training


def test_checkpoint_argument_checks(tmp_path):
    ck = ["--checkpoint", str(tmp_path / "ck.pt")]
    train.main([*TINY_A5, *ck, "--stop-after-steps", "1", "--out", str(tmp_path / "ck.json")])
    for wrong, name in ((["--lr", "3e-3"], "--lr"), (["--steps", "9"], "--steps"),
                        (["--seed", "1"], "--seed"), (["--mixer", "gla"], "--mixer")):
        with pytest.raises(ValueError, match=f"{name} "):
            train.main([*TINY_A5, *ck, *wrong, "--out", str(tmp_path / "no.json")])
    moved = train.main([*TINY_A5, *ck, "--lrs", "1e-3", "--out", str(tmp_path / "moved.json")])
    assert moved["runs"][0]["stopped"] == "steps"                            # same rate, other flag
    with pytest.raises(ValueError, match="single learning rate"):
        train.parse_args([*TINY_A5, *ck, "--lrs", "1e-3,3e-3"])
    with pytest.raises(ValueError, match="time-limit"):
        train.parse_args([*TINY_A5, *ck, "--time-limit", "60"])
    with pytest.raises(ValueError, match="needs --checkpoint"):
        train.parse_args([*TINY_A5, "--stop-after", "60"])


def test_protocol_checkpoint_options(capsys, tmp_path):
    base = ["a5", "--lengths", "16", "--depths", "1", "2", "--mixers", "kla", "--no-control",
            "--out-dir", "out", "--dry-run"]
    protocols.main([*base, "--checkpoint-dir", "ck", "--stop-after", "480"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    for line, label in zip(lines, ("a5_L16_n1_kla_s0", "a5_L16_n2_kla_s0")):
        assert line.endswith(f"--out out/{label}.json --no-progress --checkpoint ck/{label}.pt "
                             "--stop-after 480")
    with pytest.raises(ValueError, match="needs --checkpoint-dir"):
        protocols.main([*base, "--stop-after", "480"])
    with pytest.raises(ValueError, match="single learning rate"):
        protocols.main(["mad", "--mixers", "kla", "--checkpoint-dir", "ck", "--dry-run"])
    with pytest.raises(ValueError, match="time-limit"):
        protocols.main([*base, "--checkpoint-dir", "ck", "--time-limit", "100"])
    runs = [protocols.Run("x", TINY_A5)]
    assert protocols.launch(runs, str(tmp_path), checkpoint_dir=str(tmp_path), stop_after=10) == [
        {"label": "x", "stopped": "not started"}]                          # under MIN_START_S left


def test_schedule():
    assert train.lr_factor(0.0, 0.1) == 0.0 and train.lr_factor(0.1, 0.1) == pytest.approx(1.0)
    assert train.lr_factor(0.05, 0.1) == pytest.approx(0.5) and train.lr_factor(1.0, 0.1) == pytest.approx(0.0)
    assert train.schedule_progress(10, 100, 30.0, 60.0) == pytest.approx(0.5)   # time dominates
    assert train.schedule_progress(10, 100, 30.0, None) == pytest.approx(0.1)


def _fake(mixer, depth, length, acc, noise_zero=False):
    run = {"lr": 1e-3, "steps_run": 100, "stopped": "threshold" if acc > 0.9 else "time"}
    return {"task": "a5", "mixer": mixer, "noise_zero": noise_zero, "mixer_opts": {}, "layers": depth,
            "seq_len": length, "solved": acc > 0.9, "best_token_acc": acc, "best_lr": 1e-3,
            "runs": [run]}


def test_min_depth_table_and_plot(tmp_path):
    results = [_fake("kla", 1, 16, 0.95), _fake("kla", 2, 16, 0.97), _fake("kla", 1, 32, 0.5),
               _fake("kla", 2, 32, 0.93), _fake("gla", 1, 16, 0.4), _fake("gla", 2, 16, 0.6),
               _fake("kla", 1, 16, 0.1, noise_zero=True)]
    table = plots.min_depths(results)
    assert table == {"kla": {16: 1, 32: 2}, "gla": {16: None}, "kla_noise0": {16: None}}
    md = plots.accuracy_markdown(results)
    assert "| kla | 1 | 95.0 ✓ [100] | 50.0 [100] |" in md
    assert "| gla | > 2 |" in plots.min_depth_markdown(results)
    for i, r in enumerate(results):
        (tmp_path / f"{i}.json").write_text(json.dumps(r))
    cal = {"error_rate": 0.2, "mean_var_wrong": 0.5, "mean_var_correct": 0.25, "auroc_var": 0.7,
           "auroc_var_by_position": 0.6, "auroc_confidence": None}
    results[0]["runs"][0]["calibration"] = cal
    assert "| kla | 1 | 16 | 0.200 | 0.5 / 0.25 | 0.700 | 0.600 | – |" in plots.calibration_markdown(results)
    several = plots.calibration_markdown(results, tasks=("z60", "a5")).splitlines()
    assert several[0].startswith("| task | mixer |") and several[1].count("|---") == 9
    assert several[2:] == ["| a5 | kla | 1 | 16 | 0.200 | 0.5 / 0.25 | 0.700 | 0.600 | – |"]
    png = tmp_path / "a5.png"
    for r in results:
        r["runs"][0]["history"] = [[50, 4.0, 0.05], [100, 3.0, r["best_token_acc"]]]
    for i, r in enumerate(results):
        (tmp_path / f"{i}.json").write_text(json.dumps(r))
    curves = tmp_path / "curves.png"
    text = plots.main(["a5", str(tmp_path), "--png", str(png), "--curves", str(curves)])
    assert png.stat().st_size > 1000 and curves.stat().st_size > 1000 and "kla_noise0" in text


def _fake_task(task, mixer, acc, d_model=128, length=128):
    best = {"token_acc": acc, "macro_acc": acc / 2, "mean_seq_acc": acc, "step": 100}
    run = {"lr": 1e-3, "steps_run": 200, "stopped": "time", "best": best, "final_loss": 2.0,
           "n_params": 1000, "history": [], "calibration": None}
    return {"task": task, "mixer": mixer, "noise_zero": False, "mixer_opts": {}, "layers": 2,
            "seq_len": length, "d_model": d_model, "config": {"kv_pairs": 64},
            "solved": acc >= 0.99, "best_token_acc": acc, "best_lr": 1e-3, "runs": [run]}


def test_mad_and_mqar_tables(tmp_path):
    results = [_fake_task("fuzzy_recall", "kla", 0.5), _fake_task("compression", "kla", 1.0),
               _fake_task("fuzzy_recall", "gla", 0.25)]
    md = plots.mad_markdown(results)
    assert "| mixer | fuzzy recall | compression | mean |" in md
    assert "| kla | 50.0 / 25.0 [200] | 100.0 / 50.0 ✓ [200] | 75.0 |" in md
    assert "| gla | 25.0 / 12.5 [200] | – | – |" in md
    for i, r in enumerate(results):
        (tmp_path / f"{i}.json").write_text(json.dumps(r))
    png = tmp_path / "mad.png"
    plots.main(["mad", str(tmp_path), "--png", str(png)])
    assert png.stat().st_size > 1000
    mqar = [_fake_task("mqar", "kla", 0.3, d_model=64, length=512),
            _fake_task("mqar", "attention", 0.9, d_model=128, length=512)]
    md = plots.mqar_markdown(mqar)
    assert "| 512 | 64 | 64 | kla | 30.00 | 30.00 | 100 | 200 | 2.000 | 1,000 |" in md
    assert md.index("| 64 | kla") < md.index("| 128 | attention")


def test_auroc_and_variance_calibration():
    scores = np.array([0.1, 0.4, 0.35, 0.8])
    assert train.auroc(scores, np.array([False, False, True, True])) == pytest.approx(0.75)
    assert train.auroc(scores, np.zeros(4, bool)) is None
    args = train.parse_args(["--task", "a5", "--len", "6", "--mixer", "kla", "--layers", "1",
                             "--d-model", "16", "--d-state", "4"])
    task = make_task("a5", seq_len=6, num_test=16)
    model = train.build_model(task, args)
    x, y = validation_set(task, 0)
    with torch.no_grad():
        y[:, ::2] = model(torch.from_numpy(x)).argmax(-1).numpy()[:, ::2]   # right at even positions
    cal = train.variance_calibration(model, x, y, 8, torch.device("cpu"), False)
    assert 0 < cal["error_rate"] < 1 and 0 <= cal["auroc_var"] <= 1 and cal["mean_var_wrong"] > 0
    assert cal["mean_var_correct"] > 0 and cal["auroc_confidence"] is not None
    args.mixer = "attention"
    assert train.variance_calibration(train.build_model(task, args), x, y, 8, torch.device("cpu"), False) is None
