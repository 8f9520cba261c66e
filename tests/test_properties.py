"""Property tests over extreme parameters: finite outputs and agreement with the reference."""

import numpy as np
from helpers import posterior_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kalmanscan as ks

log_uniform = lambda lo, hi: st.floats(np.log10(lo), np.log10(hi)).map(lambda e: 10.0**e)  # noqa: E731


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    T=st.sampled_from([1, 2, 3, 17, 64]),
    obs_var=log_uniform(1e-8, 1e8),
    theta_dt=log_uniform(1e-8, 1e3),
    dt=log_uniform(1e-3, 1e2),
    sigma=log_uniform(1e-3, 1e3),
    offset=st.sampled_from([0.0, 1e4, -1e4]),
    missing=st.floats(0.0, 0.5),
    seed=st.integers(0, 2**16),
)
def test_extreme_parameters_agree_with_reference(T, obs_var, theta_dt, dt, sigma, offset, missing, seed):
    rng = np.random.default_rng(seed)
    theta = theta_dt / dt
    scale = sigma / np.sqrt(2 * theta) + np.sqrt(obs_var)
    y = offset + scale * rng.normal(size=(T, 2))
    y[rng.random((T, 2)) < missing] = np.nan
    kw = dict(theta=theta, sigma=sigma, obs_var=[obs_var, 1.0], mean=offset, dt=dt)
    ref = ks.filter(y, backend="reference", **kw)
    out = ks.filter(y, backend="torch", **kw)
    err, errs = posterior_error(out, ref)
    assert err < 1e-10, errs
