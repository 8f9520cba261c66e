"""``benchmarks.probes.packed_compile`` runs on the CPU (the compiled loops, ``aot_eager``): every
stage found equal to eager, the result as it is written for the GPU run."""

import pytest

from benchmarks.probes import packed_compile


@pytest.mark.slow  # 29 s on 2 cores (every stage compiled)
def test_packed_compile_runs_and_finds_no_departure():
    result = packed_compile.main(["--repeat", "1", "--backend", "cpu", "--device", "cpu", "--compilers",
                                  "aot_eager"])
    assert result["first"] is None
    assert set(result["stages"]) == {f"{s}/aot_eager" for s in ("sliced_search", "documents", "conv", "scan",
                                                                "windows", "layer", "layer_state")}
    assert all(row["max_abs_diff"] == 0.0 for row in result["stages"].values())
