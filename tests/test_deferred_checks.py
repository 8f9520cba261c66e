"""Checks on device parameters read once the triton backend's kernels are queued (``prepare(defer=)``).

A parameter given per step (``(T, C)``) or with a gradient takes ``prepare``'s device path even on
the CPU, so the interpreter runs the deferred read here: the result equals the torch backend's,
a diffuse prior or a filter without process noise found by the read runs the call again, and a bad
value still raises ``ValueError`` naming its argument (or the state it came from).
"""

import pytest
import torch

import kalmanscan as ks
from kalmanscan.problem.prepare import GUESSED, prepare
from kalmanscan.ops.filter.triton import backend as triton_backend

T, C = 23, 3


def problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(T, C, dtype=torch.float64, generator=g)
    y[torch.rand(T, C, generator=g) < 0.1] = float("nan")
    theta = torch.rand(T, C, dtype=torch.float64, generator=g) + 0.2  # per step: the device path
    return y, dict(theta=theta, sigma=torch.full((C,), 0.7, dtype=torch.float64), obs_var=0.4)


def test_prepare_defers_only_for_the_triton_backend():
    y, kw = problem()
    p = prepare(y, backend="triton", defer=True, **kw)
    assert p.pending is not None and (p.diffuse, p.no_noise) == (GUESSED["diffuse"], GUESSED["no_noise"])
    assert p.pending.decide() == dict(diffuse=False, no_noise=False)
    assert prepare(y, backend="torch", defer=True, **kw).pending is None
    assert prepare(y, backend="triton", **kw).pending is None
    assert prepare(y, backend="triton", defer=True, theta=0.5, sigma=0.7, obs_var=0.4).pending is None


def counted(monkeypatch):
    """The problems the triton backend runs (both entry points call the plan's backend)."""
    calls = []
    run = triton_backend.filter

    def spy(p):
        calls.append(p)
        return run(p)

    monkeypatch.setattr(triton_backend, "filter", spy)
    return calls


@pytest.mark.parametrize("case", ["plain", "diffuse", "no_noise"])
@pytest.mark.parametrize("fn", [ks.filter, ks.smooth], ids=["filter", "smooth"])
def test_deferred_call_equals_the_torch_backend(monkeypatch, case, fn):
    y, kw = problem(1)
    if case == "diffuse":
        kw["init_var"] = torch.tensor([1.0, float("inf"), 2.0], dtype=torch.float64)
    if case == "no_noise":
        kw["sigma"] = torch.tensor([0.7, 0.0, 0.3], dtype=torch.float64)
        kw["init_var"] = 1.5
    want = fn(y, backend="torch", **kw)
    calls = counted(monkeypatch)
    got = fn(y, backend="triton", **kw)
    assert len(calls) == (1 if case == "plain" else 2)  # a refuted guess runs the call again
    for name in ("mean", "var", "loglik"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("fn", [ks.filter, ks.smooth], ids=["filter", "smooth"])
@pytest.mark.parametrize("bad, name", [
    (dict(obs_var=torch.full((T, C), -1.0, dtype=torch.float64)), "obs_var"),
    (dict(sigma=torch.tensor([0.7, -0.1, 0.3], dtype=torch.float64)), "sigma"),
    (dict(init_var=torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64)), "init_var"),
    (dict(y_inf=True), "y"),
])
def test_deferred_bad_values_raise_naming_the_argument(fn, bad, name):
    y, kw = problem(2)
    bad = dict(bad)  # (the parameter's dict is shared between the cases)
    if bad.pop("y_inf", False):
        y = y.clone()
        y[5, 1] = float("inf")
    kw.update(bad)
    with pytest.raises(ValueError, match=name):
        fn(y, backend="triton", **kw)


def test_deferred_state_errors_name_the_state():
    y, kw = problem(3)
    post = ks.filter(y, backend="triton", **kw)
    state = ks.StreamState(mean=post.state.mean, var=-post.state.var, level=post.state.level, steps=T)
    with pytest.raises(ValueError, match="state"):
        ks.filter(y, backend="triton", state=state, **kw)


def test_deferred_gradients_equal_the_torch_backend():
    y, kw = problem(4)
    theta = kw.pop("theta")[0].clone().requires_grad_()  # (C,) with a gradient: the device path
    got = torch.autograd.grad(ks.filter(y, backend="triton", theta=theta, **kw).loglik.sum(), theta)[0]
    want = torch.autograd.grad(ks.filter(y, backend="torch", theta=theta, **kw).loglik.sum(), theta)[0]
    torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)
