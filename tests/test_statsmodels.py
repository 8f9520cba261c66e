"""The float64 reference against statsmodels' Kalman filter (an independent implementation)."""

import numpy as np
import statsmodels.api as sm

import kalmanscan as ks


def test_nile_local_level():
    y = ks.datasets.load_nile().y
    level_var, obs_var, init_mean, init_var = 1469.1, 15099.0, 1000.0, 1e6
    mod = sm.tsa.UnobservedComponents(y[:, 0], "llevel")
    mod.ssm.initialize_known(np.array([init_mean]), np.array([[init_var]]))
    res = mod.smooth([obs_var, level_var])
    # statsmodels' known initialisation is the predicted state a_1 ~ N(a, P) before y_1: the
    # same convention as ours (the belief at the first observation time).
    post = ks.smooth(y, theta=0.0, sigma=np.sqrt(level_var), obs_var=obs_var,
                     init_mean=init_mean, init_var=init_var, backend="reference")
    f = post.filtered
    np.testing.assert_allclose(f.mean[:, 0], res.filtered_state[0], rtol=1e-10)
    np.testing.assert_allclose(f.var[:, 0], res.filtered_state_cov[0, 0], rtol=1e-10)
    np.testing.assert_allclose(f.pred_obs_var[:, 0], res.forecasts_error_cov[0, 0], rtol=1e-10)
    np.testing.assert_allclose(f.logliks[:, 0], res.llf_obs, rtol=1e-10)
    np.testing.assert_allclose(post.mean[:, 0], res.smoothed_state[0], rtol=1e-10)
    np.testing.assert_allclose(post.var[:, 0], res.smoothed_state_cov[0, 0], rtol=1e-10)
    torch_post = ks.smooth(y, theta=0.0, sigma=np.sqrt(level_var), obs_var=obs_var,
                           init_mean=init_mean, init_var=init_var, backend="torch")
    np.testing.assert_allclose(torch_post.mean[:, 0], res.smoothed_state[0], rtol=1e-10)
    np.testing.assert_allclose(torch_post.loglik, res.llf_obs.sum(), rtol=1e-12)


def test_nile_default_initialisation_and_burn_in():
    """statsmodels' default for the local level is an approximate diffuse prior N(0, 1e6) at the
    first observation, and its llf drops the first observation (burn-in of one step)."""
    y = ks.datasets.load_nile().y
    mod = sm.tsa.UnobservedComponents(y[:, 0], "llevel")
    res = mod.filter([15099.0, 1469.1])
    assert res.loglikelihood_burn == 1
    post = ks.filter(y, theta=0.0, sigma=np.sqrt(1469.1), obs_var=15099.0, init_mean=0.0, init_var=1e6,
                     backend="torch")
    np.testing.assert_allclose(post.mean[:, 0], res.filtered_state[0], rtol=1e-10)
    np.testing.assert_allclose(post.logliks[1:, 0].sum(), res.llf, rtol=1e-12)


def test_ar1_plus_noise():
    rng = np.random.default_rng(3)
    phi_ar, ar_var, obs_var = 0.8, 0.5, 0.3
    x = np.zeros(300)
    for t in range(1, 300):
        x[t] = phi_ar * x[t - 1] + np.sqrt(ar_var) * rng.normal()
    y = x + np.sqrt(obs_var) * rng.normal(size=300)
    y[50:55] = np.nan
    mod = sm.tsa.UnobservedComponents(y, irregular=True, autoregressive=1)
    mod.ssm.tolerance = 0.0  # no steady-state shortcut: update the covariance at every step
    res = mod.filter([obs_var, ar_var, phi_ar])
    # AR(1) with coefficient a and innovation variance s2 is the OU process with dt = 1,
    # theta = -log a and sigma from the inverse discretisation; statsmodels starts stationary.
    theta, sigma = ks.ou.continuous(phi_ar, ar_var, 1.0)
    post = ks.filter(y[:, None], theta=theta, sigma=sigma, obs_var=obs_var, backend="reference")
    np.testing.assert_allclose(post.mean[:, 0], res.filtered_state[0], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(post.var[:, 0], res.filtered_state_cov[0, 0], rtol=1e-10)
    np.testing.assert_allclose(post.loglik[0], res.llf, rtol=1e-10)
    torch_post = ks.filter(y[:, None], theta=theta, sigma=sigma, obs_var=obs_var, backend="torch")
    np.testing.assert_allclose(torch_post.loglik[0], res.llf, rtol=1e-10)
