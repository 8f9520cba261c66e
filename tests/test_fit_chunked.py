"""``ks.fit`` of a dask array chunked along time: the log-likelihood and its gradient one chunk at a
time (:mod:`kalmanscan.estimation.chunked`), equal to the in-memory objective's."""

import numpy as np
import pytest
import torch

import kalmanscan as ks
from kalmanscan.estimation.chunked import ChunkedLikelihood, statistics
from kalmanscan.estimation.likelihood import Likelihood

dsa = pytest.importorskip("dask.array")


def _record(T, C=3, batch=(), seed=0):
    """Random non-zero data around 2 with a gap, a series unobserved for its first third, irregular times."""
    rng = np.random.default_rng(seed)
    y = rng.normal(size=batch + (T, C)) + 2.0
    y[..., T // 5:T // 3, 0] = np.nan
    y[..., :T // 3, C - 1] = np.nan
    return y, np.cumsum(rng.uniform(0.5, 2.0, T))


def _values(names, shape, seed=1):
    rng = np.random.default_rng(seed)
    ranges = dict(theta=(0.05, 0.8), sigma=(0.5, 1.2), obs_var=(0.3, 1.0), mean=(1.5, 2.5), init_mean=(1.0, 3.0),
                  init_var=(0.5, 2.0))
    return {k: torch.tensor(rng.uniform(*ranges[k], shape), dtype=torch.float64) for k in names}


def _value_and_gradient(lik, nat):
    leaves = {k: v.clone().requires_grad_(True) for k, v in nat.items()}
    loglik = lik(leaves)
    return loglik.detach(), torch.autograd.grad(loglik.sum(), list(leaves.values()))


def _assert_equal(chunked, in_memory, nat):
    value, grads = _value_and_gradient(chunked, nat)
    want, want_grads = _value_and_gradient(in_memory, nat)
    np.testing.assert_allclose(value.numpy(), want.numpy(), rtol=1e-10)
    for name, got, ref in zip(nat, grads, want_grads):
        np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=1e-10, atol=1e-12 * float(ref.abs().max()),
                                   err_msg=name)


@pytest.mark.parametrize("T, chunks", [(1, 1), (63, 20), (63, 1), (63, (1, 30, 32)), (1000, 333)])
def test_model_parameters_equal_the_in_memory_objective(T, chunks):
    y, times = _record(T)
    nat = _values(("theta", "sigma", "obs_var", "mean"), (3,))
    chunked = ChunkedLikelihood(dsa.from_array(y, chunks=(chunks, 3)), {}, nat, times=times)
    _assert_equal(chunked, Likelihood(torch.from_numpy(y), {}, nat, times=times, backend="cpu"), nat)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_the_prior_with_per_step_values_and_a_batch(backend):
    y, times = _record(41, batch=(2,), seed=3)
    rng = np.random.default_rng(4)
    obs_var, mean = rng.uniform(0.3, 1.5, (2, 41, 3)), rng.uniform(1.0, 3.0, (41, 3))
    nat = _values(("theta", "sigma", "init_mean", "init_var"), (2, 3))
    fixed = dict(obs_var=dsa.from_array(obs_var, chunks=(1, 7, 2)), mean=mean)
    chunked = ChunkedLikelihood(dsa.from_array(y, chunks=(1, 7, 2)), fixed, nat, times=dsa.from_array(times, 7),
                                backend=backend)
    in_memory = Likelihood(torch.from_numpy(y), dict(obs_var=obs_var, mean=mean), nat, times=times, backend="cpu")
    _assert_equal(chunked, in_memory, nat)


def test_a_diffuse_prior_across_chunks():
    y, _ = _record(63, seed=5)
    nat = _values(("theta", "sigma"), (3,))
    fixed = dict(obs_var=0.6, mean=2.0, init_var=np.array([1.0, np.inf, np.inf]))
    chunked = ChunkedLikelihood(dsa.from_array(y, chunks=(9, 3)), fixed, nat, dt=0.7)
    _assert_equal(chunked, Likelihood(torch.from_numpy(y), fixed, nat, dt=0.7, backend="cpu"), nat)


def test_only_the_boundary_beliefs_are_kept():
    y, _ = _record(40, seed=10)
    nat = _values(("theta", "sigma", "obs_var"), (3,))
    lik = ChunkedLikelihood(dsa.from_array(y, chunks=(10, 3)), {}, nat)
    with torch.no_grad():
        _, beliefs = lik.forward_pass(nat)
    assert len(beliefs) == 3
    for mean, var in beliefs:  # own storage, not views of a chunk's moments
        assert mean.untyped_storage().nbytes() == var.untyped_storage().nbytes() == 3 * 8


def test_gradcheck():
    y, times = _record(7, C=2, seed=6)
    nat = _values(("theta", "sigma", "obs_var", "mean", "init_mean"), (2,))
    lik = ChunkedLikelihood(dsa.from_array(y, chunks=(3, 1)), {}, nat, times=times)
    leaves = [v.clone().requires_grad_(True) for v in nat.values()]
    assert torch.autograd.gradcheck(lambda *v: lik(dict(zip(nat, v))), leaves)


def test_statistics_of_the_chunks():
    y, _ = _record(50, batch=(2,), seed=7)
    y[1, :, 1] = np.nan
    got = statistics(dsa.from_array(y, chunks=(1, 9, 2)), torch.float64)
    with np.errstate(invalid="ignore"), pytest.warns(RuntimeWarning):
        want = dict(observed=(~np.isnan(y)).sum(-2), mean=np.nanmean(y, -2), var=np.nanvar(y, -2),
                    dvar=np.nanvar(np.diff(y, axis=-2), -2), lo=np.where(np.isnan(y), np.inf, y).min(-2),
                    hi=np.where(np.isnan(y), -np.inf, y).max(-2))
    for k, v in want.items():
        np.testing.assert_allclose(got[k].numpy(), v, rtol=1e-13, err_msg=k)


@pytest.mark.parametrize("kw, wrap", [(dict(), None),
                                      (dict(estimate=("theta", "sigma", "obs_var", "mean"), mean=None), None),
                                      (dict(shared=True), "DataArray")])
def test_fit_converges_to_the_in_memory_fit(kw, wrap):
    rng = np.random.default_rng(8)
    x = np.zeros((301, 2))
    for t in range(1, 301):
        x[t] = 0.8 * x[t - 1] + 0.5 * rng.normal(size=2)
    y = x + 0.4 * rng.normal(size=x.shape) + 1.0
    y[50:70, 0] = np.nan
    want = ks.fit(y, **kw)
    chunked = dsa.from_array(y, chunks=(77, 2))
    if wrap == "DataArray":
        chunked = pytest.importorskip("xarray").DataArray(chunked, dims=("time", "site"))
    got = ks.fit(chunked, **kw)
    assert got.converged and want.converged
    for k in want.params:
        np.testing.assert_allclose(got.params[k], want.params[k], rtol=1e-8, err_msg=k)
    for k in want.stderr:
        np.testing.assert_allclose(got.stderr[k], want.stderr[k], rtol=1e-6, err_msg=k)
    np.testing.assert_allclose(got.loglik, want.loglik, rtol=1e-12)


def test_bad_input_names_the_argument():
    y, _ = _record(30, seed=9)
    y[12, 1] = np.inf
    with pytest.raises(ValueError, match="^y must be finite"):
        ks.fit(dsa.from_array(y, chunks=(10, 3)))
    with pytest.raises(ValueError, match="^obs_var must be"):
        ks.fit(dsa.from_array(np.nan_to_num(y, posinf=0.0), chunks=(10, 3)), obs_var=-1.0, estimate=("theta", "sigma"))
    with pytest.raises(ValueError, match="boolean"):
        ks.fit(dsa.from_array(np.isnan(y), chunks=(10, 3)))
    with pytest.raises(ValueError, match=r"^y must have T >= 1 and C >= 1, got shape \(0, 3\)"):
        ks.fit(dsa.zeros((0, 3)))


def test_xr_fit_of_a_dataarray_chunked_along_time():
    xr = pytest.importorskip("xarray")
    import kalmanscan.xr as kxr

    rng = np.random.default_rng(11)
    x = np.zeros((2, 2, 90))
    for t in range(1, 90):
        x[..., t] = 0.8 * x[..., t - 1] + 0.5 * rng.normal(size=(2, 2))
    y = x + 0.4 * rng.normal(size=x.shape) + 1.0
    y[0, 1, 20:33] = np.nan
    da = xr.DataArray(y, dims=("site", "sensor", "time"), coords={"site": ["a", "b"], "sensor": ["x", "y"]})
    obs_var = xr.DataArray(rng.uniform(0.1, 0.3, (2, 90)), dims=("sensor", "time"), coords={"sensor": da.sensor})
    want = kxr.fit(da, obs_var=obs_var, estimate=("theta", "sigma"))
    got = kxr.fit(da.chunk({"time": 25, "site": 1}), obs_var=obs_var.chunk({"time": 30}), estimate=("theta", "sigma"))
    assert got["theta"].dims == want["theta"].dims and got.attrs == want.attrs
    for k in ("theta", "sigma", "theta_stderr", "loglik"):
        np.testing.assert_allclose(got[k].values, want[k].values, rtol=1e-6, err_msg=k)
