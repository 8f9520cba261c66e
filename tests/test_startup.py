"""Start-up: ``import kalmanscan`` loads neither torch nor numba, nothing of torch's compiler is
imported on the CPU paths, ``kalmanscan --help`` starts at once, the first small ``ks.filter``
and ``kalmanscan filter`` meet their targets, and the CPU paths run without Triton installed. Each
case runs in a fresh interpreter; the targets are asserted on the child's CPU time (its own work:
robust on a loaded machine, where wall-clock times stretch with the other processes), with
wall-clock limits generous enough for a busy CI machine."""

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPILER = ("torch._dynamo", "torch._inductor", "triton")
HEAVY = ("torch", "numba", "scipy", "pandas", "xarray", "matplotlib", *COMPILER)


def _child(code: str, *args: str) -> tuple[str, float, float]:
    """``(stdout, wall seconds, CPU seconds)`` of ``python -c code args`` run from the repository."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, MPLBACKEND="Agg"), timeout=300)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert res.returncode == 0, res.stderr[-3000:]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return res.stdout, wall, cpu


def test_import_loads_no_heavy_module():
    out, wall, cpu = _child(f"import sys, kalmanscan; print([m for m in {HEAVY!r} if m in sys.modules])")
    assert out.strip() == "[]"
    assert cpu < 1.0 and wall < 2.0, (cpu, wall)


def test_help_starts_at_once():
    code = ("import sys\nfrom kalmanscan.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    out, wall, cpu = _child(code)
    assert "usage: kalmanscan" in out and out.strip().endswith("[]")
    assert cpu < 1.0 and wall < 5.0, (cpu, wall)


@pytest.mark.parametrize("fn", ["filter", "smooth"])
def test_first_call_is_fast(fn):
    """The first ``ks.filter`` (or ``ks.smooth``) call of a process on a small NumPy problem (here
    1000 steps of 3 channels, float64) runs the cpu backend's NumPy steps
    (kalmanscan.ops.filter.cpu.small): no numba, no sympy, nothing of torch's compiler nor Triton.
    Target 0.2 s of CPU (asserted as it is: measured 0.01-0.02 s on 2 shared cores, ten times
    under it); ``ks.filter``'s own imports, torch's above all, come with the name, before the call."""
    code = ("import sys, time, numpy as np, kalmanscan as ks\n"
            f"f = ks.{fn}\n"
            "y = np.random.default_rng(0).normal(size=(1000, 3))\n"
            "t0, c0 = time.perf_counter(), time.process_time()\n"
            "f(y, theta=0.1, sigma=0.5, obs_var=1.0).pred_mean\n"
            "print(time.perf_counter() - t0, time.process_time() - c0)\n"
            f"print([m for m in {(*COMPILER, 'numba', 'sympy')!r} if m in sys.modules])")
    out, wall, cpu = _child(code)
    first_wall, first_cpu = map(float, out.split("\n")[0].split())
    assert out.strip().endswith("[]")
    assert first_cpu < 0.2 and first_wall < 2.0, (first_cpu, first_wall)
    assert cpu < 6.0 and wall < 30.0, (cpu, wall)


def test_filter_command_on_100_steps(tmp_path):
    """``kalmanscan filter`` on 100 steps: target 3 s. Measured 2.0-2.6 s of CPU on 2 shared cores,
    nearly all imports (torch 0.9-1.1 s; pandas and xarray 0.6 s; xarray's first DataArray imports
    dask.array, 0.6 s); the filter itself, on the NumPy steps, a few milliseconds. The CPU time is
    asserted at the target, the better of two runs where the first misses it (the other worker's
    numba compiles beside it stretched a run to 3.2 s); its wall-clock time only against a hang."""
    y = np.random.default_rng(0).normal(size=100).cumsum()
    src = tmp_path / "s.csv"
    src.write_text("t,level\n" + "".join(f"{t},{v!r}\n" for t, v in enumerate(y.tolist())))
    code = ("import sys\nfrom kalmanscan.cli import main\nrc = main(sys.argv[1:])\n"
            "print('numba' in sys.modules)\nsys.exit(rc)")
    args = ("filter", str(src), "--theta", "0.1", "--sigma", "1", "--obs-var", "0.5")
    out, wall, cpu = _child(code, *args)
    assert "level" in out and out.split()[-1] == "False"
    if cpu >= 3.0:
        cpu = min(cpu, _child(code, *args)[2])
    assert cpu < 3.0 and wall < 30.0, (cpu, wall)


BLOCK_TRITON = """
import sys


class NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NoTriton())
"""


@pytest.mark.slow  # about 4.5 s: a child process
def test_cpu_paths_run_without_triton():
    """With ``import triton`` failing (a CPU install without the gpu extra): the NumPy and torch
    paths of filter, smooth, fit and forecast on every CPU backend, gradients, and the KLA scan
    and layer on the CPU (the layer's forward only, and fit on the torch backend: a cold numba
    cache compiles few loops here)."""
    code = BLOCK_TRITON + """
import numpy as np, torch
import kalmanscan as ks

rng = np.random.default_rng(0)
y = rng.normal(size=(40, 3))
kw = dict(theta=np.array([0.1, 0.5, 1.0]), sigma=0.5, obs_var=1.0)
ref = ks.filter(y, **kw, backend="reference")
for backend in ("auto", "cpu", "torch"):
    np.testing.assert_allclose(ks.filter(y, **kw, backend=backend).mean, ref.mean, rtol=1e-10)
    ks.smooth(y, **kw, backend=backend)
    ks.filter(torch.tensor(y, requires_grad=True), **kw, backend=backend).loglik.sum().backward()
ks.forecast(ks.fit(y, max_iter=3, backend="torch").filter(y), steps=2)
B, L, M, S = 2, 9, 4, 3
v, lam_v = torch.randn(B, L, M), torch.rand(B, L, M) + 0.5
k = torch.nn.functional.normalize(torch.randn(B, L, S), dim=-1)
q = torch.nn.functional.normalize(torch.randn(B, L, S), dim=-1)
decay, noise = torch.rand(M, S) * 0.5 + 0.4, torch.rand(M, S) * 0.1
y_cpu, _ = ks.nn.kla_scan(v, lam_v, k, q, decay, noise, backend="cpu")
torch.testing.assert_close(y_cpu, ks.nn.kla_scan(v, lam_v, k, q, decay, noise, backend="torch")[0])
with torch.no_grad():
    ks.nn.KLA(16)(torch.randn(2, 5, 16))
print("triton" in sys.modules)
"""
    out, _, _ = _child(code)
    assert out.split() == ["False"]
