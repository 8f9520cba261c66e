"""ks.diagnostics: elementwise scores against scipy, and the calibration verdict on simulated data."""

import numpy as np
import pytest
import torch
from scipy import integrate, stats

import kalmanscan as ks
from kalmanscan import diagnostics as D
from kalmanscan.diagnostics import state_errors
from kalmanscan.datasets import simulate

PARAMS = dict(theta=np.array([0.2, 0.5]), sigma=np.array([0.5, 1.0]), obs_var=np.array([1.0, 0.5]))


@pytest.fixture(scope="module")
def data():
    x, y = simulate(T=1000, seed=3, **PARAMS)
    y[np.random.default_rng(0).random(y.shape) < 0.1] = np.nan
    return x, y


def _post(y, factor=1.0, smooth=False):
    fn = ks.smooth if smooth else ks.filter
    return fn(y, theta=PARAMS["theta"], sigma=PARAMS["sigma"], obs_var=PARAMS["obs_var"] * factor)


def test_elementwise_scores_match_their_definitions(data):
    x, y = data
    post = _post(y)
    m, s = post.pred_obs_mean, np.sqrt(post.pred_obs_var)
    seen = ~np.isnan(y)
    np.testing.assert_allclose(D.nis(post, y)[seen], ((y - m) / s)[seen] ** 2, rtol=1e-13)
    assert np.all(np.isnan(D.nis(post, y)[~seen])) and np.all(np.isnan(D.pit(post, y)[~seen]))
    np.testing.assert_allclose(D.nees(post, x), (x - post.mean) ** 2 / post.var, rtol=1e-13)
    np.testing.assert_allclose(D.pit(post, y)[seen], stats.norm.cdf(y, m, s)[seen], rtol=1e-13)
    np.testing.assert_allclose(D.log_score(post, y)[seen], -post.logliks[seen], rtol=1e-12)
    # CRPS = integral of (F(z) - 1{z >= y})^2 dz, checked by quadrature at a few points
    c = D.crps(post, y)
    for t, ch in ((3, 0), (50, 1), (999, 0)):
        if not seen[t, ch]:
            continue
        F = stats.norm(m[t, ch], s[t, ch]).cdf
        lo, hi = m[t, ch] - 12 * s[t, ch], m[t, ch] + 12 * s[t, ch]
        num = (integrate.quad(lambda z: F(z) ** 2, lo, y[t, ch])[0]
               + integrate.quad(lambda z: (1 - F(z)) ** 2, y[t, ch], hi)[0])
        assert abs(c[t, ch] - num) < 1e-7 * s[t, ch]


def test_report_statistics_equal_the_elementwise_scores():
    """The report computes every score from one pass over the predictive law: its means equal the
    public functions', and the PIT test is kstest's (asymptotic p-value past KS_EXACT values)."""
    rng = np.random.default_rng(8)
    y = rng.normal(size=(6000, 2))
    y[rng.random(y.shape) < 0.05] = np.nan
    post = ks.filter(y, theta=0.3, sigma=1.0, obs_var=0.5)
    r = D.report(post, y)
    seen = ~np.isnan(y)
    assert r.n_obs > D.KS_EXACT
    assert r.mean_nis == pytest.approx(np.mean(D.nis(post, y)[seen]), rel=1e-12)
    assert r.mean_crps == pytest.approx(np.nanmean(D.crps(post, y)), rel=1e-12)
    assert r.mean_log_score == pytest.approx(np.nanmean(D.log_score(post, y)), rel=1e-12)
    assert r.coverage[0.9] == pytest.approx(D.predictive_coverage(post, y, 0.9), rel=1e-12)
    asymp = stats.kstest(D.pit(post, y)[seen], "uniform", method="asymp")
    assert (r.pit_ks, r.pit_pvalue) == pytest.approx((asymp.statistic, asymp.pvalue), rel=1e-12)


def test_diffuse_steps_are_not_scored():
    """With ``init_var = inf`` each channel's first observation has an infinite predictive
    variance: NaN in every score (as the log-likelihood leaves it out), finite report means."""
    y = ks.datasets.load_nile().y
    post = ks.filter(y, theta=0.0, sigma=38.3, obs_var=15099.0, init_var=float("inf"))
    assert np.isinf(post.pred_obs_var[0, 0]) and post.n_diffuse[0] == 1
    for score in (D.nis, D.pit, D.crps, D.log_score):
        s = score(post, y)
        assert np.isnan(s[0, 0]) and np.all(np.isfinite(s[1:])), score.__name__
    np.testing.assert_allclose(D.log_score(post, y)[1:], -post.logliks[1:], rtol=1e-12)
    np.testing.assert_allclose(np.nansum(D.log_score(post, y)), -post.loglik[0], rtol=1e-12)
    r = D.report(post, y)
    assert (r.n_obs, r.n_missing, r.n_diffuse) == (99, 0, 1) and np.isfinite(r.mean_crps)
    assert np.isfinite(r.mean_log_score) and "1 diffuse, not scored" in repr(r)


def test_improper_posterior_steps_are_not_scored():
    """A diffuse prior with the first 20 values missing: ``var = inf`` there, so NEES is NaN and
    coverage (state and reliability plot) counts only the proper steps."""
    import matplotlib
    matplotlib.use("Agg")
    x, y = simulate(theta=0.0, sigma=1.0, obs_var=1.0, T=200, init_var=1.0, seed=0)
    y[:20] = np.nan
    post = ks.filter(y, theta=0.0, sigma=1.0, obs_var=1.0, init_var=float("inf"))
    assert np.all(np.isinf(post.var[:20])) and np.all(np.isnan(D.nees(post, x)[:20]))
    proper = np.mean(np.abs(x[20:] - post.mean[20:]) <= stats.norm.ppf(0.75) * np.sqrt(post.var[20:]))
    assert D.coverage(post, x, 0.5) == pytest.approx(proper, rel=1e-12)
    assert D.report(post, y, truth=x).state_coverage[0.5] == pytest.approx(proper, rel=1e-12)
    ax = ks.plot.reliability(post, x, levels=[0.5])
    assert ax.lines[-1].get_ydata()[0] == pytest.approx(proper, rel=1e-12)


def test_coverage_shapes_and_torch_posteriors(data):
    x, y = data
    post = _post(y)
    both = D.coverage(post, x, [0.5, 0.9])
    assert both.shape == (2,) and both[0] < both[1]
    assert D.coverage(post, x, 0.9) == pytest.approx(both[1])
    per = D.coverage(post, x, 0.9, axis=-2)
    assert per.shape == (2,)
    assert D.predictive_coverage(post, y, (0.5, 0.8, 0.95), axis=-2).shape == (3, 2)
    tpost = ks.filter(torch.tensor(y), **{k: torch.tensor(v) for k, v in PARAMS.items()})
    np.testing.assert_allclose(D.nis(tpost, torch.tensor(y)), D.nis(post, y), rtol=1e-12)
    np.testing.assert_allclose(D.coverage(tpost, x, [0.5, 0.9]), both)


@pytest.mark.parametrize("smooth", [False, True])
def test_report_says_calibrated_on_data_from_the_model(data, smooth):
    x, y = data
    rep = D.report(_post(y, smooth=smooth), y, truth=x)
    assert rep.calibrated, rep.reasons
    assert rep.reasons == [] and rep.n_obs == int(np.isfinite(y).sum()) and rep.n_checks == 7
    assert rep.nis_band[0] < rep.mean_nis < rep.nis_band[1]
    assert rep.nees_dof == pytest.approx(D.effective_dof(_post(y, smooth=smooth), x), rel=1e-12)
    assert set(rep.coverage) == set(D.LEVELS) and rep.state_coverage is not None
    assert "calibrated" in repr(rep) and "NOT" not in repr(rep)


@pytest.mark.parametrize("factor, way, other", [(4.0, "over-dispersed", "under-dispersed"),
                                                 (0.25, "under-dispersed", "over-dispersed")])
def test_report_catches_misstated_obs_var_and_says_which_way(data, factor, way, other):
    x, y = data
    rep = D.report(_post(y, factor), y, truth=x)
    assert not rep.calibrated
    assert any("NIS" in r and way in r for r in rep.reasons)
    assert any("PIT" in r and way in r for r in rep.reasons)
    assert not any(other in r for r in rep.reasons)
    text = repr(rep)
    assert "NOT calibrated" in text and way in text
    without_truth = D.report(_post(y, factor), y)
    assert not without_truth.calibrated and without_truth.mean_nees is None and without_truth.n_checks == 6


def test_effective_dof_is_the_ar1_count_in_the_steady_state():
    """Without missing values the filter's errors settle into an AR(1) chain of one correlation
    ``c``: ``n`` correlated squares count as ``n (1 - c^2) / (1 + c^2)`` independent ones."""
    x, y = simulate(T=20000, seed=5, theta=0.05, sigma=0.5, obs_var=1.0)
    post = ks.filter(y, theta=0.05, sigma=0.5, obs_var=1.0)
    c = state_errors.links(post)[-1, 0]
    assert 0.5 < c < 1
    assert D.effective_dof(post, x) == pytest.approx(20000 * (1 - c**2) / (1 + c**2), rel=2e-3)
    smoothed = ks.smooth(y, theta=0.05, sigma=0.5, obs_var=1.0)
    assert D.effective_dof(smoothed, x) < D.effective_dof(post, x)


def test_bad_input(data):
    x, y = data
    post = _post(y)
    with pytest.raises(ValueError, match="level"):
        D.coverage(post, x, 1.2)
    with pytest.raises(ValueError, match="y"):
        D.nis(post, y[:10])
    with pytest.raises(ValueError, match="truth"):
        D.nees(post, np.ones((3, 3)))
    with pytest.raises(ValueError, match="alpha"):
        D.report(post, y, alpha=0.0)
    with pytest.raises(ValueError, match="levels"):
        D.report(post, y, levels=(0.5, 1.0))
    with pytest.raises(ValueError, match="observed"):
        D.report(post, np.full_like(y, np.nan))


def test_report_names_nan_or_infinite_inputs_instead_of_judging_them(data):
    import dataclasses

    x, y = data
    post = ks.filter(y, **PARAMS)
    bad_y = y.copy()
    bad_y[7, 1] = -np.inf
    with pytest.raises(ValueError, match=r"y has an infinite value at 1 position\(s\), the first at index \(7, 1\)"):
        D.report(post, bad_y)
    for field in ("pred_obs_mean", "pred_obs_var"):
        values = post.pred_obs_var.copy() if field == "pred_obs_var" else post.pred_obs_mean.copy()
        values[5:, 0] = np.nan
        broken = dataclasses.replace(post, **{field: values})
        with pytest.raises(ValueError, match=f"post.{field} has a NaN or infinite value where y is scored"):
            D.report(broken, y)
    broken = dataclasses.replace(post, var=np.where(np.arange(1000)[:, None] == 9, np.nan, post.var))
    with pytest.raises(ValueError, match=r"post.var has a NaN or infinite value where truth is scored"):
        D.report(broken, y, truth=x)
    with pytest.raises(ValueError, match="truth has an infinite value"):
        D.report(post, y, truth=np.where(np.isnan(y), np.inf, x))
    diffuse = ks.filter(y, theta=0.0, sigma=PARAMS["sigma"], obs_var=PARAMS["obs_var"], init_var=np.inf)
    assert D.report(diffuse, y).n_diffuse == 2  # the improper first step is left out, not refused
