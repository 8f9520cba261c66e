"""ks.forecast: equals the float64 reference filter run on y padded with missing values."""

import numpy as np
import pytest
import torch
from helpers import random_problem

import kalmanscan as ks


def _padded(y, K):
    return np.concatenate([y, np.full(y.shape[:-2] + (K,) + y.shape[-1:], np.nan)], -2)


def _assert_matches(fc, ref, T):
    for got, want in ((fc.mean, ref.pred_mean), (fc.var, ref.pred_var),
                      (fc.obs_mean, ref.pred_obs_mean), (fc.obs_var, ref.pred_obs_var)):
        got = got.detach().numpy() if isinstance(got, torch.Tensor) else got
        want = want[..., T:, :]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10 * np.abs(want).max())


@pytest.mark.parametrize("T", [1, 2, 63])
@pytest.mark.parametrize("K", [1, 7])
def test_regular_steps_equal_prediction_with_missing_data(T, K):
    rng = np.random.default_rng(T * 10 + K)
    y, kw = random_problem(rng, T, C=3, batch=(2,), offset=5.0)
    post = ks.filter(y, **kw, backend="reference")
    fc = ks.forecast(post, K)
    _assert_matches(fc, ks.filter(_padded(y, K), **kw, backend="reference"), T)
    np.testing.assert_allclose(fc.lead[..., 0], np.broadcast_to(kw["dt"] * np.arange(1, K + 1), (2, K)))


def test_given_times_equal_prediction_with_missing_data():
    rng = np.random.default_rng(1)
    y, kw = random_problem(rng, 50, C=2, batch=(3,), times=True)
    future = kw["times"][-1] + np.cumsum(rng.uniform(0.01, 4.0, 6))
    post = ks.filter(y, **kw, backend="reference")
    fc = ks.forecast(post, times=future)
    ref = ks.filter(_padded(y, 6), **{**kw, "times": np.concatenate([kw["times"], future])}, backend="reference")
    _assert_matches(fc, ref, 50)
    np.testing.assert_array_equal(fc.times[0, :, 0], future)


def test_torch_smoother_and_filter_forecast_alike_and_differentiably():
    rng = np.random.default_rng(2)
    y, kw = random_problem(rng, 40, C=3, batch=(), times=True)
    ref = ks.forecast(ks.filter(y, **kw, backend="reference"), 4)
    sigma = torch.tensor(kw.pop("sigma"), requires_grad=True)
    yt = torch.tensor(y)
    for fn in (ks.filter, ks.smooth):
        fc = ks.forecast(fn(yt, sigma=sigma, **kw, backend="torch"), 4)
        assert isinstance(fc.var, torch.Tensor) and fc.var.dtype == torch.float64
        np.testing.assert_allclose(fc.var.detach().numpy(), ref.var, rtol=1e-10)
        np.testing.assert_allclose(fc.mean.detach().numpy(), ref.mean, rtol=1e-10, atol=1e-12)
    fc.obs_var.sum().backward()
    assert sigma.grad is not None and torch.all(sigma.grad > 0)


def test_gradient_with_respect_to_dt():
    """The lead of ``steps`` regular steps is ``k dt``: dt's gradient reaches the forecast through
    it and through the filtered belief, equal to a central difference."""
    y = torch.tensor(np.random.default_rng(5).normal(size=(30, 2)))
    kw = dict(theta=torch.tensor([0.3, 0.8], dtype=torch.float64), sigma=1.0, obs_var=0.5, backend="torch")

    def f(dt):
        fc = ks.forecast(ks.filter(y, dt=dt, **kw), 3)
        return (fc.mean + fc.var).sum()

    assert torch.autograd.gradcheck(f, (torch.tensor(0.7, dtype=torch.float64, requires_grad=True),))


def test_times_default_from_dt_and_float32_keeps_absolute_times():
    rng = np.random.default_rng(3)
    y, kw = random_problem(rng, 20, C=2, batch=())
    post = ks.filter(y, **kw, backend="reference")
    last = 19 * kw["dt"]
    np.testing.assert_allclose(post.params["times"][-1], last)
    by_steps = ks.forecast(post, 3)
    by_times = ks.forecast(post, times=last + kw["dt"] * np.arange(1, 4))
    np.testing.assert_allclose(by_times.var, by_steps.var, rtol=1e-12)
    epoch = 1.7e9 + np.arange(20.0) * 0.25
    kw.pop("dt")
    p32 = ks.filter(torch.tensor(y, dtype=torch.float32), **kw, times=epoch)
    assert p32.params["times"].dtype == torch.float64
    fc = ks.forecast(p32, times=np.array([epoch[-1] + 0.25, epoch[-1] + 0.5]))
    np.testing.assert_array_equal(fc.lead[:, 0].numpy(), [0.25, 0.5])
    assert fc.var.dtype == torch.float32
    n32 = ks.forecast(ks.filter(y.astype(np.float32), **kw, times=epoch), 2)  # NumPy float32 stays float32
    assert all(getattr(n32, k).dtype == np.float32 for k in ("mean", "var", "obs_mean", "obs_var"))
    np.testing.assert_allclose(n32.var, fc.var.numpy(), rtol=1e-6)
    assert n32.times.dtype == np.float64


def test_interval():
    rng = np.random.default_rng(4)
    y, kw = random_problem(rng, 10, C=2, batch=())
    fc = ks.forecast(ks.filter(y, **kw), 2)
    lo, hi = fc.interval(0.9)
    np.testing.assert_allclose((hi - lo) / 2, 1.6448536269514722 * np.sqrt(fc.obs_var), rtol=1e-12)
    lo, hi = fc.interval(0.5, of="state")
    np.testing.assert_allclose((hi + lo) / 2, fc.mean, rtol=1e-12)
    with pytest.raises(ValueError, match="level"):
        fc.interval(1.5)
    with pytest.raises(ValueError, match="of"):
        fc.interval(0.9, of="x")


@pytest.mark.parametrize("args, kwargs, match", [
    ((), {}, "exactly one"),
    ((2,), {"times": [30.0]}, "exactly one"),
    ((0,), {}, "steps"),
    ((2.5,), {}, "steps"),
    ((True,), {}, "steps"),
    ((), {"times": [5.0]}, "after the last"),
    ((), {"times": [30.0, 29.0]}, "increasing"),
    ((), {"times": [np.nan]}, "finite"),
    ((), {"times": np.ones((2, 2))}, "shape"),
    ((2,), {"outputs": ("logliks",)}, "mean and var"),
])
def test_bad_input(args, kwargs, match):
    y = np.random.default_rng(0).normal(size=(10, 2))
    outputs = kwargs.pop("outputs", None)  # a posterior without the filtered moments
    post = ks.filter(y, theta=0.5, sigma=1.0, obs_var=1.0, outputs=outputs)
    with pytest.raises(ValueError, match=match):
        ks.forecast(post, *args, **kwargs)


@pytest.mark.parametrize("post", [np.zeros((10, 2)), None, {"mean": np.zeros((10, 2))}])
def test_forecast_of_something_else_than_a_posterior_says_what_it_needs(post):
    with pytest.raises(ValueError, match=r"post must be the Posterior of ks.filter or ks.smooth.*forecast\(ks.filter"):
        ks.forecast(post, steps=3)
