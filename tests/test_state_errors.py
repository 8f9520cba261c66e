"""The NEES check's law of the standardised state errors (``kalmanscan.diagnostics.state_errors``) against an
independent oracle: the errors' exact covariance from conditioning the joint Gaussian of
``(x, y)`` on the observed values, in float64 (no filter recursion involved)."""

import numpy as np
import pytest

import kalmanscan as ks
from kalmanscan.diagnostics import state_errors as E


def _joint(T, theta, sigma, obs_var, dt, init_var):
    """Covariances of the OU state ``x`` (T,) and ``y = x + v``: ``(Sxx, Sxy, Syy)``."""
    t = np.concatenate([[0.0], np.cumsum(dt[1:])])
    a = np.exp(-theta * np.abs(t[:, None] - t[None, :]))
    # x_t = e^{-theta t} x_0 + OU noise: Cov = e^{-theta(t+s)} init_var + stat (e^{-theta|t-s|} - e^{-theta(t+s)})
    stat = sigma**2 / (2 * theta)
    both = np.exp(-theta * (t[:, None] + t[None, :]))
    sxx = both * init_var + stat * (a - both)
    return sxx, sxx, sxx + obs_var * np.eye(T)


def _error_corr(sxx, sxy, syy, seen, smooth):
    """Correlation matrix of ``x_t - E[x_t | observed y up to t (or all)]``."""
    T = len(seen)
    gain = np.zeros((T, T))  # row t: weights of y in the estimate of x_t
    for t in range(T):
        idx = np.flatnonzero(seen & ((np.arange(T) <= t) | smooth))
        if idx.size:
            gain[t, idx] = np.linalg.solve(syy[np.ix_(idx, idx)], sxy[t, idx])
    # e = x - G y: Cov = Sxx - G Syx - Sxy G' + G Syy G'
    cov = sxx - gain @ sxy.T - sxy @ gain.T + gain @ syy @ gain.T
    d = np.sqrt(np.diag(cov))
    return cov / np.outer(d, d), np.diag(cov)


@pytest.mark.parametrize("smooth", [False, True])
@pytest.mark.parametrize("regular", [True, False])
def test_links_give_the_exact_error_correlations(smooth, regular):
    rng = np.random.default_rng(4 + smooth + 2 * regular)
    T, theta, sigma, obs_var, init_var = 13, 0.4, 0.9, 0.6, 2.5
    dt = np.ones(T) if regular else rng.uniform(0.1, 2.0, T)
    seen = rng.random(T) > 0.3
    seen[[4, 5, 6]] = False  # a gap of three steps
    y = np.where(seen, rng.normal(size=T), np.nan)[:, None]
    times = None if regular else np.concatenate([[0.0], np.cumsum(dt[1:])])
    post = (ks.smooth if smooth else ks.filter)(y, theta=theta, sigma=sigma, obs_var=obs_var, init_var=init_var,
                                                 times=times)
    corr, var = _error_corr(*_joint(T, theta, sigma, obs_var, dt, init_var), seen, smooth)
    np.testing.assert_allclose(post.var[:, 0], var, rtol=1e-10)
    c = E.links(post)[:, 0]
    assert c[0] == 0
    chain = np.ones((T, T))
    for i in range(T):
        for j in range(i + 1, T):
            chain[i, j] = chain[j, i] = np.prod(c[i + 1:j + 1])
    np.testing.assert_allclose(chain, corr, rtol=1e-9, atol=1e-12)


def test_cumulants_equal_the_traces_of_the_correlation_powers():
    """Over two series with left-out steps: ``k2 = 2 tr(R^2)``, ``k3 = 8 tr(R^3)`` of the scored
    steps' correlation matrix built from the links."""
    rng = np.random.default_rng(1)
    T = 40
    c = rng.uniform(-0.95, 0.95, size=(T, 2))
    c[0] = 0
    c[17, 1] = 0  # a link broken (an improper step)
    scored = rng.random((T, 2)) > 0.25
    k = np.zeros(3)
    for ch in range(2):
        idx = np.flatnonzero(scored[:, ch])
        r = np.array([[np.prod(c[min(i, j) + 1:max(i, j) + 1, ch]) for j in idx] for i in idx])
        k += [idx.size, 2 * np.trace(r @ r), 8 * np.trace(r @ r @ r)]
    np.testing.assert_allclose(E.cumulants(c, scored), k, rtol=1e-12)
    assert E.cumulants(np.zeros((0, 2)), np.zeros((0, 2), bool)) == (0.0, 0.0, 0.0)
    n, k2, _ = E.cumulants(np.zeros((T, 2)), scored)  # independent errors: the plain count
    assert E.effective_count(n, k2) == pytest.approx(scored.sum())


def test_diffuse_prior_links_break_at_the_improper_steps():
    x, y = ks.datasets.simulate(theta=0.0, sigma=1.0, obs_var=1.0, T=60, init_var=1.0, seed=2)
    y[:5] = np.nan
    post = ks.filter(y, theta=0.0, sigma=1.0, obs_var=1.0, init_var=float("inf"))
    c = E.links(post)
    assert np.all(np.isfinite(c)) and np.all(c[:6] == 0) and np.all(c[6:] > 0)


def test_three_cumulant_band_is_chi_square_for_independent_terms():
    from kalmanscan import diagnostics as D
    n, a = 500, 0.01
    from scipy import stats
    band, p = D.quadratic_form_check(1.07, (n, 2 * n, 8 * n), a)
    band0 = stats.chi2.ppf([a / 2, 1 - a / 2], n) / n
    p0 = 2 * stats.chi2.sf(1.07 * n, n)
    np.testing.assert_allclose(band, band0, rtol=1e-12)
    assert p == pytest.approx(p0, rel=1e-10)
