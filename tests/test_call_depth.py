"""One way from the public call to the kernel: from ``ks.filter`` (or ``ks.smooth``) to the launch
of a compiled loop or a Triton kernel, at most six of the package's calls on the stack, no module
entered twice (validated once by ``prepare``, whose plan every backend trusts).

The stack is recorded where the work starts: the cpu backend's loop entry
(:func:`kalmanscan.ops.cpu_threads.run_loop`, as the backend imports it) and the Triton
interpreter's launch of a kernel (the triton backend on a tiny shape). Only frames of the package
count (torch's and triton's own frames between them do not)."""

import inspect
from pathlib import Path

import numpy as np
import pytest
import torch

import kalmanscan as ks
from kalmanscan.ops.filter.cpu import backend as cpu_backend

PACKAGE = Path(ks.__file__).resolve().parent
MOST = 6


def package_frames(stack: list[inspect.FrameInfo]) -> list[str]:
    """``module:function`` of the package's frames, outermost first."""
    out = []
    for info in reversed(stack):
        path = Path(info.filename).resolve()
        if path.is_relative_to(PACKAGE):
            module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
            out.append(f"{module}:{info.function}")
    return out


def check_path(frames: list[str]) -> None:
    """At most :data:`MOST` calls, and the modules entered in turn never come back."""
    assert frames, "no frame of the package on the stack"
    assert len(frames) <= MOST, "\n".join(frames)
    entered = [m for i, m in enumerate(f.split(":")[0] for f in frames)
               if i == 0 or m != frames[i - 1].split(":")[0]]
    assert len(entered) == len(set(entered)), "a module is entered twice:\n" + "\n".join(frames)


@pytest.fixture
def cpu_launches(monkeypatch):
    """The package's frames at each call of the cpu backend's loop entry (and of its NumPy steps,
    which run small work: :mod:`kalmanscan.ops.filter.cpu.small`)."""
    seen = []

    def record(module, name):
        run = getattr(module, name)

        def recorded(*args, **kwargs):
            seen.append(package_frames(inspect.stack()[1:]))
            return run(*args, **kwargs)

        monkeypatch.setattr(module, name, recorded)

    record(cpu_backend, "run_loop")
    record(cpu_backend.small, "forward")
    return seen


KW = dict(theta=0.3, sigma=0.7, obs_var=0.4)


@pytest.mark.parametrize("case", ["host", "per_step", "diffuse_gap", "grad", "state"])
@pytest.mark.parametrize("fn", [ks.filter, ks.smooth], ids=["filter", "smooth"])
def test_cpu_backend_is_at_most_six_calls_away(cpu_launches, fn, case):
    rng = np.random.default_rng(0)
    y = rng.normal(size=(9, 3))
    kw = dict(KW, backend="cpu")
    if case == "per_step":
        kw["theta"] = rng.uniform(0.1, 0.5, size=(9, 3))
    if case == "diffuse_gap":
        y[:2, 1] = np.nan
        kw["init_var"] = np.array([1.0, np.inf, 2.0])
    if case == "grad":
        y = torch.tensor(y, requires_grad=True)
        kw["sigma"] = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    if case == "state":
        kw["state"] = ks.filter(y[:4], **kw).state
        y = y[4:]
        cpu_launches.clear()
    fn(y, **kw)
    assert cpu_launches
    for frames in cpu_launches:
        check_path(frames)


@pytest.fixture
def kernel_launches(monkeypatch):
    """The package's frames at each Triton kernel launch under the interpreter."""
    from triton.runtime import interpreter

    seen = []
    launch = interpreter.GridExecutor.__call__

    def recorded(self, *args, **kwargs):
        seen.append(package_frames(inspect.stack()[1:]))
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", recorded)
    return seen


@pytest.mark.parametrize("fn, grad", [(ks.filter, False), (ks.filter, True), (ks.smooth, False)],
                         ids=["filter", "filter-grad", "smooth"])
def test_triton_backend_is_at_most_six_calls_away(kernel_launches, fn, grad):
    y = torch.randn(5, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor(0.7, dtype=torch.float64, requires_grad=grad)
    post = fn(y, theta=0.3, sigma=sigma, obs_var=0.4, backend="triton")
    if grad:
        post.loglik.sum().backward()
    assert kernel_launches
    for frames in kernel_launches:
        if grad and not any(f.startswith("inference.filtering:filter") for f in frames):
            continue  # the backward's launches come from autograd's engine, not from ks.filter
        check_path(frames)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_fit_prepares_once(monkeypatch, dtype):
    """``ks.fit`` validates its inputs once (and its float64 standard errors of float32 data widen
    that problem instead of preparing another)."""
    from kalmanscan.estimation import fitting, likelihood
    from kalmanscan.problem import prepare as prepare_module

    calls = []
    prepare = prepare_module.prepare

    def counted(*args, **kwargs):
        calls.append(1)
        return prepare(*args, **kwargs)

    monkeypatch.setattr(fitting, "prepare", counted)
    monkeypatch.setattr(likelihood, "prepare", counted)
    y = np.random.default_rng(2).normal(size=(40, 2)).astype(dtype)
    result = ks.fit(y, estimate=("theta", "sigma", "obs_var"), mean=0.0, backend="torch", max_iter=5, progress=False)
    assert len(calls) == 1 and np.isfinite(result.loglik).all()
