"""Regression tests of the edge cases a differential test found (tests/test_differential.py):
states and predictions of variance exactly 0, subnormal predicted variances, and the reference
smoother checked against the 60-digit oracle (tests/oracle.py)."""

from __future__ import annotations

import os

import numpy as np
import oracle
import pytest
import torch

import kalmanscan as ks

BACKENDS = ("cpu", "torch", "reference")
# the smoothers' cases on the triton kernels too, where they run on CPU tensors (the interpreter)
SMOOTHERS = BACKENDS + (("triton",) if os.environ.get("TRITON_INTERPRET") == "1" else ())


@pytest.mark.parametrize("backend", BACKENDS)
def test_stream_continues_from_a_prediction_of_variance_zero(backend):
    # sigma = 0 and decay exp(-1000) = 0: the prior of the second chunk has variance exactly 0
    y = np.array([[0.5], [1.0], [-0.3]])
    kw = dict(theta=1e3, sigma=0.0, obs_var=1.0, backend=backend)
    first = ks.filter(y[:1], init_var=1.0, **kw)
    later = ks.filter(y[1:], state=first, **kw)
    whole = ks.filter(y, init_var=1.0, **kw)
    np.testing.assert_array_equal(later.var[:, 0], [0.0, 0.0])
    np.testing.assert_allclose(later.loglik, [-2.38287707], rtol=1e-8)
    np.testing.assert_allclose(first.loglik + later.loglik, whole.loglik, rtol=1e-15)
    np.testing.assert_array_equal(later.mean, whole.mean[1:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_channel_without_noise_beside_a_diffuse_channel_with_gaps(backend):
    y = np.array([[0.0, np.nan], [0.0, 1.0], [0.0, np.nan]])
    post = ks.filter(y, theta=np.array([1e3, 1.0]), sigma=np.array([0.0, 1.0]), obs_var=1.0,
                     init_var=np.array([1.0, np.inf]), backend=backend)
    np.testing.assert_array_equal(post.var[:, 0], [0.5, 0.0, 0.0])
    assert not np.isnan(post.mean).any() and not np.isnan(post.loglik).any()


@pytest.mark.parametrize("backend", SMOOTHERS)
def test_smoother_through_a_subnormal_predicted_variance(backend):
    # decay exp(-353): the predicted variance a^2 var_0 = 2.4e-310 is subnormal, and the next step
    # has no process noise; the smoothed variance at 0 is the filtered one to 1e-300 relative
    kw = dict(theta=1.0, sigma=np.array([[1.0], [0.0]]), obs_var=1e-3, init_var=1.0, times=np.array([0.0, 353.0]))
    post = ks.smooth(np.array([[0.5], [1.0]]), backend=backend, **kw)
    decay, noise = ks.ou.discretize(1.0, kw["sigma"], np.array([[1.0], [353.0]]))
    truth = oracle.smooth(np.array([[0.5], [1.0]]), decay, noise, 1e-3, 1.0, 0.0, 0.0, 1.0)
    np.testing.assert_allclose(post.var[0], truth["smooth_var"][0], rtol=1e-12)
    np.testing.assert_allclose(post.var[0], 1e-3 / 1.001, rtol=1e-12)
    np.testing.assert_allclose(post.filtered.var[1], truth["var"][1], rtol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_of_variance_zero_is_accepted(backend):
    # without process noise the filtered variance reaches 0 (decay underflows); its state continues
    y = np.array([[0.5], [1.0], [-0.3], [0.2]])
    kw = dict(theta=1e3, sigma=0.0, obs_var=1.0, backend=backend)
    first = ks.filter(y[:2], init_var=1.0, **kw)
    assert first.state.var[0] == 0.0
    later = ks.filter(y[2:], state=first, **kw)
    whole = ks.filter(y, init_var=1.0, **kw)
    np.testing.assert_array_equal(later.var, whole.var[2:])
    np.testing.assert_array_equal(later.mean, whole.mean[2:])
    np.testing.assert_allclose(first.loglik + later.loglik, whole.loglik, rtol=1e-15)


@pytest.mark.parametrize("backend", SMOOTHERS)
def test_smoother_of_a_stream_continued_from_a_known_state(backend):
    y = np.array([[0.5], [1.0], [-0.3], [0.2]])
    kw = dict(theta=1e3, sigma=0.0, obs_var=1.0, backend=backend)
    first = ks.filter(y[:2], init_var=1.0, **kw)
    smoothed = ks.smooth(y[2:], state=first, **kw)
    np.testing.assert_array_equal(smoothed.var, [[0.0], [0.0]])
    np.testing.assert_array_equal(smoothed.mean, [[0.0], [0.0]])  # decay 0: the OU mean, known


def test_known_state_keeps_its_gradient():
    # d loglik / d state.var through a variance of 0: the prediction's decay^2 times the
    # gradient with respect to the chunk's prior variance
    y = torch.tensor([[0.7], [-0.2]], dtype=torch.float64)
    var = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    state = ks.StreamState(mean=torch.tensor([0.3], dtype=torch.float64), var=var)
    post = ks.filter(y, theta=0.5, sigma=0.0, obs_var=1.0, backend="torch", state=state)
    post.loglik.sum().backward()
    decay = np.exp(-0.5)
    init_var = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    direct = ks.filter(y, theta=0.5, sigma=0.0, obs_var=1.0, backend="torch",
                       init_mean=torch.tensor([0.3 * decay], dtype=torch.float64), init_var=init_var + 1e-300)
    direct.loglik.sum().backward()
    np.testing.assert_allclose(var.grad.numpy(), decay**2 * init_var.grad.numpy(), rtol=1e-12)


def test_negative_state_variance_names_the_state():
    with pytest.raises(ValueError, match=r"state.var must be >= 0"):
        ks.filter(np.zeros((3, 1)), theta=1.0, sigma=1.0, obs_var=1.0,
                  state=ks.StreamState(mean=np.zeros(1), var=-np.ones(1)))
    with pytest.raises(ValueError, match=r"state.var must be >= 0"):
        ks.filter(np.zeros((3, 1)), theta=1.0, sigma=1.0, obs_var=1.0,
                  state=ks.StreamState(mean=np.zeros(1), var=np.array([np.nan])))


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_process_noise_alike_on_every_backend(backend):
    # sigma = 0 on one channel, from a stationary channel beside it: the filter and a stream
    # continued at every split equal the reference (and the oracle)
    rng = np.random.default_rng(3)
    y = rng.normal(size=(7, 2))
    y[2, 0] = np.nan
    kw = dict(theta=np.array([0.8, 0.3]), sigma=np.array([0.0, 1.0]), obs_var=np.array([0.5, 2.0]),
              init_var=np.array([2.0, 1.5]))
    decay, noise = ks.ou.discretize(kw["theta"], kw["sigma"], 1.0)
    truth = oracle.filter(y, decay, noise, kw["obs_var"], 1.0, 0.0, 0.0, kw["init_var"])
    whole = ks.filter(y, backend=backend, **kw)
    np.testing.assert_allclose(whole.var, truth["var"], rtol=1e-13)
    np.testing.assert_allclose(whole.mean, truth["mean"], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(whole.loglik, truth["loglik"], rtol=1e-13)
    for split in range(1, 7):
        first = ks.filter(y[:split], backend=backend, **kw)
        later = ks.filter(y[split:], backend=backend, state=first, **{k: kw[k] for k in ("theta", "sigma", "obs_var")})
        np.testing.assert_allclose(later.var, truth["var"][split:], rtol=1e-13)
        np.testing.assert_allclose(first.loglik + later.loglik, truth["loglik"], rtol=1e-13)


def _random_smoothing_problem(rng, T, C):
    y = rng.normal(size=(T, C))
    y[rng.random((T, C)) < 0.2] = np.nan
    theta = 10.0 ** rng.uniform(-2, 2, (T, C))
    sigma = 10.0 ** rng.uniform(-2, 1, (T, C))
    sigma[:, 0] = 0.0
    kw = dict(theta=theta, sigma=sigma, obs_var=10.0 ** rng.uniform(-3, 2, (T, C)), h=rng.uniform(0.5, 2.0, (T, C)),
              mean=rng.normal(size=(T, C)), dt=rng.uniform(0.1, 3.0, (T, 1)), init_mean=rng.normal(size=C),
              init_var=rng.uniform(0.1, 3.0, C))
    return y, kw


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("T", [1, 2, 63])
def test_reference_smoother_is_exact(seed, T):
    # the reference's smoothed variance within a few ulps a step of the 60-digit oracle
    y, kw = _random_smoothing_problem(np.random.default_rng(seed), T, 3)
    decay, noise = ks.ou.discretize(kw["theta"], kw["sigma"], kw["dt"])
    truth = oracle.smooth(y, decay, noise, kw["obs_var"], kw["h"], kw["mean"], kw["init_mean"], kw["init_var"])
    post = ks.smooth(y, backend="reference", **kw)
    np.testing.assert_allclose(post.var, truth["smooth_var"], rtol=64 * T * 2.2e-16, atol=1e-300)
    np.testing.assert_allclose(post.filtered.var, truth["var"], rtol=8 * T * 2.2e-16, atol=1e-300)
    np.testing.assert_allclose(post.loglik, truth["loglik"], rtol=1e-13)


def test_reference_smoother_where_the_textbook_form_cancels():
    # a weak observation, then a strong one after little process noise (1e-8): var_s_0 is 1e-8 of
    # var_0, and the textbook var_0 + J^2 (var_s_1 - pred_var_1) kept 6 digits of it (5.9e-10)
    y = np.array([[0.3], [1.0], [0.2]])
    kw = dict(theta=1e-3, sigma=1e-4, obs_var=np.array([[1e6], [1e-12], [1e6]]), init_var=1.0)
    decay, noise = ks.ou.discretize(1e-3, 1e-4, 1.0)
    truth = oracle.smooth(y, decay, noise, kw["obs_var"], 1.0, 0.0, 0.0, 1.0)
    for backend in SMOOTHERS:
        post = ks.smooth(y, backend=backend, **kw)
        np.testing.assert_allclose(post.var, truth["smooth_var"], rtol=1e-13, err_msg=backend)


@pytest.fixture(scope="module")
def long_without_noise():
    """2000 steps without process noise, where the filtered variance underflows to 0 (at about
    step 350 on channel 0), and the oracle's smoother of them."""
    y = np.random.default_rng(8).normal(size=(2000, 2))
    kw = dict(theta=np.array([1.0, 0.3]), sigma=0.0, obs_var=0.7, init_var=2.0)
    decay, noise = ks.ou.discretize(kw["theta"], 0.0, 1.0)
    return y, kw, oracle.smooth(y, decay, noise, 0.7, 1.0, 0.0, 0.0, 2.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_series_without_process_noise_smooths(backend, long_without_noise):
    y, kw, truth = long_without_noise
    post = ks.smooth(y, backend=backend, **kw)
    np.testing.assert_allclose(post.var, truth["smooth_var"], rtol=1e-12, atol=np.finfo(np.float64).tiny)
    np.testing.assert_allclose(post.mean, truth["smooth_mean"], rtol=0, atol=1e-13)


@pytest.mark.parametrize("backend", SMOOTHERS)
def test_smoother_where_the_decay_underflows_without_noise(backend):
    # sigma = 0 and theta dt about 600: a^2 var_0 is below the range, the predicted variance 0;
    # the smoothed belief at step 0 is the filtered one (the next state says nothing of it)
    y = np.array([[[2.02932667], [1.5015557]], [[0.72390716], [1.55758451]]])
    kw = dict(theta=np.array([[[1.1774155], [504.408246]], [[7.3275312e-3], [491.922495]]]), sigma=0.0,
              obs_var=0.34670387, mean=1.96621556, h=1.1137987, times=np.array([0.55843218, 1.32364594]),
              init_mean=np.array([[-0.73645409], [-0.16290995]]), init_var=np.array([[0.16322223], [0.65161573]]))
    post = ks.smooth(y, backend=backend, **kw)
    np.testing.assert_array_equal(post.var[:, 1], [[0.0], [0.0]])
    np.testing.assert_allclose(post.var[:, 0], post.filtered.var[:, 0], rtol=1e-15)
    np.testing.assert_allclose(post.mean[:, 0], post.filtered.mean[:, 0], rtol=1e-15)


def test_smoother_gradients_where_the_predicted_variance_is_zero():
    # sigma = 0 and decays exp(-1000) = 0 and exp(-400): predicted variances 0 from step 1 on;
    # the cpu adjoint follows the forward's limit and equals autograd through the torch scans
    grads = []
    for backend in ("cpu", "torch"):
        y = torch.tensor([[0.5, 0.1], [1.0, 0.3], [-0.3, np.nan], [0.2, 0.4]], dtype=torch.float64, requires_grad=True)
        theta = torch.tensor([1e3, 400.0], dtype=torch.float64, requires_grad=True)
        obs_var = torch.tensor([1.0, 0.5], dtype=torch.float64, requires_grad=True)
        post = ks.smooth(y, theta=theta, sigma=0.0, obs_var=obs_var, init_var=1.0, backend=backend)
        (post.mean.sum() + post.var.sum() + post.loglik.sum()).backward()
        grads.append([x.grad for x in (y, theta, obs_var)])
        assert all(torch.isfinite(g).all() for g in grads[-1]), backend
    for cpu_grad, torch_grad in zip(*grads):
        torch.testing.assert_close(cpu_grad, torch_grad, rtol=1e-12, atol=1e-300)


@pytest.mark.parametrize("dt", [300.0, 353.0])
def test_smoother_gradients_through_a_tiny_predicted_variance(dt):
    # predicted variances 2e-264 and 2.4e-310 (subnormal): pred_var^2 underflows, so a quotient
    # differentiated as -g x / y^2 gave NaN; the smoothed belief at step 0 is the filtered one,
    # N(y_0 / (1 + R), R / (1 + R)), whose var + mean has the derivatives 1 / (1 + R) in y_0 and
    # (1 - y_0) / (1 + R)^2 in R = obs_var
    for backend in ("cpu", "torch"):
        y = torch.tensor([[0.5], [1.0]], dtype=torch.float64, requires_grad=True)
        obs_var = torch.tensor(1e-3, dtype=torch.float64, requires_grad=True)
        post = ks.smooth(y, theta=1.0, sigma=torch.tensor([[1.0], [0.0]], dtype=torch.float64), obs_var=obs_var,
                         init_var=1.0, times=np.array([0.0, dt]), backend=backend)
        (post.var[0].sum() + post.mean[0].sum()).backward()
        np.testing.assert_allclose(y.grad.numpy()[:, 0], [1.0 / 1.001, 0.0], rtol=1e-12, atol=1e-100)
        np.testing.assert_allclose(obs_var.grad.item(), 0.5 / 1.001**2, rtol=1e-12)


@pytest.mark.parametrize("smooth", [False, True])
def test_gradient_in_y_under_a_diffuse_prior(smooth):
    # only y needs a gradient: the torch filter's variance, saved for the mean's backward, must
    # not be the tensor the diffuse restore then writes in place (it was: "modified by an inplace
    # operation"); the gradient equals the cpu backend's adjoint
    grads = []
    for backend in ("torch", "cpu"):
        y = torch.tensor([[0.3, np.nan], [1.0, 0.2], [-0.5, 0.1]], dtype=torch.float64, requires_grad=True)
        post = (ks.smooth if smooth else ks.filter)(y, theta=0.5, sigma=1.0, obs_var=0.5, init_var=np.inf,
                                                    backend=backend)
        (post.mean.sum() + post.loglik.sum()).backward()
        grads.append(y.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-15)


def _oracle_slopes(y, theta, dt, mean, init_var, weights):
    """The exact slopes of ``sum(weights * smoothed mean)`` (``sigma = 0``, ``obs_var = 0.25``,
    ``init_mean`` the OU mean) in the OU mean and in each observed ``y_t``: the smoothed mean is
    affine in both, so a difference of two 60-digit oracle runs over a dyadic step is the slope
    to within the runs' final rounding."""
    decay, noise = ks.ou.discretize(theta, 0.0, dt)

    def loss(y, m):
        return float(np.sum(weights * oracle.smooth(y, decay, noise, 0.25, 1.0, m, m, init_var)["smooth_mean"]))

    step = 0.125
    d_mean = (loss(y, mean + step) - loss(y, mean - step)) / (2 * step)
    d_y = np.zeros_like(y)
    for t in np.flatnonzero(~np.isnan(y[:, 0])):
        up, down = y.copy(), y.copy()
        up[t, 0] += step
        down[t, 0] -= step
        d_y[t, 0] = (loss(up, mean) - loss(down, mean)) / (2 * step)
    return d_mean, d_y


NAN = np.nan
NO_NOISE_CASES = [  # (y, theta, dt): steps without an observation after or between observations
    ([[4.94], [1.23], [NAN], [NAN], [NAN]], 10.0, 1.12),
    ([[4.94], [NAN], [NAN], [1.23], [NAN]], 10.0, 1.12),
    ([[0.7], [-0.4], [NAN], [2.1], [NAN], [NAN], [0.3]], 3.0, 1.0),
    ([[1.5], [NAN], [-0.2], [NAN], [NAN], [NAN]], 30.0, 1.0),
    ([[0.2], [0.9], [NAN], [NAN], [NAN], [NAN]], 100.0, 1.0),
    ([[-1.1], [0.4], [0.6], [NAN], [NAN]], 0.5, 2.0),
]


@pytest.mark.parametrize("backend", SMOOTHERS[:2] + SMOOTHERS[3:])  # (the reference has no gradient)
@pytest.mark.parametrize("case", range(len(NO_NOISE_CASES)))
def test_smoother_gradient_without_process_noise(backend, case):
    # sigma = 0 and theta dt up to 100: the smoother's gain J = 1 / a compounds over the steps
    # without an observation; the gradient of the smoothed mean in the OU mean came through a
    # difference that J^k amplified (the first case: 4.006 by finite differences, -0.994 on the
    # torch backend, 3.006 on the cpu one, for the sum of the smoothed means); it equals the
    # oracle's exact slopes, in the OU mean and in y
    y, theta, dt = NO_NOISE_CASES[case]
    y = np.array(y)
    weights = np.random.default_rng(case).uniform(0.5, 1.5, size=y.shape)
    d_mean, d_y = _oracle_slopes(y, theta, dt, 0.3, 40.0, weights)
    yt = torch.tensor(y, requires_grad=True)
    mean = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    post = ks.smooth(yt, theta=theta, sigma=0.0, obs_var=0.25, dt=dt, mean=mean, init_var=40.0, backend=backend)
    (post.mean * torch.tensor(weights)).sum().backward()
    scale = np.abs(weights).sum()
    np.testing.assert_allclose(mean.grad.item(), d_mean, rtol=1e-10, atol=1e-13 * scale)
    np.testing.assert_allclose(torch.nan_to_num(yt.grad).numpy(), d_y, rtol=1e-10, atol=1e-13 * scale)


@pytest.mark.parametrize("backend", ("cpu", "torch"))
def test_smoother_gradcheck_without_process_noise(backend):
    # float64 gradcheck of the smoothed moments in y, the OU mean, obs_var and init_var through
    # trailing and interior steps without an observation (sigma = 0, theta dt = 11.2)
    y = torch.tensor([[4.94], [1.23], [NAN], [0.4], [NAN], [NAN]], dtype=torch.float64)
    seen = ~torch.isnan(y)

    def smoothed(y_seen, mean, obs_var, init_var):
        full = torch.where(seen, torch.zeros_like(y), y).masked_scatter(seen, y_seen)
        post = ks.smooth(full, theta=10.0, sigma=0.0, obs_var=obs_var, dt=1.12, mean=mean, init_var=init_var,
                         backend=backend)
        return post.mean, post.var

    args = (y[seen].clone(), torch.tensor(0.3, dtype=torch.float64), torch.tensor(0.25, dtype=torch.float64),
            torch.tensor(40.0, dtype=torch.float64))
    assert torch.autograd.gradcheck(smoothed, tuple(x.requires_grad_() for x in args))


@pytest.mark.slow  # the only float32 user of the smoother's compiled backward: its first compile is about 7 s
@pytest.mark.parametrize("case", range(len(NO_NOISE_CASES)))
def test_smoother_parameter_gradients_without_process_noise(case):
    # the gradients of the smoothed mean and variance in theta, obs_var and init_var: the cpu
    # adjoint (of its ratio form) equals autograd through the torch scans and the reference's
    # central difference in theta; in float32 they stay finite (the textbook form's adjoint carried
    # J^2 = 1 / a^2 a step and overflowed, NaN)
    y, theta, dt = NO_NOISE_CASES[case]
    weights = np.random.default_rng(case).uniform(0.5, 1.5, size=np.shape(y))
    grads = {}
    for backend, dtype in (("cpu", torch.float64), ("torch", torch.float64), ("cpu", torch.float32),
                           ("torch", torch.float32)):
        leaves = [torch.tensor(x, dtype=dtype, requires_grad=True) for x in (theta, 0.25, 40.0)]
        post = ks.smooth(torch.tensor(y, dtype=dtype), theta=leaves[0], sigma=0.0, obs_var=leaves[1], dt=dt,
                         mean=0.3, init_var=leaves[2], backend=backend)
        w = torch.tensor(weights, dtype=dtype)
        ((post.mean * w).sum() + (post.var * w).sum()).backward()
        grads[backend, dtype] = np.array([x.grad.item() for x in leaves])
    scale = np.abs(grads["torch", torch.float64]).max()
    np.testing.assert_allclose(grads["cpu", torch.float64], grads["torch", torch.float64], rtol=1e-9,
                               atol=1e-12 * scale)
    for backend in ("cpu", "torch"):
        np.testing.assert_allclose(grads[backend, torch.float32], grads[backend, torch.float64], rtol=0,
                                   atol=1e-4 * scale)

    def loss(t):
        post = ks.smooth(np.array(y), theta=t, sigma=0.0, obs_var=0.25, dt=dt, mean=0.3, init_var=40.0,
                         backend="reference")
        return float(np.sum(weights * (post.mean + post.var)))

    step = 1e-6 * theta
    slope = (loss(theta + step) - loss(theta - step)) / (2 * step)
    np.testing.assert_allclose(grads["cpu", torch.float64][0], slope, rtol=1e-5, atol=1e-7 * scale)


def test_smoother_gradients_agree_on_random_problems_without_process_noise():
    # 40 small problems, most channels without process noise, theta dt up to about 90, a third of
    # the values missing: every gradient of the weighted smoothed moments, the cpu adjoint against
    # autograd through the torch scans
    rng = np.random.default_rng(5)
    for _ in range(40):
        T, C = int(rng.integers(2, 12)), 3
        y = rng.normal(size=(T, C))
        y[rng.random((T, C)) < 0.35] = np.nan
        kw = dict(theta=rng.choice([0.3, 3.0, 11.0, 40.0], C) * rng.uniform(0.5, 1.5, C),
                  sigma=np.where(rng.random(C) < 0.6, 0.0, rng.uniform(0.1, 1, C)), obs_var=rng.uniform(0.1, 1, C),
                  mean=rng.normal(size=C), h=rng.uniform(0.5, 2, C), init_mean=rng.normal(size=C),
                  init_var=rng.uniform(0.5, 40, C))
        dt, w = float(rng.uniform(0.3, 1.5)), torch.tensor(rng.uniform(0.5, 1.5, (T, C)))
        grads = []
        for backend in ("cpu", "torch"):
            leaves = {k: torch.tensor(v, requires_grad=True) for k, v in kw.items()}
            yt = torch.tensor(y, requires_grad=True)
            post = ks.smooth(yt, dt=dt, backend=backend, **leaves)
            ((post.mean * w).sum() + (post.var * w).sum()).backward()
            grads.append([torch.nan_to_num(yt.grad)] + [leaves[k].grad for k in kw])
        for name, a, b in zip(["y", *kw], *grads):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-9 * max(b.abs().max().item(), 1e-3), msg=name)
