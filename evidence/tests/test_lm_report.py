"""The language-model report on fake run JSONs: rows, equal wall-clock, the sweep table, the figure."""

import json

import pytest

from evidence import lm_report


def fake_run(model, seed, end_bpb, fraction=1.0, lr=1e-3, kla=False):
    tokens = [250, 500, 750, 1000]
    bpb = [end_bpb + 0.3 * (3 - i) for i in range(4)]          # 0.3 bits better each evaluation
    history = [[i + 1, t, 0.1 * (i + 1), b + 0.1, 1.0, b] for i, (t, b) in enumerate(zip(tokens, bpb))]
    cal = {"auroc_var": 0.6, "auroc_confidence": 0.8} if kla else None
    return {"model": model, "seed": seed, "lr": lr, "config": {"tokens_fraction": fraction}, "n_params": 20_000_000,
            "stopped": "steps", "tokens_run": 1000, "tokens_per_s": 1.0, "history": history, "final_bpb": end_bpb,
            "calibration": cal, "samples": [{"prompt": "def f(", "greedy": "x):", "sampled": "y):"}]}


@pytest.fixture
def results(tmp_path):
    runs = [fake_run("attention", 0, 2.0), fake_run("attention", 1, 2.2), fake_run("kla", 0, 1.9, kla=True),
            fake_run("attention", 0, 3.0, 0.1, 3e-4), fake_run("attention", 0, 2.9, 0.1, 1e-3)]
    for i, r in enumerate(runs):
        (tmp_path / f"run{i}.json").write_text(json.dumps(r))
    throughput = {"models": {"attention": {"tokens_per_s": 100.0}, "kla": {"tokens_per_s": 50.0}}}
    (tmp_path / "throughput.json").write_text(json.dumps(throughput))
    return tmp_path


def test_rows_equal_time_and_sweep(results):
    main, sweep = lm_report.load_runs(str(results))
    assert len(main) == 3 and len(sweep) == 2
    models = lm_report.by_model(main)
    budget, at = lm_report.equal_time(models, {"attention": 100.0, "kla": 50.0})
    assert budget == pytest.approx(10.0)                          # attention's 1000 tokens at 100/s
    assert at["attention"] == pytest.approx(2.1)                  # its end, mean of the seeds
    assert at["kla"] == pytest.approx(1.9 + 0.6)                  # kla's 500 tokens: two evaluations short
    text = lm_report.main([str(results), "--throughput", str(results / "throughput.json"), "--samples",
                           "--figure", str(results / "fig" / "curves.png")])
    rows = [line for line in text.splitlines() if line.startswith("| kla |") or line.startswith("| attention |")]
    assert rows[0].startswith("| kla | 20.00M | 1 | 1.9000 | 2.0000 | 1.9000 (0M) | 2.5000 | 50 | 0.600 / 0.800 |")
    assert rows[1].startswith("| attention | 20.00M | 2 | 2.1000 +- 0.1000 | 2.2000 +- 0.1000 | 2.1000 (0M) | "
                              "2.1000 | 100 | - |")
    assert "| attention | 3.0000 | 2.9000 |" in text and "first 10%" in text
    assert "def f(|>>|x):" in text
    assert (results / "fig" / "curves.png").stat().st_size > 0


def test_runs_are_read_from_several_folders(tmp_path):
    for i, (folder, model) in enumerate((("a", "attention"), ("b", "kla"))):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / f"run{i}.json").write_text(json.dumps(fake_run(model, 0, 2.0)))
    main, _ = lm_report.load_runs(str(tmp_path / "a"), str(tmp_path / "b"))
    assert sorted(r["model"] for r in main) == ["attention", "kla"]
    text = lm_report.main([str(tmp_path / "a"), str(tmp_path / "b")])
    assert "| kla |" in text and "| attention |" in text


def test_empty_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match="directory"):
        lm_report.main([str(tmp_path)])


def test_best_is_the_curve_minimum_where_the_model_memorises():
    run = fake_run("kla", 0, 1.9)
    run["history"][1][5] = 1.5                                     # lowest at the second evaluation, 500 tokens
    for row in run["history"]:
        row[1] *= 10 ** 6
    assert lm_report.best([run, run]) == "1.5000 (500M)"


def test_rates_without_throughput_take_each_models_fastest_run():
    shared = fake_run("kla", 1, 1.9)
    shared["tokens_per_s"] = 0.4                                   # a run that shared its GPU
    models = lm_report.by_model([fake_run("kla", 0, 1.9), shared, fake_run("attention", 0, 2.0)])
    assert lm_report.rates(models, {}) == {"kla": 1.0, "attention": 1.0}
    assert lm_report.rates(models, {"kla": 0.7}) == {"kla": 0.7, "attention": 1.0}
