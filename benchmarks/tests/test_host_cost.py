"""``benchmarks.probes.host_cost`` runs (a few calls) and leaves the kernels as it found them."""

from benchmarks.probes import host_cost


def test_host_cost_runs_and_restores_the_kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors on the triton backend (no kernel runs)
    before = [(module, name, getattr(module, name)) for module, name in host_cost.launchers()]
    assert any(name.startswith("filter_") for _, name, _ in before) and any(name.startswith("kla_")
                                                                           for _, name, _ in before)
    rows = host_cost.main(["--calls", "2"])
    assert set(rows) == {"filter", "kla"} and all(us > 0 for row in rows.values() for us in row.values())
    assert all(getattr(module, name) is kernel for module, name, kernel in before)
