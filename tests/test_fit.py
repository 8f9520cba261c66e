"""ks.fit: agreement with statsmodels on the Nile data, recovery of simulated parameters, errors."""

import numpy as np
import pytest
import statsmodels.api as sm
import torch

import kalmanscan as ks
from kalmanscan.datasets import load_nile, simulate

NILE_INIT = dict(theta=0.0, init_mean=0.0, init_var=1e6)


@pytest.fixture(scope="module")
def nile_statsmodels():
    """statsmodels' local-level MLE with the same known initial belief N(0, 1e6) and no burn-in."""
    y = load_nile().y[:, 0]
    mod = sm.tsa.UnobservedComponents(y, "local level")
    mod.ssm.initialize_known(np.array([0.0]), np.array([[1e6]]))
    mod.ssm.loglikelihood_burn = 0
    res = mod.fit(disp=0, method="bfgs", gtol=1e-10, maxiter=1000, cov_type="approx")
    return dict(zip(mod.param_names, res.params)), dict(zip(mod.param_names, res.bse)), res.llf, mod


def test_nile_matches_statsmodels(nile_statsmodels):
    params, bse, llf, mod = nile_statsmodels
    res = ks.fit(load_nile().y, **NILE_INIT, estimate=("sigma", "obs_var"), backend="torch")
    assert res.converged, res.message
    sigma2 = float(res.params["sigma"][0]) ** 2
    obs_var = float(res.params["obs_var"][0])
    assert abs(sigma2 / params["sigma2.level"] - 1) < 1e-3
    assert abs(obs_var / params["sigma2.irregular"] - 1) < 1e-3
    assert abs(float(res.loglik[0]) - llf) < 1e-6 * abs(llf)
    # the same likelihood function: statsmodels at our optimum gives our log-likelihood
    assert abs(mod.loglike(np.array([obs_var, sigma2])) - float(res.loglik[0])) < 1e-8 * abs(llf)
    # standard errors: statsmodels' numerical Hessian; sigma2 = sigma^2 by the delta method
    se_sigma2 = 2 * float(res.params["sigma"][0]) * float(res.stderr["sigma"][0])
    assert abs(se_sigma2 / bse["sigma2.level"] - 1) < 1e-2
    assert abs(float(res.stderr["obs_var"][0]) / bse["sigma2.irregular"] - 1) < 1e-2
    text = repr(res)
    assert "sigma" in text and "obs_var" in text and "converged" in text


def test_repr_labels_batched_series():
    y = np.random.default_rng(5).normal(size=(2, 40, 2))
    text = repr(ks.fit(y, theta=0.3, estimate=("sigma", "obs_var")))
    rows = [line for line in text.splitlines() if line.split()[1:2] == ["sigma"]]
    assert [r.split()[0] for r in rows] == ["0,0", "0,1", "1,0", "1,1"] and "int64" not in text
    assert len({r.index("sigma") for r in rows}) == 1  # columns aligned


def test_recovers_simulated_parameters_within_three_stderr(capsys):
    truth = dict(theta=np.array([0.3, 0.1, 1.0]), sigma=np.array([1.0, 0.5, 2.0]), obs_var=np.array([0.5, 0.2, 1.0]))
    _, y = simulate(T=400, seed=1, **truth)
    res = ks.fit(y, backend="torch", progress=True)
    assert res.converged, res.message
    assert res.params["theta"].shape == (3,) and res.cov.shape == (3, 3, 3)
    for k, v in truth.items():
        z = np.abs(res.params[k] - v) / res.stderr[k]
        assert np.all(z < 3), (k, res.params[k], res.stderr[k])
    np.testing.assert_allclose(res.cov.diagonal(axis1=-2, axis2=-1) ** 0.5,
                               np.stack([res.stderr[k] for k in res.names], -1), rtol=1e-14)
    assert "ks.fit" in capsys.readouterr().err


def test_shared_fit_with_gaps_irregular_times_and_mean():
    rng = np.random.default_rng(4)
    times = np.cumsum(rng.uniform(0.2, 2.0, 300))
    truth = dict(theta=0.4, sigma=1.0, obs_var=0.3, mean=50.0)
    x, y = simulate(times=times, seed=5, **{k: np.full(2, v) for k, v in truth.items()})
    y[rng.random(y.shape) < 0.15] = np.nan
    y[100:140, 0] = np.nan
    res = ks.fit(y, times=times, mean=None, shared=True, estimate=("theta", "sigma", "obs_var", "mean"),
                 backend="torch")
    assert res.converged, res.message
    assert res.params["mean"].shape == (1,)
    assert int(res.n_obs.sum()) == int(np.isfinite(y).sum())
    for k, v in truth.items():
        assert abs(res.params[k][0] - v) < 3 * res.stderr[k][0], (k, res.params[k], res.stderr[k])
    post = res.filter(y)
    np.testing.assert_allclose(post.loglik, res.loglik, rtol=1e-12)
    direct = ks.filter(y, times=times, **res.params)
    np.testing.assert_allclose(direct.mean, post.mean, rtol=1e-12)
    assert res.smooth(y).filtered is not None


def test_stderr_blocks_equal_the_full_hessian():
    """Per-series blocks from Hessian-vector products equal torch.autograd.functional.hessian."""
    truth = dict(theta=np.array([0.5, 0.2]), sigma=np.array([1.0, 0.7]), obs_var=np.array([0.4, 0.9]))
    _, y = simulate(T=80, seed=7, **truth)
    res = ks.fit(y, backend="torch")
    names = res.names
    flat0 = torch.tensor(np.concatenate([res.params[k] for k in names]))

    def nll(flat):
        kw = dict(zip(names, flat.reshape(len(names), 2)))
        return -ks.filter(torch.tensor(y), **kw, backend="torch").loglik.sum()

    H = torch.autograd.functional.hessian(nll, flat0).reshape(3, 2, 3, 2)
    for c in range(2):
        cov = torch.linalg.inv(H[:, c, :, c]).numpy()
        np.testing.assert_allclose(res.cov[c], cov, rtol=1e-6)
        assert np.allclose(H[:, c, :, 1 - c].numpy(), 0.0)


def test_batch_fit_is_per_series_and_torch_in_gives_tensors():
    truth = dict(theta=0.5, sigma=1.0, obs_var=0.5)
    ys = np.stack([simulate(T=120, seed=s, **truth)[1] for s in (10, 11)])
    res = ks.fit(torch.tensor(ys), backend="torch")
    assert isinstance(res.params["theta"], torch.Tensor) and res.params["theta"].shape == (2, 1, 1)
    assert res.stderr["sigma"].shape == (2, 1, 1) and res.loglik.shape == (2, 1)
    for b in range(2):
        one = ks.fit(ys[b], backend="torch")
        for k in res.names:
            np.testing.assert_allclose(res.params[k][b, 0].numpy(), one.params[k], rtol=1e-4)
            np.testing.assert_allclose(res.stderr[k][b, 0].numpy(), one.stderr[k], rtol=1e-3)
    assert isinstance(res.filter(torch.tensor(ys)).mean, torch.Tensor)


def test_adam_improves_the_likelihood_and_reports_max_iter(capsys):
    _, y = simulate(theta=0.5, sigma=1.0, obs_var=0.5, T=100, seed=2)
    start = ks.fit(y, max_iter=1, backend="torch", method="adam")
    res = ks.fit(y, max_iter=60, backend="torch", method="adam", progress=True)
    assert not res.converged and "max_iter" in res.message and res.n_iter == 60
    assert float(res.loglik[0]) > float(start.loglik[0])
    assert "ks.fit" in capsys.readouterr().err


def test_a_channel_without_observations_gets_nan_stderr():
    _, y = simulate(theta=0.5, sigma=1.0, obs_var=0.5, T=60, seed=8)
    y = np.concatenate([y, np.full_like(y, np.nan)], -1)
    res = ks.fit(y, backend="torch")
    assert np.all(np.isfinite(res.stderr["sigma"][:1])) and np.all(np.isnan(res.stderr["sigma"][1:]))
    assert res.n_obs.tolist() == [60, 0] and res.loglik[1] == 0.0
    assert not res.converged and "channel 1: no observations" in res.reason


@pytest.mark.parametrize("kwargs, match", [
    (dict(estimate=("theta", "rate")), "estimate"),
    (dict(estimate=()), "estimate"),
    (dict(method="newton"), "method"),
    (dict(theta=0.0), "theta"),
    (dict(estimate=("sigma", "obs_var")), "theta is required"),
    (dict(backend="reference"), "backend"),
    (dict(obs_var=np.ones((5, 2))), "obs_var"),
    (dict(sigma=-1.0), "sigma"),
    (dict(max_iter=0), "max_iter"),
    (dict(shared=True, theta=np.array([0.1, 0.2])), "theta"),
    (dict(max_iter=True), "max_iter"),
    (dict(tol="1e-6"), "tol"),
    (dict(shared="yes"), "shared"),
    (dict(dt=0.0), "dt must be"),
    (dict(dt=-1.0), "dt must be"),
    (dict(times=np.zeros(5)), "times must be"),
    (dict(h=float("nan")), "h must be"),
    (dict(y=np.zeros((0, 2))), "y must have T >= 1"),
])
def test_bad_input_names_the_argument(kwargs, match):
    """Checked before anything is computed from the values (the guesses divide by the step)."""
    y = kwargs.pop("y", np.random.default_rng(0).normal(size=(5, 2)))
    with pytest.raises(ValueError, match=match):
        ks.fit(y, **kwargs)
