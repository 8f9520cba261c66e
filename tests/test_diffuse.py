"""Exact diffuse initialisation (``init_var = inf``) and ``sigma = 0``, on every backend, against
statsmodels' exact diffuse filter and smoother (``use_exact_diffuse=True``) on the Nile data."""

import dataclasses
import math

import numpy as np
import pytest
import statsmodels.api as sm
import torch
from helpers import device_of, to_np

import kalmanscan as ks

S2_EPS, S2_ETA = 15099.0, 1469.1           # Durbin and Koopman's MLE of the Nile local level
BACKENDS = [b for b in ks.ops.filter.backend_names() if b != "auto"]
LEVEL = dict(theta=0.0, sigma=math.sqrt(S2_ETA), obs_var=S2_EPS, init_var=math.inf)


def nile(lead: int = 0):
    y = np.asarray(ks.datasets.load_nile().y, float).reshape(-1, 1).copy()
    y[:lead] = np.nan
    return y


def run(fn, y, backend, **kw):
    post = fn(y if backend == "reference" else torch.tensor(y, device=device_of(backend)), backend=backend, **kw)
    return post, {k: to_np(getattr(post, k)) for k in ("mean", "var", "precision", "pred_var", "loglik")}


def statsmodels_level(y):
    mod = sm.tsa.UnobservedComponents(y[:, 0], "llevel", use_exact_diffuse=True)
    return mod.smooth([S2_EPS, S2_ETA])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lead", [0, 5])
def test_local_level_matches_statsmodels_exact_diffuse(backend, lead):
    y = nile(lead)
    ref = statsmodels_level(y)
    post, f = run(ks.filter, y, backend, **LEVEL)
    _, s = run(ks.smooth, y, backend, **LEVEL)
    np.testing.assert_allclose(f["mean"][lead:, 0], ref.filtered_state[0, lead:], rtol=1e-10)
    np.testing.assert_allclose(f["var"][lead:, 0], ref.filtered_state_cov[0, 0, lead:], rtol=1e-10)
    np.testing.assert_allclose(s["mean"][:, 0], ref.smoothed_state[0], rtol=1e-10)
    np.testing.assert_allclose(s["var"][:, 0], ref.smoothed_state_cov[0, 0], rtol=1e-10)
    # the log-likelihood leaves out the diffuse step (statsmodels' loglikelihood_burn)
    np.testing.assert_allclose(f["loglik"][0], ref.llf_obs[lead + 1:].sum(), rtol=1e-12)
    assert np.all(np.isinf(f["var"][:lead])) and np.all(f["precision"][:lead] == 0)
    assert np.all(np.isinf(f["pred_var"][:lead + 1]))
    assert to_np(post.n_diffuse).tolist() == [1]
    if lead == 0:
        assert f["loglik"][0] == pytest.approx(-632.5456, abs=1e-4)


def test_fit_reaches_the_published_mle():
    r = ks.fit(nile(), theta=0.0, init_var=math.inf, estimate=("sigma", "obs_var"), progress=False)
    assert r.converged
    assert float(r.params["obs_var"][0]) == pytest.approx(S2_EPS, rel=1e-3)
    assert float(r.params["sigma"][0]) ** 2 == pytest.approx(S2_ETA, rel=2e-3)
    assert float(np.asarray(r.loglik).ravel()[0]) == pytest.approx(-632.5456, abs=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_channels_and_a_channel_never_observed(backend):
    """Per-channel init_var: diffuse, finite, and diffuse with no observation at all."""
    rng = np.random.default_rng(3)
    y = rng.normal(size=(2, 9, 3))
    y[:, :2, 0] = np.nan
    y[1, :, 2] = np.nan
    kw = dict(theta=0.4, sigma=0.8, obs_var=0.3, init_var=np.array([np.inf, 2.0, np.inf]))
    post, f = run(ks.filter, y, backend, **kw)
    ref, g = run(ks.filter, y, "reference", **dict(kw, init_var=np.array([1.0, 2.0, 1.0])))
    np.testing.assert_allclose(f["mean"][..., 1], g["mean"][..., 1], rtol=1e-10)   # finite: untouched
    assert to_np(post.n_diffuse).tolist() == [[1, 0, 1], [1, 0, 0]]
    assert np.all(np.isinf(f["var"][1, :, 2])) and f["loglik"][1, 2] == 0
    assert np.all(np.isfinite(f["var"][:, 2:, 0])) and np.all(np.isinf(f["var"][:, :2, 0]))
    _, s = run(ks.smooth, y, backend, **kw)
    assert np.all(np.isinf(s["var"][1, :, 2])) and np.all(np.isfinite(s["var"][0]))


def test_diffuse_gradients_gradcheck():
    y = torch.tensor(nile(3)[:12] / 1000.0)

    def loglik(sigma, obs_var, y):
        return ks.filter(y, theta=0.2, sigma=sigma, obs_var=obs_var, init_var=math.inf, backend="torch").loglik

    args = (torch.tensor(0.5, dtype=torch.float64, requires_grad=True),
            torch.tensor(0.3, dtype=torch.float64, requires_grad=True), y.clone().requires_grad_())
    assert torch.autograd.gradcheck(loglik, args)


def test_diffuse_needs_an_observation_with_gain():
    with pytest.raises(ValueError, match="h must be non-zero"):
        ks.filter(nile(), theta=0.0, sigma=1.0, obs_var=1.0, h=0.0, init_var=math.inf)


def test_sigma_zero_without_init_var_names_init_var():
    with pytest.raises(ValueError, match="init_var is required where sigma = 0"):
        ks.filter(nile(), theta=0.1, sigma=0.0, obs_var=1.0)
    with pytest.raises(ValueError, match="init_var must be > 0"):
        ks.filter(nile(), theta=0.1, sigma=1.0, obs_var=1.0, init_var=0.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sigma_zero_with_init_var_is_exact(backend):
    """A deterministic OU path: every backend equals the float64 covariance-form reference."""
    y = nile()[:40]
    kw = dict(theta=0.1, sigma=0.0, obs_var=S2_EPS, init_var=1e4, init_mean=900.0)
    _, f = run(ks.filter, y, backend, **kw)
    _, g = run(ks.filter, y, "reference", **kw)
    for k in ("mean", "var", "loglik"):
        assert np.all(np.isfinite(f[k]))
        np.testing.assert_allclose(f[k], g[k], rtol=1e-9)


def test_cli_refuses_sigma_zero_without_init_var_and_takes_a_diffuse_prior(tmp_path, capsys):
    from kalmanscan.cli import main

    data = np.column_stack([np.arange(30.0), np.random.default_rng(2).normal(size=30)])
    path = tmp_path / "s.csv"
    np.savetxt(path, data, delimiter=",", header="time,a", comments="")
    args = ["filter", str(path), "--theta", "0.1", "--sigma", "0", "--obs-var", "1", "-o", str(tmp_path / "o.csv")]
    assert main(args) != 0
    assert "init_var is required where sigma = 0" in capsys.readouterr().err
    assert main(args + ["--init-var", "inf"]) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_leading_gaps_of_every_length_against_a_vague_prior(backend):
    """Channels first observed at steps 0, 9 and 70 (past the first blocks of rows searched),
    one never observed, gaps later on: from each first observation on the diffuse filter and
    smoother equal those of the series from that step with a prior of variance 1e14 (to its
    1e-14 relative influence); before it, the diffuse moments; ``missing`` is the user's; the
    user's ``y`` is untouched; with gradients tracked the same numbers."""
    rng = np.random.default_rng(5)
    T, firsts = 100, (0, 9, 70, 100)
    y = rng.normal(size=(T, 4))
    for c, f in enumerate(firsts):
        y[:f, c] = np.nan
    y[80::7, 1] = np.nan
    kw = dict(theta=0.3, sigma=0.9, obs_var=0.4)
    y_t = torch.tensor(y, device=device_of(backend)) if backend != "reference" else y.copy()
    post = ks.filter(y_t, backend=backend, init_var=math.inf, **kw)
    assert np.array_equal(to_np(y_t), y, equal_nan=True)
    f = {k: to_np(getattr(post, k)) for k in ("mean", "var", "pred_var", "logliks")}
    _, s = run(ks.smooth, y, backend, init_var=math.inf, **kw)
    for c, first in enumerate(firsts[:3]):
        vague = ks.filter(y[first:, c:c + 1], backend="reference", init_var=1e14, **kw)
        _, s_vague = run(ks.smooth, y[first:, c:c + 1], "reference", init_var=1e14, **kw)
        for k in ("mean", "var", "pred_var", "logliks"):
            got, want = f[k][first + 1:, c], getattr(vague, k)[1:, 0]
            np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-12, err_msg=f"{k} {c}")
        for k in ("mean", "var"):
            np.testing.assert_allclose(s[k][first:, c], s_vague[k][:, 0], rtol=1e-8, atol=1e-12, err_msg=f"{k} {c}")
        assert np.all(np.isinf(f["var"][:first, c])) and np.all(np.isinf(f["pred_var"][:first + 1, c]))
        assert np.all(f["logliks"][:first + 1, c] == 0) and np.isfinite(f["var"][first, c])
        assert np.all(np.isfinite(s["var"][:, c]))
    assert np.all(np.isinf(f["var"][:, 3])) and np.all(f["logliks"][:, 3] == 0)
    np.testing.assert_array_equal(to_np(post.params["missing"]), np.isnan(y))
    assert to_np(post.n_diffuse).tolist() == [1, 1, 1, 0]
    if backend != "reference":
        tracked = ks.filter(torch.tensor(y, device=device_of(backend), requires_grad=True), backend=backend,
                            init_var=math.inf, **kw)
        for k in f:  # the triton backend's differentiable call sums in another order: to rounding
            np.testing.assert_allclose(to_np(getattr(tracked, k).detach()), f[k], rtol=1e-13, atol=0)


@pytest.mark.parametrize("call, outputs", [("filter", None), ("filter", ("mean", "var")), ("filter", ("var",)),
                                           ("smooth", None)])
@pytest.mark.parametrize("where", ["only", "first", "later"])
def test_an_inf_in_y_is_refused_with_a_diffuse_prior(call, outputs, where):
    """An ``inf`` at the only observation of a diffuse channel (it reaches no later output), at its
    first observation, or after it: a ValueError naming ``y``, whichever result the check reads."""
    y = np.random.default_rng(2).normal(size=(12, 3))
    y[:4, 1] = np.nan
    if where == "only":
        y[5:, 1] = np.nan
    y[{"only": 4, "first": 4, "later": 9}[where], 1] = -np.inf
    kw = dict(theta=0.3, sigma=0.9, obs_var=0.4, init_var=math.inf)
    if outputs is not None:
        kw["outputs"] = outputs
    with pytest.raises(ValueError, match="y must be finite or NaN"):
        getattr(ks, call)(y, **kw)
    y[np.isinf(y)] = 0.5
    assert np.isfinite(to_np(getattr(ks, call)(y, **kw).var)[5:]).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("outputs", [None, ("var",), ("logliks",)])
def test_leading_gaps_run_as_window_and_rest_equal_one_run(backend, outputs):
    """Leading gaps with static ``theta, sigma``: the window (with its identity transitions) and
    the steps after it run as two problems (``run_finite``), which equal one run of the whole
    finite problem (identity transitions as per-step parameters) in every field the backend
    returns, with batch dimensions and a per-step ``dt``; gradients too."""
    from kalmanscan.inference.diffuse import finite_problem, run_finite
    from kalmanscan.problem.prepare import prepare
    from kalmanscan.ops.filter import run_backend

    rng = np.random.default_rng(11)
    T, C = 23, 4
    y = rng.normal(size=(2, T, C))
    y[:, :4, 1] = np.nan
    y[1, :6, 3] = np.nan
    y[0, 12, 2] = np.nan
    dev = device_of(backend)
    leaves = {k: torch.tensor(v, device=dev, requires_grad=backend != "reference")
              for k, v in dict(y=y, theta=rng.uniform(0.1, 0.9, C), sigma=rng.uniform(0.3, 1.0, C),
                               obs_var=0.4, dt=rng.uniform(0.5, 1.5, (T, 1))).items()}
    init_var = torch.tensor([math.inf, math.inf, 2.0, math.inf], device=dev)
    p = prepare(**leaves, init_var=init_var, backend=backend, check_y=False)
    p = p if outputs is None else dataclasses.replace(p, outputs=outputs)
    whole, d_whole = finite_problem(p)
    want = run_backend(whole, backend)
    finite, d = finite_problem(p, split=True)
    assert d_whole.hold is None and d.hold is not None and finite.theta is p.theta
    runs = []
    got = run_finite(finite, d, lambda q: runs.append(q.shape) or run_backend(q, backend))
    assert runs == [(2, 7, C), (2, T - 7, C)]
    assert set(want) <= set(got)
    for k, w in want.items():
        torch.testing.assert_close(got[k], torch.broadcast_to(w, got[k].shape), rtol=1e-12, atol=1e-12, msg=k)
    if backend != "reference":
        xs = list(leaves.values())
        loss = lambda out: sum((v.double() * (i + 1) / (1 + v.double().abs())).nansum()  # noqa: E731
                               for i, (k, v) in enumerate(sorted(out.items())) if k in want and k != "missing")
        g_want = torch.autograd.grad(loss(want), xs, allow_unused=True)
        g_got = torch.autograd.grad(loss(got), xs, allow_unused=True)
        assert g_got[1] is not None and g_got[2] is not None  # theta, sigma
        for name, a, b in zip(leaves, g_got, g_want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_smoothed_leading_steps_within_a_short_window(backend):
    """Every channel observed by step 6 of 40, batch rows: the window and the step after it are
    smoothed backwards, the rest keeps the smoother's values; each channel from its first
    observation on equals the smoother of the series from there with a vague prior, and before it
    follows the transitions back (variance growing by the process noise a step)."""
    rng = np.random.default_rng(12)
    T, firsts = 40, (0, 3, 6)
    y = rng.normal(size=(2, T, 3))
    for c, f in enumerate(firsts):
        y[:, :f, c] = np.nan
    kw = dict(theta=0.3, sigma=0.9, obs_var=0.4)
    _, s = run(ks.smooth, y, backend, init_var=math.inf, **kw)
    decay = math.exp(-0.3)
    noise = 0.81 * (1 - decay ** 2) / 0.6
    for c, first in enumerate(firsts):
        _, vague = run(ks.smooth, y[:, first:, c:c + 1], "reference", init_var=1e14, **kw)
        for k in ("mean", "var"):
            np.testing.assert_allclose(s[k][:, first:, c], vague[k][..., 0], rtol=1e-8, atol=1e-12, err_msg=f"{k} {c}")
        for t in range(first - 1, -1, -1):
            np.testing.assert_allclose(s["mean"][:, t, c], s["mean"][:, t + 1, c] / decay, rtol=1e-12)
            np.testing.assert_allclose(s["var"][:, t, c], (s["var"][:, t + 1, c] + noise) / decay ** 2, rtol=1e-12)
        np.testing.assert_allclose(s["precision"][:, :, c], 1.0 / s["var"][:, :, c], rtol=1e-12)
