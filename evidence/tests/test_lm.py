"""The byte-level language-model trainer on the CPU: bits per byte, parameter parity of the real
sizes, decoding of every model, pause and resume, throughput and the protocol's run lists."""

import json
import math
import os

import numpy as np
import pytest
import torch

from evidence import lm
from evidence.lm_models import LM_MODELS, build_lm, check_parity, parameter_counts
from evidence.tests.test_text import write_corpus

TINY = ["--batch", "2", "--seq-len", "16", "--d-model", "32", "--layers", "2", "--device", "cpu"]


@pytest.fixture(scope="module")
def corpus_root(tmp_path_factory):
    return write_corpus(str(tmp_path_factory.mktemp("lm_corpus")))


class Uniform(torch.nn.Module):
    def forward(self, tokens):
        return torch.zeros(*tokens.shape, 256)

    def train(self, mode=True):
        return self


def test_bits_per_byte_of_uniform_logits_is_8():
    data = np.random.default_rng(0).integers(0, 256, 1001, dtype=np.uint8)
    x, y = lm.eval_windows(data, 63)
    bpb = lm.bits_per_byte(Uniform(), x, y, 4, torch.device("cpu"), False)
    assert bpb == pytest.approx(8.0, rel=1e-6)       # float32 logits: ln 256 to its rounding


def test_real_sizes_are_within_five_percent():
    counts = parameter_counts()
    assert set(counts) == set(LM_MODELS)
    assert check_parity(counts) <= 0.05
    assert all(18e6 < n < 22e6 for n in counts.values())
    with pytest.raises(ValueError, match="attention"):
        check_parity({"attention": 110, "kla": 100})


@pytest.mark.parametrize("name", sorted(LM_MODELS))
def test_every_model_decodes(name):
    torch.manual_seed(0)
    model = build_lm(name, d_model=64, layers=4)
    assert model.mixer_names == list(LM_MODELS[name].pattern * 4)[:4]
    assert all(b.mixer.d_conv == 4 for b in model.blocks if b.mixer.__class__.__name__ != "CausalAttention")
    data = np.frombuffer(b"def f(x):\n    return x\n" * 8, dtype=np.uint8)
    out = lm.samples(model, data, 0, 16, 5, torch.device("cpu"))
    assert len(out) == lm.SAMPLE_PROMPTS and all(len(s["prompt"]) == 16 for s in out)
    assert all(s["greedy"] and s["sampled"] for s in out)


def train_args(corpus_root, tmp_path, *extra):
    return ["train", "--model", "attention", "--tokens", str(6 * 2 * 16), "--eval-every", "2",
            "--eval-bytes", "64", "--calib-windows", "2", "--sample-bytes", "4", "--prompt-bytes", "8",
            "--corpus-root", corpus_root, "--out", str(tmp_path / "run.json"), *TINY, *extra]


def test_resume_equals_uninterrupted(corpus_root, tmp_path):
    whole = lm.main(train_args(corpus_root, tmp_path))
    assert whole["stopped"] == "steps" and whole["steps_run"] == 6 and len(whole["history"]) == 3
    assert whole["tokens_run"] == 6 * 32 and whole["calibration"] is None      # no KLA layer
    ck = str(tmp_path / "ck.pt")
    paused = lm.main(train_args(corpus_root, tmp_path, "--checkpoint", ck, "--stop-after-steps", "3"))
    assert paused["stopped"] == "paused" and paused["steps_run"] == 3 and paused["final_bpb"] is None
    resumed = lm.main(train_args(corpus_root, tmp_path, "--checkpoint", ck, "--stop-after-steps", "3"))
    assert resumed["steps_run"] == 6 and resumed["stopped"] == "steps"
    drop_time = [row[:2] + row[3:] for row in whole["history"]]
    assert [row[:2] + row[3:] for row in resumed["history"]] == drop_time
    assert resumed["final_bpb"] == whole["final_bpb"] and resumed["samples"] == whole["samples"]
    with open(tmp_path / "run.json") as fh:
        assert json.load(fh)["final_bpb"] == whole["final_bpb"]
    again = lm.main(train_args(corpus_root, tmp_path, "--checkpoint", ck))       # finished: no training
    assert again["history"] == resumed["history"]
    with pytest.raises(ValueError, match="--lr"):
        lm.main(train_args(corpus_root, tmp_path, "--checkpoint", ck, "--lr", "0.5"))


def test_sweep_fraction_keeps_the_schedule(corpus_root, tmp_path):
    part = lm.main(train_args(corpus_root, tmp_path, "--tokens-fraction", "0.5", "--model", "kla_hybrid",
                                  "--layers", "4"))
    assert part["steps"] == 6 and part["steps_run"] == 3 and part["stopped"] == "steps"
    assert part["layers"] == ["kla", "kla", "kla", "attention"] and math.isfinite(part["final_bpb"])
    assert 0.0 <= part["calibration"]["error_rate"] <= 1.0 and "auroc_var" in part["calibration"]
    with pytest.raises(ValueError, match="tokens-fraction"):
        lm.parse_args(train_args(corpus_root, tmp_path, "--tokens-fraction", "0"))


def test_throughput_times_each_model(tmp_path):
    out = str(tmp_path / "tp.json")
    result = lm.main(["throughput", "--models", "attention,gla", "--steps", "1", "--warmup-steps", "1",
                      "--out", out, *TINY])
    assert set(result["models"]) == {"attention", "gla"} and result["parameter_spread"] is None
    assert all(m["tokens_per_s"] > 0 for m in result["models"].values())
    assert os.path.exists(out)


def test_protocol_dry_run_lists_the_runs(capsys, tmp_path):
    lm.main(["protocol", "--sweep", "--dry-run", "--out-dir", str(tmp_path), "--checkpoint-dir", "ck",
             "--stop-after", "540"])
    sweep = capsys.readouterr().out.strip().splitlines()
    assert len(sweep) == len(lm.SWEEP_MODELS) * len(lm.SWEEP_LRS)
    assert all("evidence.lm train" in c and "--tokens-fraction 0.1" in c and "--stop-after 540" in c for c in sweep)
    lm.main(["protocol", "--dry-run", "--lr", "2e-3", "--out-dir", str(tmp_path)])
    main = capsys.readouterr().out.strip().splitlines()
    assert len(main) == sum(lm.MAIN_SEEDS.values()) == 8
    assert all("--lr 0.002" in c and "--tokens-fraction" not in c for c in main)
    labels = [c.split("--out ")[1].split()[0] for c in main]
    assert len(set(labels)) == 8 and labels[0].endswith("text_kla_s0.json")
    lm.main(["protocol", "--dry-run", "--models", "kla,gla", "--out-dir", str(tmp_path)])
    assert len(capsys.readouterr().out.strip().splitlines()) == 3
    lm.main(["protocol", "--sweep", "--dry-run", "--sweep-lrs", "1e-3", "--out-dir", str(tmp_path)])
    assert len(capsys.readouterr().out.strip().splitlines()) == len(lm.SWEEP_MODELS)
    with pytest.raises(ValueError, match="models"):
        lm.main(["protocol", "--dry-run", "--models", "mamba"])
    with pytest.raises(ValueError, match="checkpoint-dir"):
        lm.main(["protocol", "--dry-run", "--stop-after", "5"])
