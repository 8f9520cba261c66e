"""The training harness on the CPU: models and parameter groups, the protocols' run lists and
launcher, pause and resume of runs, the schedule, the tables and plots, and the calibration check."""

import json
import math

import numpy as np
import pytest
import torch

from evidence import calibration, plots, protocols, train
from evidence.tasks import IGNORE, make_task, train_batches, validation_set
from evidence.tasks.mad import mad_task
from kalmanscan.diagnostics.calibration import report
from kalmanscan.nn import KLA, layer_filters


def test_autoencoder_and_noise_zero_models():
    args = train.parse_args(["--task", "compression", "--mixer", "kla", "--layers", "1",
                             "--d-model", "16", "--d-state", "4", "--noise-zero"])
    task = mad_task("compression", num_train=64, num_test=64)
    model = train.build_model(task, args)
    logits = model(torch.from_numpy(task.generate(np.random.default_rng(0), 2, False)[0]))
    assert logits.shape == (2, 32, 16)
    kla = model.encoder.blocks[0].mixer
    assert not kla.noise_parameter().requires_grad and (kla.discretized()[1] == 0).all()
    groups = train.param_groups(model, 0.1)
    decayed = {id(p) for p in groups[0]["params"]}
    assert id(kla.log_dt) not in decayed and id(kla.in_proj.weight) in decayed
    with pytest.raises(ValueError, match="noise-zero"):
        train.build_model(task, train.parse_args(["--task", "compression", "--mixer", "attention",
                                                  "--layers", "1", "--d-model", "16", "--noise-zero"]))


def test_mlp_width_stays_unrounded_unless_asked():
    """Every recorded run used the unrounded SwiGLU width; SequenceModel's own default rounds to 64."""
    task = mad_task("compression", num_train=64, num_test=64)
    base = ["--task", "compression", "--mixer", "attention", "--layers", "1", "--d-model", "128"]
    widths = [train.build_model(task, train.parse_args(base + extra)).encoder.blocks[0].mlp.w_out.in_features
              for extra in ([], ["--mlp-multiple-of", "64"])]
    assert widths == [341, 384]


def test_protocol_commands():
    runs = protocols.a5_min_depth(lengths=(16, 32), depths=(1, 2), mixers=("kla", "gla"), steps=10)
    assert len(runs) == 2 * 2 * 2 + 2 + 2          # plus Z60 per mixer and the GRU per length
    assert sum("gru" in r.argv for r in runs) == 2 and all(
        r.argv[r.argv.index("--layers") + 1] == "1" for r in runs if "gru" in r.argv)
    with_gru = protocols.a5_min_depth(lengths=(16,), depths=(1, 2), mixers=("gru",), control=None)
    assert [r.label for r in with_gru] == ["a5_L16_n1_gru_s0", "a5_L16_n2_gru_s0"]
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
    lines = capsys.readouterr().out.splitlines()
    assert sum("--task z60" in line for line in lines) == 2
    assert sum("--mixer gru" in line for line in lines) == 1
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


def test_mqar_protocol_vocab_option(capsys):
    protocols.main(["mqar", "--lengths", "256", "--kv-pairs", "32", "--widths", "64", "--mixers",
                    "kla", "--vocab", "256", "--dry-run"])
    (line,) = capsys.readouterr().out.splitlines()
    assert "--vocab 256" in line and "mqar_T256_kv32_v256_d64_kla_s0.json" in line
    with pytest.raises(ValueError, match="vocab"):
        protocols.main(["mad", "--vocab", "64", "--dry-run"])
    protocols.main(["ou", "--task", "mqar", "--lengths", "256", "--kv-pairs", "32", "--vocab", "256",
                    "--filler", "zero", "--depths", "2", "--dry-run"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert all("--task mqar --len 256 --kv-pairs 32 --vocab 256 --filler zero" in x for x in lines)


@pytest.mark.slow  # about 4.5 s
def test_launch_smoke_run_on_cpu_and_failures(tmp_path, capsys):
    """End to end: a 3-step KLA run with a two-rate sweep, launched as a process, writes its JSON."""
    argv = ["--task", "a5", "--len", "8", "--mixer", "kla", "--layers", "1", "--d-model", "16",
            "--d-state", "4", "--steps", "3", "--batch", "4", "--eval-every", "2",
            "--eval-size", "8", "--lrs", "1e-3,3e-3", "--device", "cpu"]
    (saved,) = protocols.launch([protocols.Run("ok", argv)], str(tmp_path), poll_s=0.1,
                                env={"OMP_NUM_THREADS": "1"})
    assert saved["label"] == "a5_L8_kla_n1_d16_s0" and saved["device"] == "cpu" and saved["commit"]
    assert json.loads((tmp_path / "ok.json").read_text())["best_lr"] == saved["best_lr"]
    assert [r["lr"] for r in saved["runs"]] == [1e-3, 3e-3]
    assert all(r["steps_run"] == 3 and r["stopped"] == "steps" for r in saved["runs"])
    assert 0 <= saved["best_token_acc"] <= 1 and saved["config"]["seed"] == 0
    assert "grad norm" in capsys.readouterr().err                          # the launch's summary line
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
    assert [n[0] for n in resumed["grad_norms"]] == [n[0] for n in resumed["mixer_grad_norms"]] == [2, 4, 6, 7]
    drop = lambda r: {k: v for k, v in r.items() if k != "wall_s"}          # noqa: E731
    assert drop(resumed) == drop(whole) == drop(plain)
    saved = [torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in ("whole", "part")]
    assert all(s["finished"] and "optimizer" not in s for s in saved)
    assert saved[0]["model"].keys() == saved[1]["model"].keys()
    assert all(torch.equal(saved[0]["model"][k], saved[1]["model"][k]) for k in saved[0]["model"])
    assert run("part", *part) == resumed                                     # finished: no training


TINY_GLA_MQAR = ["--task", "mqar", "--len", "63", "--kv-pairs", "4", "--vocab", "32", "--filler", "zero",
                 "--mixer", "gla", "--mixer-opt", "d_conv=4", "--mixer-opt", "expand_k=2", "--layers", "2",
                 "--d-model", "16", "--batch", "4", "--eval-size", "8", "--device", "cpu", "--no-progress"]


def test_gradient_norms_are_the_pre_clip_norms_at_each_evaluation(tmp_path):
    """The recorded norms are those of the step's gradient before clipping, of the whole model and
    of each layer's mixer, recomputed here from the same seed and batch; finite and non-zero."""
    out = str(tmp_path / "r.json")
    run = train.main([*TINY_GLA_MQAR, "--steps", "5", "--eval-every", "2", "--out", out])["runs"][0]
    assert [n[0] for n in run["grad_norms"]] == [n[0] for n in run["mixer_grad_norms"]] == [2, 4, 5]
    assert all(len(n) == 3 and all(0 < v < math.inf for v in n[1:]) for n in run["mixer_grad_norms"])
    assert all(0 < n[1] < math.inf for n in run["grad_norms"])
    first = train.main([*TINY_GLA_MQAR, "--steps", "1", "--out", str(tmp_path / "one.json")])["runs"][0]
    args = train.parse_args([*TINY_GLA_MQAR, "--steps", "1"])
    task = train.task_from_args(args)
    torch.manual_seed(args.seed)
    model = train.build_model(task, args)
    x, y = (torch.from_numpy(a) for a in next(train_batches(task, args.seed, args.batch)))
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE).backward()
    total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    mixers = [torch.nn.utils.get_total_norm([p.grad for p in b.mixer.parameters()]) for b in model.blocks]
    assert total > 1                                                        # so clipping did act
    assert first["grad_norms"] == [[1, pytest.approx(total.item(), rel=1e-5)]]
    assert first["mixer_grad_norms"] == [[1, *(pytest.approx(n.item(), rel=1e-5) for n in mixers)]]


def test_checkpoint_without_gradient_norms_still_resumes(tmp_path):
    """A paused checkpoint written before the norms were recorded goes on, recording from there."""
    ck = tmp_path / "ck.pt"
    train.main([*TINY_A5, "--checkpoint", str(ck), "--stop-after-steps", "3", "--out", str(tmp_path / "a.json")])
    state = torch.load(ck, weights_only=True)
    assert state["done"]["grad_norms"] == [[2, pytest.approx(state["done"]["grad_norms"][0][1])]]
    for key in ("grad_norms", "mixer_grad_norms"):
        del state["done"][key]
    torch.save(state, ck)
    resumed = train.main([*TINY_A5, "--checkpoint", str(ck), "--out", str(tmp_path / "b.json")])["runs"][0]
    assert resumed["stopped"] == "steps" and len(resumed["history"]) == 4
    assert [n[0] for n in resumed["grad_norms"]] == [n[0] for n in resumed["mixer_grad_norms"]] == [4, 6, 7]


def test_mqar_control_protocol(capsys):
    """The control lists GLA on easier settings at T = 2048 and the recorded failing runs, each a
    valid checkpointed ``evidence.train`` command."""
    protocols.main(["mqar_control", "--checkpoint-dir", "ck", "--stop-after", "330", "--out-dir", "out",
                    "--dry-run"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 7 and all("--len 2048 " in x and x.endswith(" --stop-after 330") for x in lines)
    gla = "--mixer gla --mixer-opt d_conv=4 --mixer-opt expand_k=2 "
    controls = [x for x in lines if "mqar_control_T2048" in x]
    failing = [x for x in lines if "mqar_failing_T2048" in x]
    (reference,) = [x for x in lines if "mqar_reference_T2048" in x]
    assert all(gla in x for x in controls + failing) and "--mixer kla " in reference and "--seed 1 " in reference
    assert {(x.split("--kv-pairs ")[1].split()[0], x.split("--d-model ")[1].split()[0]) for x in controls} == {
        ("8", "128"), ("8", "256"), ("16", "128"), ("16", "256")}
    assert all("--steps 3000 --seed 1 --batch 32" in x for x in controls)
    assert ["--seed 1" in failing[0], "--seed 2" in failing[1]] == [True, True]
    assert all("--kv-pairs 64 --vocab 256 --filler zero --layers 2 --d-model 128" in x and "--steps 2000" in x
               and "--batch 32 --lrs 0.001" in x for x in failing + [reference])
    protocols.main(["mqar_control", "--kv-pairs", "4", "--widths", "64", "--steps", "500", "--seed", "3",
                    "--dry-run"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and "--kv-pairs 4 " in lines[0] and "--steps 500 --seed 3" in lines[0]
    assert "--steps 2000 --seed 1" in lines[1]                             # the failing runs stay as recorded
    with pytest.raises(ValueError, match="depths"):
        protocols.main(["mqar_control", "--depths", "2", "--dry-run"])


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


@pytest.mark.slow  # about 2 s
def test_time_limit_without_steps_bounds_the_run_by_time(tmp_path):
    base = [a for a in TINY_A5 if a not in ("--steps", "7")]
    assert train.parse_args(base).steps == train.DEFAULT_STEPS
    args = train.parse_args([*base, "--time-limit", "2"])
    assert args.steps is None
    result = train.main([*base, "--time-limit", "2", "--out", str(tmp_path / "r.json")])
    run = result["runs"][0]
    assert run["stopped"] == "time" and run["steps_run"] >= 1 and run["history"]


def test_schedule():
    assert train.lr_factor(0.0, 0.1) == 0.0 and train.lr_factor(0.1, 0.1) == pytest.approx(1.0)
    assert train.lr_factor(0.05, 0.1) == pytest.approx(0.5) and train.lr_factor(1.0, 0.1) == pytest.approx(0.0)
    assert train.schedule_progress(10, 100, 30.0, 60.0) == pytest.approx(0.5)   # time dominates
    assert train.schedule_progress(10, 100, 30.0, None) == pytest.approx(0.1)


def _fake(mixer, depth, length, acc, noise_zero=False):
    run = {"lr": 1e-3, "steps_run": 100, "stopped": "threshold" if acc > 0.9 else "time"}
    return {"task": "a5", "mixer": mixer, "noise_zero": noise_zero, "mixer_opts": {}, "layers": depth,
            "seed": 0, "seq_len": length, "solved": acc > 0.9, "best_token_acc": acc, "best_lr": 1e-3,
            "runs": [run]}


def test_min_depth_table_and_plot(tmp_path):
    results = [_fake("kla", 1, 16, 0.95), _fake("kla", 2, 16, 0.97), _fake("kla", 1, 32, 0.5),
               _fake("kla", 2, 32, 0.93), _fake("gla", 1, 16, 0.4), _fake("gla", 2, 16, 0.6),
               _fake("kla", 1, 16, 0.1, noise_zero=True)]
    table = plots.min_depths(results)
    assert table == {"kla": {16: 1, 32: 2}, "gla": {16: None}, "kla_noise0": {16: None}}
    md = plots.accuracy_markdown(results)
    assert "| kla | 1 | 95.0 ✓ [100] | 50.0 [100] |" in md
    assert "| gla | > 2 | – |" in plots.min_depth_markdown(results)
    for i, r in enumerate(results):
        (tmp_path / f"{i}.json").write_text(json.dumps(r))
    cal = {"error_rate": 0.2, "mean_var_wrong": 0.5, "mean_var_correct": 0.25, "auroc_var": 0.7,
           "auroc_var_by_position": 0.6, "auroc_confidence": None}
    results[0]["runs"][0]["calibration"] = cal
    assert "| kla | 1 | 16 | 0.200 | 0.5 / 0.25 | 0.700 | 0.600 | – |" in plots.calibration_markdown(results)
    with_filters = dict(results[0], runs=[dict(results[0]["runs"][0], calibration=dict(
        cal, filters={"mean_nis": 2.5, "coverage": {"0.9": 0.81}}))])
    assert "| 0.600 | – | 2.5 | 0.810 |" in plots.calibration_markdown([with_filters, results[1]])
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


def test_runs_differing_in_seed_rate_or_options_keep_their_own_rows():
    a, b = _fake("kla", 2, 16, 0.5), _fake("kla", 2, 16, 0.6)
    b["seed"] = 1
    c = _fake("gla", 2, 16, 0.2)
    c["mixer_opts"] = {"expand_k": 2}
    zoh = _fake("kla", 2, 16, 0.4)
    zoh["mixer_opts"] = {"discretization": "zoh", "sigma_init": 1.5}
    assert plots.mixer_label(c) == "gla[expand_k=2]"
    assert plots.mixer_label(zoh) == "kla_zoh[sigma_init=1.5]"
    assert plots.run_labels([a, b]) == ["kla seed 0", "kla seed 1"]
    faster = _fake("kla", 2, 16, 0.7)
    faster["runs"][0]["lr"] = 3e-3
    assert plots.run_labels([a, faster]) == ["kla lr 0.001", "kla lr 0.003"]
    md = plots.accuracy_markdown([a, b, c])
    assert "| kla seed 0 | 2 | 50.0 [100] |" in md and "| kla seed 1 | 2 | 60.0 [100] |" in md
    assert "| gla[expand_k=2] seed 0 | 2 | 20.0 [100] |" in md
    with pytest.raises(ValueError, match="share mixer"):
        plots.index([a, dict(a)], "a5")
    mad = [_fake_task("fuzzy_recall", "kla", 0.5), _fake_task("fuzzy_recall", "kla", 0.25)]
    mad[1]["seed"] = 1
    assert set(plots.mad_table(mad)) == {"kla seed 0", "kla seed 1"}
    with pytest.raises(ValueError, match="share mixer"):
        plots.mad_table([mad[0], dict(mad[0])])


def _fake_task(task, mixer, acc, d_model=128, length=128):
    best = {"token_acc": acc, "macro_acc": acc / 2, "mean_seq_acc": acc, "step": 100}
    run = {"lr": 1e-3, "steps_run": 200, "stopped": "time", "best": best, "final_loss": 2.0,
           "n_params": 1000, "history": [], "calibration": None}
    return {"task": task, "mixer": mixer, "noise_zero": False, "mixer_opts": {}, "layers": 2, "seed": 0,
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
    assert "| 512 | 64 | 64 | kla | 0.001 | 0 | 30.00 | 30.00 | 100 | 200 | 2.000 | 1,000 |" in md
    assert md.index("| 64 | kla") < md.index("| 128 | attention")


def _at_rate(result, lr):
    result["best_lr"] = result["runs"][0]["lr"] = lr
    return result


def test_mad_rate_sweep_over_several_folders(tmp_path):
    sweep = [_at_rate(_fake_task("fuzzy_recall", "kla", acc), lr)
             for acc, lr in ((0.2, 1e-4), (0.6, 5e-4), (0.4, 1e-3))]
    sweep += [_at_rate(_fake_task("fuzzy_recall", "gla", 0.3), 1e-4),
              _at_rate(_fake_task("compression", "gla", 0.5), 1e-3)]
    assert plots.swept(sweep) and not plots.swept(sweep[:1] + sweep[3:])
    best = plots.best_over_rates(sweep)
    assert sorted((r["mixer"], r["task"], r["best_lr"]) for r in best) == [
        ("gla", "compression", 1e-3), ("gla", "fuzzy_recall", 1e-4), ("kla", "fuzzy_recall", 5e-4)]
    assert "| kla | 60.0 / 30.0 [200] @0.0005 | – | – |" in plots.mad_markdown(sweep, best_rate=True)
    assert "| gla | 30.0 / 15.0 [200] @0.0001 | 50.0 / 25.0 [200] @0.001 | 40.0 |" in \
        plots.mad_markdown(sweep, best_rate=True)
    folders = [tmp_path / "a", tmp_path / "b"]
    for folder, part in zip(folders, (sweep[:2], sweep[2:])):
        folder.mkdir()
        for i, r in enumerate(part):
            (folder / f"{i}.json").write_text(json.dumps(r))
    rates, png = tmp_path / "rates.png", tmp_path / "mad.png"
    text = plots.main(["mad", *map(str, folders), "--rates", str(rates), "--png", str(png)])
    assert "| kla lr 0.0001 | 20.0 / 10.0 [200] | – | – |" in text
    assert "Best learning rate per task and mixer" in text
    assert rates.stat().st_size > 1000 and png.stat().st_size > 1000
    with pytest.raises(ValueError, match="more than one learning rate"):
        plots.plot_rates(sweep[3:], str(rates))


def test_mqar_state_size_and_plot(tmp_path):
    config = {"task": "mqar", "len": 16, "kv_pairs": 2, "vocab": 32, "filler": "zero",
              "layers": 2, "d_model": 16, "d_state": 4, "expand": 2, "mixer_opt": [],
              "noise_zero": False, "eval_size": None, "train_size": None}
    results = []
    for mixer, acc in (("attention", 0.9), ("gla", 0.1), ("kla", 0.5)):
        r = _fake_task("mqar", mixer, acc, d_model=16, length=16)
        r["config"] = dict(config, mixer=mixer)
        results.append(r)
    floats = {r["mixer"]: plots.state_floats(r) for r in results}
    assert floats["attention"] == 2 * 2 * 16 * 16                 # layers x (k, v) x T x d_model
    assert floats["gla"] == 2 * 4 * (8 // 4) * (16 // 4)          # layers x heads x d_key x d_value
    assert floats["kla"] > 2 * 32 * 4                             # mean and precision, + conv
    conv = dict(results[1], config=dict(config, mixer="gla", mixer_opt=["d_conv=4"]))
    assert plots.state_floats(conv) == floats["gla"] + 2 * 3 * (8 + 8 + 16)   # + q, k, v windows
    sub = tmp_path / "lr1e-3"
    sub.mkdir()
    for i, r in enumerate(results):
        (sub / f"{i}.json").write_text(json.dumps(r))
    png, curves = tmp_path / "mqar.png", tmp_path / "curves.png"
    text = plots.main(["mqar", str(tmp_path), "--png", str(png), "--curves", str(curves)])
    assert "| 16 | 2 | 16 | kla | 0.001 | 0 | 50.00" in text
    assert png.stat().st_size > 1000 and curves.stat().st_size > 1000


def test_auroc_and_variance_calibration():
    scores = np.array([0.1, 0.4, 0.35, 0.8])
    assert calibration.auroc(scores, np.array([False, False, True, True])) == pytest.approx(0.75)
    assert calibration.auroc(scores, np.zeros(4, bool)) is None
    args = train.parse_args(["--task", "a5", "--len", "6", "--mixer", "kla", "--layers", "1",
                             "--d-model", "16", "--d-state", "4"])
    task = make_task("a5", seq_len=6, num_test=16)
    model = train.build_model(task, args)
    x, y = validation_set(task, 0)
    with torch.no_grad():
        y[:, ::2] = model(torch.from_numpy(x)).argmax(-1).numpy()[:, ::2]   # right at even positions
    cal = calibration.variance_calibration(model, x, y, 8, torch.device("cpu"), False)
    assert 0 < cal["error_rate"] < 1 and 0 <= cal["auroc_var"] <= 1 and cal["mean_var_wrong"] > 0
    assert cal["mean_var_correct"] > 0 and cal["auroc_confidence"] is not None
    filters = cal["filters"]
    assert filters["rows"] == 8 and filters["mean_nis"] > 0 and 0 <= filters["pit_ks"] <= 1
    assert set(filters["coverage"]) == {"0.5", "0.9"}
    layer = next(m for m in model.modules() if isinstance(m, KLA))
    inputs = []
    handle = layer.register_forward_hook(lambda module, args, out: inputs.append(args[0]))
    with torch.no_grad():
        model(torch.from_numpy(x[:8]))
    handle.remove()
    obs, post = layer_filters(layer, inputs[0])
    rep = report(post, obs, levels=(0.5, 0.9))
    assert filters["mean_nis"] == pytest.approx(rep.mean_nis, rel=1e-6)
    assert filters["coverage"]["0.9"] == pytest.approx(rep.coverage[0.9], abs=1e-6)
    saved = calibration.FILTER_CHECK_ELEMENTS
    try:
        calibration.FILTER_CHECK_ELEMENTS = 1          # at least one row, however small the cap
        assert calibration.filter_calibration(layer, inputs[0])["rows"] == 1
    finally:
        calibration.FILTER_CHECK_ELEMENTS = saved
    args.mixer = "attention"
    assert calibration.variance_calibration(train.build_model(task, args), x, y, 8, torch.device("cpu"), False) is None


def test_compile_trains_through_torch_compile_and_resumes_without_it(tmp_path, monkeypatch):
    """``--compile`` hands the model to ``torch.compile`` (here a recording stand-in) for the
    training steps, changes no result, and a run paused with it resumes without it."""
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda model: compiled.append(model) or model)
    ck = ["--checkpoint", str(tmp_path / "ck.pt")]
    first = train.main([*TINY_A5, *ck, "--compile", "--stop-after-steps", "3", "--out", str(tmp_path / "a.json")])
    assert len(compiled) == 1 and first["runs"][0]["steps_run"] == 3
    resumed = train.main([*TINY_A5, *ck, "--out", str(tmp_path / "b.json")])["runs"][0]
    plain = train.main([*TINY_A5, "--out", str(tmp_path / "c.json")])["runs"][0]
    assert resumed["history"] == plain["history"]
