"""``benchmarks.host_cost`` runs (a few calls) and leaves the kernels as it found them."""

from benchmarks import host_cost

from kalmanscan.ops.filter.triton import backend as filter_triton
from kalmanscan.ops.kla.triton import library as kla_library


def test_host_cost_runs_and_restores_the_kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors on the triton backend (no kernel runs)
    before = [getattr(filter_triton, n) for n in host_cost.FILTER_KERNELS]
    before += [getattr(kla_library, n) for n in host_cost.KLA_KERNELS]
    rows = host_cost.main(["--calls", "2"])
    assert set(rows) == {"filter", "kla"} and all(us > 0 for row in rows.values() for us in row.values())
    after = [getattr(filter_triton, n) for n in host_cost.FILTER_KERNELS]
    after += [getattr(kla_library, n) for n in host_cost.KLA_KERNELS]
    assert all(a is b for a, b in zip(after, before))
