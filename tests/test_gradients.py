"""The torch backend is differentiable: gradcheck in float64 against finite differences."""

import numpy as np
import torch
from helpers import DEVICE, NAMES, random_problem

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
