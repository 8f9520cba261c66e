"""The torch backend is differentiable: gradcheck in float64 against finite differences; the cpu
backend's public smoother gives the torch backend's gradients whatever the parameters' shapes."""

import numpy as np
import pytest
import torch
from helpers import DEVICE, KERNEL_DEVICE, NAMES, random_problem

import kalmanscan as ks

def _loss(post):
    return (post.loglik.sum() + (post.mean * 0.3).sum() + post.var.sum() + post.pred_mean.sum()
            + post.pred_var.sum())


def _check(per_step, times, T=9):
    rng = np.random.default_rng(20 + per_step + 2 * times)
    y, kw = random_problem(rng, T, C=2, batch=(2,), per_step=per_step, times=times, missing=0.15)
    leaves = {k: torch.tensor(kw[k], device=DEVICE, requires_grad=True) for k in NAMES}
    y_t = torch.tensor(y, device=DEVICE, requires_grad=True)
    rest = {k: v for k, v in kw.items() if k not in NAMES}

    def f(y_t, *params):
        return _loss(ks.filter(y_t, backend="torch", **dict(zip(NAMES, params)), **rest))

    assert torch.autograd.gradcheck(f, (y_t, *leaves.values()), atol=1e-6, rtol=1e-5)


def test_gradcheck_static_params():
    _check(per_step=False, times=False)


def test_gradcheck_per_step_params_irregular_times():
    _check(per_step=True, times=True)


def test_gradcheck_smoother():
    rng = np.random.default_rng(31)
    y, kw = random_problem(rng, 7, C=2, batch=(), per_step=False, missing=0.2)
    leaves = {k: torch.tensor(kw[k], requires_grad=True) for k in NAMES}

    def f(y_t, *params):
        post = ks.smooth(y_t, backend="torch", dt=kw["dt"], **dict(zip(NAMES, params)))
        return post.mean.sum() + post.var.sum()

    assert torch.autograd.gradcheck(f, (torch.tensor(y, requires_grad=True), *leaves.values()), atol=1e-6, rtol=1e-5)


def test_missing_values_give_zero_not_nan_gradients():
    y = torch.tensor([[1.0], [float("nan")], [0.5]], dtype=torch.float64, requires_grad=True)
    theta = torch.tensor(0.4, dtype=torch.float64, requires_grad=True)
    ks.filter(y, theta=theta, sigma=1.0, obs_var=0.5, backend="torch").loglik.sum().backward()
    assert torch.isfinite(theta.grad) and y.grad[1, 0] == 0 and torch.all(torch.isfinite(y.grad))


@pytest.mark.parametrize("shape", [(), (2,), (1, 2), (3, 1, 2), (9, 2)])
def test_cpu_smoother_gradients_equal_torch(shape):
    """Static parameters reach the cpu smoother as broadcast views of ``(..., T, C)``; their
    gradients (and ``y``'s) equal the torch backend's, and gradcheck passes on the public call."""
    rng = np.random.default_rng(40 + len(shape))
    y = rng.normal(size=(3, 9, 2))
    y[0, 4, 1] = np.nan
    theta = rng.uniform(0.2, 1.0, size=shape)
    grads = []
    for backend in ("cpu", "torch"):
        y_t = torch.tensor(y, requires_grad=True)
        theta_t = torch.tensor(theta, requires_grad=True)
        post = ks.smooth(y_t, theta=theta_t, sigma=0.8, obs_var=0.5, backend=backend)
        (post.mean.nansum() + (post.var * 0.5).sum()).backward()
        grads.append((y_t.grad, theta_t.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)

    def f(y_t, theta_t):
        post = ks.smooth(y_t, theta=theta_t, sigma=0.8, obs_var=0.5, backend="cpu")
        return post.mean.sum() + post.var.sum()

    y_t = torch.tensor(np.nan_to_num(y[:, :5]), requires_grad=True)
    theta_t = torch.tensor(theta[..., :5, :] if len(shape) == 2 and shape[0] == 9 else theta, requires_grad=True)
    assert torch.autograd.gradcheck(f, (y_t, theta_t), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend, names", [
    ("cpu", ("theta", "sigma", "obs_var", "mean", "h", "dt")),
    ("triton", ("theta", "mean")),
])
def test_expanded_per_step_parameter_gradients(backend, names):
    """A per-step parameter given as an expanded view (stride 0 along time) of a ``(C,)`` leaf:
    the fused and compiled backends read it as static and sum its adjoint over time once; the
    gradient equals the materialised tensor's (before, ``theta`` got ``T`` times its gradient)."""
    T, C = 15, 3
    y = torch.randn(2, T, C, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).to(KERNEL_DEVICE)
    for name in names:
        grads = []
        for expand in (True, False):
            leaf = torch.tensor([0.3, 0.5, 0.7], dtype=torch.float64, device=y.device, requires_grad=True)
            kw = dict(theta=0.2, sigma=0.5, obs_var=1.0)
            kw[name] = leaf.expand(T, C) if expand else leaf.expand(T, C).contiguous()
            post = ks.filter(y, backend=backend, **kw)
            grads.append(torch.autograd.grad(post.loglik.sum() + post.mean.sum(), leaf)[0])
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-12, msg=name)
