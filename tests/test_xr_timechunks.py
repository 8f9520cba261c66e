"""A DataArray chunked along time: filtered and smoothed chunk by chunk, equal to the in-memory call
(:mod:`kalmanscan.xr.timechunks`)."""

import dask
import dask.array
import numpy as np
import pandas as pd
import pytest
import xarray as xr

import kalmanscan.xr as kxr

T = 61


def _record(dtype=np.float64):
    """Three sites by two sensors, gaps (one site unobserved for its first 12 steps), irregular
    datetime times."""
    rng = np.random.default_rng(5)
    y = rng.normal(size=(3, 2, T)).astype(dtype) + 4.0
    y[0, 1, 20:33] = np.nan
    y[2, :, :12] = np.nan
    gaps = pd.to_timedelta(rng.uniform(0.5, 2.0, T).cumsum(), unit="h")
    times = pd.Timestamp("2024-01-01") + gaps
    return xr.DataArray(y, dims=("site", "sensor", "time"),
                        coords={"site": ["a", "b", "c"], "sensor": ["x", "y"], "time": times})


def _params(da):
    rng = np.random.default_rng(6)
    return dict(theta=xr.DataArray([0.05, 0.3, 0.8], dims="site", coords={"site": da.site}),
                sigma=0.6,
                obs_var=xr.DataArray(rng.uniform(0.2, 1.5, (2, T)), dims=("sensor", "time"),
                                     coords={"sensor": da.sensor, "time": da.time}),
                mean=4.0,
                init_var=xr.DataArray([1.0, np.inf, np.inf], dims="site", coords={"site": da.site}))


def _chunked(kw, chunks):
    return {k: v.chunk({d: chunks.get(d, -1) for d in v.dims}) if isinstance(v, xr.DataArray) else v
            for k, v in kw.items()}


@pytest.mark.parametrize("op", ["filter", "smooth"])
@pytest.mark.parametrize("chunks", [{"time": 20}, {"time": 7, "site": 2}, {"time": (1, 1, 30, 29)}])
def test_time_chunks_equal_the_in_memory_call(op, chunks):
    da = _record()
    kw = dict(time_unit="1h", **_params(da))
    eager = getattr(kxr, op)(da, **kw)
    lazy = getattr(kxr, op)(da.chunk(chunks), **_chunked(kw, chunks))
    assert isinstance(lazy["mean"].data, dask.array.Array)
    assert lazy["mean"].chunksizes["time"] == da.chunk(chunks).chunksizes["time"]  # no rechunk along time
    with dask.config.set(scheduler="sync"):
        lazy = lazy.compute()
    for name in ("mean", "var", "loglik", "logliks", "pred_mean", "pred_var", "pred_obs_mean", "pred_obs_var", "lower"):
        assert not np.isnan(lazy[name].values).any(), name
        np.testing.assert_allclose(lazy[name].values, eager[name].values, rtol=1e-11, atol=1e-13, err_msg=name)
    if op == "smooth":
        for name in ("filtered_mean", "filtered_var"):
            np.testing.assert_allclose(lazy[name].values, eager[name].values, rtol=1e-11, atol=1e-13, err_msg=name)


def test_no_task_holds_more_than_one_time_chunk():
    da = _record().chunk({"time": 10})
    ds = kxr.smooth(da, time_unit="1h", **_chunked(_params(da), {"time": 10}))
    graph = ds["mean"].data.__dask_graph__()
    assert not any("rechunk" in str(name) for name in graph.layers)
    sizes = {v.shape[-2] for v in dask.compute(*ds["mean"].data.to_delayed().ravel(), scheduler="sync")}
    assert max(sizes) <= 10


def test_float32_and_a_static_problem():
    da = _record(np.float32).isel(site=[0, 1])
    kw = dict(time_unit="1h", theta=0.2, sigma=0.6, obs_var=0.7, mean=4.0)
    for op in ("filter", "smooth"):
        eager = getattr(kxr, op)(da, **kw)
        lazy = getattr(kxr, op)(da.chunk({"time": 16}), **kw).compute(scheduler="sync")
        assert lazy["mean"].dtype == np.float32
        np.testing.assert_allclose(lazy["mean"].values, eager["mean"].values, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(lazy["var"].values, eager["var"].values, rtol=2e-5)


@pytest.mark.slow
def test_on_a_local_cluster_of_processes():
    distributed = pytest.importorskip("dask.distributed")
    da = _record()
    kw = dict(time_unit="1h", **_params(da))
    chunked = _chunked(kw, {"time": 15})
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                  memory_limit="1GiB") as cluster, distributed.Client(cluster):
        for op in ("filter", "smooth"):
            lazy = getattr(kxr, op)(da.chunk({"time": 15}), **chunked).compute()
            eager = getattr(kxr, op)(da, **kw)
            np.testing.assert_allclose(lazy["mean"].values, eager["mean"].values, rtol=1e-11, atol=1e-13)
            np.testing.assert_allclose(lazy["var"].values, eager["var"].values, rtol=1e-11)


def test_cpu_summary_equals_the_torch_backends():
    import torch

    from kalmanscan.ops.filter import get_backend
    from kalmanscan.problem.prepare import prepare

    rng = np.random.default_rng(3)
    y = rng.normal(size=(2, 63, 3))
    y[0, 5:9, 1] = np.nan
    p = prepare(torch.from_numpy(y), theta=np.array([0.1, 0.5, 2.0]), sigma=0.7,
                obs_var=rng.uniform(0.3, 2.0, (63, 3)), mean=0.5, h=1.3, dt=rng.uniform(0.5, 1.5, (63, 1)),
                init_var=1.0, backend="torch")
    cpu, ref = get_backend("cpu").summary(p), get_backend("torch").summary(p)
    for got, want in zip(cpu, ref):
        assert got.shape == want.shape == (2, 1, 3)
    # the summary is projective: compare the ratios it is read through (merged.py), scale-free
    A, B, C, D, E, F, G = cpu
    rA, rB, rC, rD, rE, rF, rG = ref
    for x, rx in ((A, rA), (B, rB), (C, rC), (E, rE), (F, rF), (G, rG)):
        np.testing.assert_allclose((x / D).numpy(), (rx / rD).numpy(), rtol=1e-12, atol=1e-300)
