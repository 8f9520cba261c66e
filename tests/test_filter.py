"""The torch backend against the sequential float64 covariance-form reference."""

import numpy as np
import pytest
import torch
from helpers import on_device, posterior_error, random_problem

import kalmanscan as ks

# Worst float32 error of the torch backend measured over random problems up to T = 5000 was
# 5.5e-7 (relative, on the variance); the bound leaves a factor of ~7 (see docs/math.md).
FLOAT32_BOUND = 4e-6


@pytest.mark.parametrize("T", [1, 2, 63, 64, 1000])
@pytest.mark.parametrize("per_step", [False, True])
@pytest.mark.parametrize("times", [False, True])
def test_torch_equals_reference_float64(T, per_step, times):
    rng = np.random.default_rng(1000 * T + 10 * per_step + times)
    y, kw = random_problem(rng, T, per_step=per_step, times=times)
    ref = ks.filter(y, backend="reference", **kw)
    out = ks.filter(on_device(y), backend="torch", **kw)
    assert out.mean.device.type == on_device(y).device.type
    err, errs = posterior_error(out, ref)
    assert err < 1e-10, errs


def test_defaults_and_offsets():
    rng = np.random.default_rng(5)
    y = 1e4 + rng.normal(size=(300, 2))
    kw = dict(theta=[0.3, 1.2], sigma=[1.0, 0.4], obs_var=0.5, mean=1e4)
    err, errs = posterior_error(ks.filter(y, backend="torch", **kw), ks.filter(y, backend="reference", **kw))
    assert err < 1e-10, errs


def test_parameters_add_batch_dims_and_times_per_batch():
    rng = np.random.default_rng(6)
    T = 50
    y = rng.normal(size=(T, 2))
    theta = rng.uniform(0.1, 1, (3, 1, 2))
    times = np.cumsum(rng.uniform(0.1, 2, (3, T, 1)), axis=1)
    kw = dict(theta=theta, sigma=0.8, obs_var=[0.3, 0.9], times=times, h=1.5)
    out = ks.filter(y, backend="torch", **kw)
    assert out.mean.shape == (3, T, 2) and out.loglik.shape == (3, 2)
    err, errs = posterior_error(out, ks.filter(y, backend="reference", **kw))
    assert err < 1e-10, errs


def test_random_walk_with_init_var():
    rng = np.random.default_rng(7)
    y = np.cumsum(rng.normal(size=(200, 1)), 0) + rng.normal(size=(200, 1))
    kw = dict(theta=0.0, sigma=1.0, obs_var=1.0, init_var=10.0, init_mean=0.0)
    err, errs = posterior_error(ks.filter(y, backend="torch", **kw), ks.filter(y, backend="reference", **kw))
    assert err < 1e-10, errs


def test_missing_values_contribute_nothing():
    rng = np.random.default_rng(8)
    y, kw = random_problem(rng, 40, missing=0.0)
    y[:, 5:9, 1] = np.nan
    post = ks.filter(y, backend="torch", **kw)
    assert np.all(post.logliks[:, 5:9, 1] == 0)
    np.testing.assert_allclose(post.loglik, post.logliks.sum(-2), rtol=1e-12)
    # A missing step is a pure prediction: the filtered moments equal the predicted ones.
    np.testing.assert_allclose(post.mean[:, 5:9, 1], post.pred_mean[:, 5:9, 1], rtol=1e-12)
    np.testing.assert_allclose(post.var[:, 5:9, 1], post.pred_var[:, 5:9, 1], rtol=1e-12)


def test_all_missing_channel_is_the_prior_path():
    y = np.full((30, 1), np.nan)
    post = ks.filter(y, theta=0.5, sigma=1.0, obs_var=1.0, backend="torch")
    np.testing.assert_allclose(post.var, 1.0, rtol=1e-12)  # the stationary variance sigma^2/(2 theta)
    np.testing.assert_allclose(post.mean, 0.0, atol=1e-15)
    assert np.all(post.loglik == 0)


def test_float32_within_measured_bound():
    rng = np.random.default_rng(9)
    worst = 0.0
    for T in (1, 63, 1000):
        y, kw = random_problem(rng, T, per_step=True, times=True)
        ref = ks.filter(y, backend="reference", **kw)
        out = ks.filter(on_device(y, torch.float32), backend="torch", **kw)
        assert out.mean.dtype == torch.float32
        worst = max(worst, posterior_error(out, ref)[0])
    assert worst < FLOAT32_BOUND


def test_numpy_in_numpy_out_torch_in_torch_out():
    rng = np.random.default_rng(10)
    y, kw = random_problem(rng, 20)
    post = ks.filter(y, backend="torch", **kw)
    assert isinstance(post.mean, np.ndarray) and post.mean.dtype == np.float64
    tpost = ks.filter(torch.tensor(y), backend="torch", **kw)
    assert isinstance(tpost.mean, torch.Tensor) and tpost.mean.dtype == torch.float64
    assert tpost.loglik.shape == (2, 3)
    auto = ks.filter(y, **kw)                            # "auto" on the CPU: the compiled loop
    np.testing.assert_array_equal(auto.mean, ks.filter(y, backend="cpu", **kw).mean)
    np.testing.assert_allclose(auto.mean, post.mean, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_computes_in_float32(dtype):
    rng = np.random.default_rng(11)
    y, kw = random_problem(rng, 30, missing=0.0)
    post = ks.filter(torch.tensor(y, dtype=dtype), backend="torch", **kw)
    assert post.mean.dtype == dtype
    ref = ks.filter(torch.tensor(y, dtype=dtype).float(), backend="torch", **kw)
    torch.testing.assert_close(post.mean, ref.mean.to(dtype))


def test_inputs_not_modified():
    rng = np.random.default_rng(12)
    y, kw = random_problem(rng, 25, per_step=True)
    y_t = torch.tensor(y, requires_grad=False)
    copies = {k: np.copy(v) for k, v in kw.items()}
    y_copy = y_t.clone()
    ks.filter(y_t, backend="torch", **kw)
    ks.filter(y, backend="reference", **kw)
    assert torch.equal(torch.nan_to_num(y_t, 7.0), torch.nan_to_num(y_copy, 7.0))
    for k, v in kw.items():
        np.testing.assert_array_equal(v, copies[k])
    post = ks.filter(y, **kw)  # NumPy parameters come back as read-only views
    for k in ("theta", "sigma", "obs_var", "mean", "h", "dt", "times", "init_mean", "init_var"):
        assert not post.params[k].flags.writeable, k
    with pytest.raises(ValueError, match="read-only"):
        post.params["mean"][..., 0, 0] = 99.0
    np.testing.assert_array_equal(kw["mean"], copies["mean"])


def test_gates_match_definitions():
    rng = np.random.default_rng(13)
    y, kw = random_problem(rng, 15)
    post = ks.filter(y, backend="torch", **kw)
    forget, write = post.gates()
    assert np.all(forget[..., 0, :] == 1)
    a, q = post.params["decay"], post.params["noise"]
    want = a[..., 1:, :] / (a[..., 1:, :] ** 2 + q[..., 1:, :] * post.precision[..., :-1, :])
    np.testing.assert_allclose(forget[..., 1:, :], want)
    seen = ~np.isnan(y)
    gain = post.params["h"] ** 2 / post.params["obs_var"] / post.precision
    np.testing.assert_allclose(write[seen], gain[seen])
    assert np.all(write[~seen] == 0)
