"""``bench_decode``: a clear line without a GPU; on a GPU a tiny run of every mixer writes its rows."""

import json

import pytest
import torch

from benchmarks.bench_decode import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without CUDA")
def test_without_cuda_says_so_and_writes_nothing(tmp_path, capsys):
    path = tmp_path / "decode.json"
    assert main(["--json", str(path)]) is None
    assert "needs a CUDA device" in capsys.readouterr().out
    assert not path.exists()


@pytest.mark.gpu
def test_tiny_run_writes_a_row_per_shape(tmp_path):
    path = tmp_path / "decode.json"
    main(["--json", str(path), "--contexts", "256", "--batches", "1,4", "--d-model", "64", "--layers", "2",
          "--vocab", "128", "--reps", "3", "--groups", "2", "--warmup", "1"])
    rows = json.loads(path.read_text())["rows"]
    assert [(r["mixer"], r["batch"]) for r in rows] == [(m, b) for m in ("kla", "attention", "gla") for b in (1, 4)]
    for row in rows:
        assert row["step_ms"] > 0 and row["kernels_per_step"] > 0 and row["prefill_tokens_per_s"] > 0
        assert 0 < row["fraction_of_limit"] <= 1.5
