"""ks.xr: labelled filtering, smoothing and fitting against the NumPy API, in memory and with dask."""

import dask.array
import numpy as np
import pandas as pd
import pytest
import xarray as xr

import kalmanscan as ks
import kalmanscan.xr as kxr
from kalmanscan.xr import accessor

SITES = ["a", "b", "c"]


def _data(T=37, seed=0, dtype=np.float64):
    """A (site, time, sensor) DataArray with a datetime coordinate (6-hourly) and missing values."""
    rng = np.random.default_rng(seed)
    y = (rng.normal(size=(3, T, 2)) + 2.0).astype(dtype)
    y[0, 5, 1] = np.nan
    y[2, 10:14, 0] = np.nan
    times = pd.date_range("2021-03-01", periods=T, freq="6h").values.copy()
    times[T // 2:] += np.timedelta64(3, "h")   # one irregular step
    return xr.DataArray(y, dims=("site", "time", "sensor"),
                        coords={"site": SITES, "time": times, "sensor": [10, 20], "lat": ("site", [1.0, 2.0, 3.0])},
                        attrs={"units": "K", "source": "test"}, name="temp")


def _flat(x):
    """(site, time, sensor) -> (time, site*sensor), the channel layout ks.xr uses internally."""
    return np.moveaxis(np.asarray(x), 1, 0).reshape(x.shape[1], -1)


def _theta():
    return xr.DataArray([0.1, 0.5, 2.0], dims="site", coords={"site": SITES})


def _days(da):
    return (da.time.values - da.time.values[0]) / np.timedelta64(1, "D")


def test_filter_matches_numpy_api_with_datetime_coordinate_and_dataarray_params():
    da = _data()
    obs_var = xr.DataArray(np.linspace(0.2, 0.9, da.sizes["time"]), dims="time", coords={"time": da.time})
    ds = kxr.filter(da, time_unit="1D", theta=_theta(), sigma=0.7, obs_var=obs_var, mean=2.0)
    theta = np.repeat([0.1, 0.5, 2.0], 2)
    ref = ks.filter(_flat(da.values), theta=theta, sigma=0.7, obs_var=obs_var.values[:, None], mean=2.0,
                    times=_days(da), backend="reference")
    for name in ("mean", "var", "pred_mean", "pred_var", "pred_obs_mean", "pred_obs_var", "logliks"):
        np.testing.assert_allclose(_flat(ds[name].values), getattr(ref, name), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(ds["loglik"].values.reshape(-1), ref.loglik, rtol=1e-9)
    np.testing.assert_allclose(ds["precision"], 1 / ds["var"], rtol=1e-12)
    z = 1.959963984540054
    np.testing.assert_allclose(ds["upper"] - ds["mean"], z * np.sqrt(ds["var"]), rtol=1e-12)
    np.testing.assert_allclose(ds["mean"] - ds["lower"], z * np.sqrt(ds["var"]), rtol=1e-12)


def test_output_keeps_dims_coords_and_attrs():
    da = _data()
    ds = da.kalman.filter(time_unit="6h", theta=1.0, sigma=1.0, obs_var=0.5, level=0.5)
    assert ds["mean"].dims == da.dims
    assert ds["loglik"].dims == ("site", "sensor")
    for name in ("site", "time", "sensor", "lat"):
        xr.testing.assert_identical(ds[name], da[name])
    assert ds.attrs["units"] == "K" and ds.attrs["source"] == "test"
    assert ds.attrs["time_unit"] == "6h" and ds.attrs["level"] == 0.5
    assert ds["mean"].attrs["units"] == "K" and ds["var"].attrs["units"] == "(K)^2"
    np.testing.assert_allclose(ds["upper"] - ds["mean"], 0.6744897501960817 * np.sqrt(ds["var"]), rtol=1e-12)
    assert da.attrs == {"units": "K", "source": "test"}


def test_time_unit_scales_the_rates():
    da = _data()
    per_day = kxr.filter(da, time_unit="1D", theta=0.4, sigma=0.8, obs_var=0.5)
    per_hour = kxr.filter(da, time_unit=np.timedelta64(1, "h"), theta=0.4 / 24, sigma=0.8 / np.sqrt(24), obs_var=0.5)
    xr.testing.assert_allclose(per_day.drop_attrs(), per_hour.drop_attrs(), rtol=1e-10)


def test_numeric_coordinate_regular_steps_and_dt_override():
    rng = np.random.default_rng(1)
    t = np.array([0.0, 0.5, 2.0, 2.25, 4.0, 7.0, 7.5])
    da = xr.DataArray(rng.normal(size=(7, 2)), dims=("t", "ch"), coords={"t": t})
    ds = kxr.filter(da, "t", theta=0.3, sigma=1.0, obs_var=0.2)
    ref = ks.filter(da.values, theta=0.3, sigma=1.0, obs_var=0.2, times=t)
    np.testing.assert_allclose(ds["mean"].values, ref.mean, rtol=1e-12)
    assert ds.attrs["time_unit"] == "coordinate units"
    regular = kxr.filter(da, "t", theta=0.3, sigma=1.0, obs_var=0.2, dt=0.5)
    ref = ks.filter(da.values, theta=0.3, sigma=1.0, obs_var=0.2, dt=0.5)
    np.testing.assert_allclose(regular["mean"].values, ref.mean, rtol=1e-12)
    no_coord = kxr.filter(da.drop_vars("t"), "t", theta=0.3, sigma=1.0, obs_var=0.2)
    np.testing.assert_allclose(no_coord["mean"].values, ks.filter(da.values, theta=0.3, sigma=1.0, obs_var=0.2).mean)


def test_one_dimensional_and_float32_and_integer_input():
    y = xr.DataArray(np.arange(1.0, 64.0), dims="time")
    ds = kxr.filter(y, theta=0.2, sigma=1.0, obs_var=1.0)
    assert ds["mean"].dims == ("time",) and ds["loglik"].dims == ()
    want = ks.filter(y.values[:, None], theta=0.2, sigma=1.0, obs_var=1.0).mean[:, 0]
    np.testing.assert_allclose(ds["mean"].values, want)
    f32 = kxr.filter(y.astype(np.float32), theta=0.2, sigma=1.0, obs_var=1.0)
    assert f32["mean"].dtype == np.float32
    np.testing.assert_allclose(f32["mean"].values, ds["mean"].values, rtol=1e-4)
    want32 = ks.filter(y.values[:, None].astype(np.float32), theta=0.2, sigma=1.0, obs_var=1.0).loglik[0]
    lazy32 = kxr.filter(y.astype(np.float32).chunk(), theta=0.2, sigma=1.0, obs_var=1.0).compute()
    for out in (f32, lazy32):  # summed in float64 as ks.filter sums it, then float32
        assert out["loglik"].dtype == np.float32 and out["loglik"].item() == want32
    ints = kxr.filter(xr.DataArray(np.arange(1, 64), dims="time"), theta=0.2, sigma=1.0, obs_var=1.0)
    assert ints["mean"].dtype == np.float64
    single = kxr.filter(y.isel(time=slice(0, 1)), theta=0.2, sigma=1.0, obs_var=1.0)
    assert single.sizes["time"] == 1


def test_parameter_with_extra_dimension_broadcasts():
    da = _data()
    theta = xr.DataArray([0.1, 1.0], dims="model")
    ds = kxr.filter(da, time_unit="1D", theta=theta, sigma=1.0, obs_var=0.5)
    assert ds["mean"].dims == ("model",) + da.dims
    one = kxr.filter(da, time_unit="1D", theta=1.0, sigma=1.0, obs_var=0.5)
    xr.testing.assert_allclose(ds["mean"].isel(model=1, drop=True), one["mean"], rtol=1e-12)


def test_smooth_matches_numpy_api_and_keeps_the_filter():
    da = _data()
    ds = kxr.smooth(da, time_unit="1D", theta=_theta(), sigma=0.7, obs_var=0.4, init_var=2.0, init_mean=1.0)
    kw = dict(theta=np.repeat([0.1, 0.5, 2.0], 2), sigma=0.7, obs_var=0.4, init_var=2.0, init_mean=1.0, times=_days(da))
    ref = ks.smooth(_flat(da.values), **kw)
    np.testing.assert_allclose(_flat(ds["mean"].values), ref.mean, rtol=1e-10)
    np.testing.assert_allclose(_flat(ds["var"].values), ref.var, rtol=1e-10)
    filt = kxr.filter(da, time_unit="1D", theta=_theta(), sigma=0.7, obs_var=0.4, init_var=2.0, init_mean=1.0)
    xr.testing.assert_allclose(ds["filtered_mean"], filt["mean"].assign_attrs(ds["filtered_mean"].attrs))
    xr.testing.assert_allclose(ds["loglik"], filt["loglik"])
    assert ds.attrs["kalmanscan"] == "smooth"
    np.testing.assert_array_less(ds["var"].values, filt["var"].values + 1e-12)


@pytest.mark.parametrize("bad, match", [
    (dict(time_unit=None), "time_unit is required"),
    (dict(time_unit="parsec"), "time_unit must be a duration"),
    (dict(time_unit="-1D"), "time_unit must be a positive"),
    (dict(time_unit="1D", level=1.5), "level"),
    (dict(time_unit="1D", dim="depth"), "dim 'depth'"),
    (dict(time_unit="1D", theta=np.array([0.1, 0.2, 0.3])), "theta must be a scalar or an xarray.DataArray"),
    (dict(time_unit="1D", times=np.arange(37.0)), "times"),
    (dict(time_unit="1D", theta=xr.DataArray([0.1, 0.2, 0.3], dims="site", coords={"site": ["a", "b", "x"]})), "align"),
    (dict(time_unit="1D", obs_var=-1.0), "obs_var"),
    (dict(time_unit="1D", init_var=xr.DataArray(np.ones(37), dims="time")), "init_var must not have the time"),
])
def test_bad_arguments_raise_value_error_naming_them(bad, match):
    kw = dict(theta=0.5, sigma=1.0, obs_var=0.5)
    kw.update(bad)
    with pytest.raises(ValueError, match=match):
        kxr.filter(_data(), **kw)


def test_bad_coordinates_raise():
    da = _data()
    with pytest.raises(ValueError, match="strictly increasing; position 4"):
        kxr.filter(da.isel(time=[0, 1, 2, 3, 3, 5]), time_unit="1D", theta=1.0, sigma=1.0, obs_var=1.0)
    with pytest.raises(ValueError, match="numeric and is used as times"):
        kxr.filter(da.assign_coords(time=np.arange(37.0)), time_unit="1D", theta=1.0, sigma=1.0, obs_var=1.0)
    with pytest.raises(ValueError, match="must be numeric or datetime64"):
        kxr.filter(da.assign_coords(time=[f"t{i}" for i in range(37)]), theta=1.0, sigma=1.0, obs_var=1.0)
    with pytest.raises(ValueError, match="da must be an xarray.DataArray"):
        kxr.filter(da.values, theta=1.0, sigma=1.0, obs_var=1.0)


def test_dask_is_lazy_chunked_and_equal_to_in_memory():
    da = _data(T=63)
    theta = _theta()
    kw = dict(time_unit="1D", sigma=0.7, obs_var=0.5)
    h = xr.DataArray(np.linspace(0.5, 1.5, 63), dims="time", coords={"time": da.time})
    eager = kxr.smooth(da, theta=theta, h=h, **kw)
    lazy = kxr.smooth(da.chunk({"site": 1, "time": 20, "sensor": 1}), theta=theta.chunk({"site": 2}),
                      h=h.chunk({"time": 30}), **kw)
    for name in ("mean", "var", "lower", "loglik", "filtered_mean"):
        assert isinstance(lazy[name].data, dask.array.Array), name
    assert lazy["mean"].chunksizes["site"] == (1, 1, 1) and lazy["mean"].chunksizes["time"] == (20, 20, 20, 3)
    computed = lazy.compute()
    for name, var in computed.data_vars.items():
        assert np.isfinite(var.values).all(), name
    xr.testing.assert_allclose(computed, eager, rtol=1e-12)


def test_dask_distributed_local_cluster_equals_in_memory():
    from dask.distributed import Client, LocalCluster, get_task_stream

    da = _data(T=40)
    eager = kxr.filter(da, time_unit="1D", theta=_theta(), sigma=0.7, obs_var=0.5)
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        lazy = da.chunk({"site": 1}).kalman.filter(time_unit="1D", theta=_theta(), sigma=0.7, obs_var=0.5)
        with get_task_stream(client) as stream:
            result = lazy.compute()
    assert any("kalman_block" in str(task["key"]) for task in stream.data)
    xr.testing.assert_allclose(result, eager, rtol=1e-12)


def _fit_data():
    """(a, b, time) with 4 independent OU channels simulated from known parameters, a few gaps."""
    from kalmanscan.datasets import simulate

    theta, sigma = np.array([0.3, 0.5, 0.3, 0.8]), np.array([1.0, 0.7, 1.5, 1.0])
    obs_var = np.array([0.5, 0.3, 0.8, 0.4])
    times = np.cumsum(np.random.default_rng(8).uniform(0.5, 1.5, 150))
    _, y = simulate(theta, sigma, obs_var, times=times, seed=7)
    y[40:50, 1] = np.nan
    da = xr.DataArray(y.T.reshape(2, 2, 150), dims=("a", "b", "time"),
                      coords={"a": [1, 2], "b": ["u", "v"], "time": times}, attrs={"units": "m"})
    return da, y, times


def test_fit_matches_numpy_api_and_feeds_filter():
    da, y, times = _fit_data()
    ds = da.kalman.fit(max_iter=8)
    ref = ks.fit(y, times=times, max_iter=8)
    for k in ("theta", "sigma", "obs_var"):
        np.testing.assert_allclose(ds[k].values.reshape(-1), ref.params[k], rtol=1e-10)
        np.testing.assert_allclose(ds[f"{k}_stderr"].values.reshape(-1), ref.stderr[k], rtol=1e-10)
    np.testing.assert_allclose(ds["loglik"].values.reshape(-1), ref.loglik, rtol=1e-10)
    assert ds["mean"].dims == ("a", "b") and np.all(ds["mean"] == 0.0)
    assert bool(ds["converged"].all()) == ref.converged and ds["n_obs"].values.tolist() == [[150, 140], [150, 150]]
    assert ds.attrs["estimate"] == "theta,sigma,obs_var" and ds.attrs["units"] == "m"
    assert ds["obs_var"].attrs["units"] == "(m)^2"
    filtered = kxr.filter(da, **kxr.params(ds))
    np.testing.assert_allclose(filtered["loglik"].values, ds["loglik"].values, rtol=1e-10)


def test_fit_dask_fits_each_chunk_on_its_own_and_shared_is_scalar():
    da, y, times = _fit_data()
    kw = dict(estimate=("sigma", "obs_var"), theta=0.4, max_iter=8)
    lazy = kxr.fit(da.chunk({"a": 1}), **kw)
    assert isinstance(lazy["sigma"].data, dask.array.Array)
    lazy = lazy.compute()
    for a, cols in ((0, [0, 1]), (1, [2, 3])):
        ref = ks.fit(y[:, cols], times=times, **kw)
        np.testing.assert_allclose(lazy["sigma"].values[a], ref.params["sigma"], rtol=1e-10)
        np.testing.assert_allclose(lazy["obs_var_stderr"].values[a], ref.stderr["obs_var"], rtol=1e-10)
        assert lazy["converged"].values[a].tolist() == [ref.converged] * 2
    np.testing.assert_array_equal(lazy["theta"].values, 0.4)
    shared = kxr.fit(da.chunk({"a": 1}), shared=True, **kw).compute()
    ref = ks.fit(y, times=times, shared=True, **kw)
    assert shared["sigma"].dims == () and shared["loglik"].dims == ("a", "b")
    np.testing.assert_allclose(shared["sigma"].values, ref.params["sigma"][0], rtol=1e-12)
    np.testing.assert_allclose(shared["loglik"].values.reshape(-1), ref.loglik, rtol=1e-12)


def test_params_rejects_other_datasets():
    with pytest.raises(ValueError, match="fit_result"):
        kxr.params(xr.Dataset())


def test_to_numpy_and_to_dataset_round_trip():
    da = _data()
    y, times = kxr.to_numpy(da, time_unit="1D")
    np.testing.assert_array_equal(y, _flat(da.values))
    np.testing.assert_allclose(times, _days(da))
    post = ks.smooth(y, times=times, theta=0.5, sigma=1.0, obs_var=0.3)
    ds = kxr.to_dataset(post, da, time_unit="1D", level=0.9)
    expect = kxr.smooth(da, time_unit="1D", theta=0.5, sigma=1.0, obs_var=0.3, level=0.9)
    xr.testing.assert_identical(ds, expect)
    with pytest.raises(ValueError, match="expected"):
        kxr.to_dataset(post, da.isel(site=[0]), time_unit="1D")
    for dtype in (np.float64, np.float32):  # the filter's Dataset too, time first and last
        for case in (_data(dtype=dtype), _data(dtype=dtype).transpose("time", "sensor", "site")):
            y, times = kxr.to_numpy(case, time_unit="1D")
            post = ks.filter(y, times=times, theta=0.5, sigma=1.0, obs_var=0.3)
            xr.testing.assert_identical(kxr.to_dataset(post, case, time_unit="1D"),
                                        kxr.filter(case, time_unit="1D", theta=0.5, sigma=1.0, obs_var=0.3))


def test_regular_times_take_the_static_loops_and_change_nothing():
    """Exactly regular coordinate steps are passed as ``dt`` (the static loops) and irregular ones as
    ``times``: both equal ``ks.filter`` with the coordinate's times, for the filter and the fit."""
    rng = np.random.default_rng(12)
    _, y = ks.datasets.simulate(T=60, seed=12, theta=np.array([0.3, 0.5, 1.0]), sigma=1.0, obs_var=0.3)
    for stamps in (pd.date_range("2020-01-01", periods=60, freq="D"),
                   pd.to_datetime("2020-01-01") + pd.to_timedelta(np.cumsum(rng.integers(1, 4, 60)), "D")):
        da = xr.DataArray(y, dims=("time", "sensor"), coords={"time": stamps})
        times = np.asarray((stamps - stamps[0]) / pd.Timedelta("1D"), dtype=float)
        out = da.kalman.filter(dim="time", theta=0.3, sigma=1.0, obs_var=0.5, time_unit="1D")
        ref = ks.filter(y, theta=0.3, sigma=1.0, obs_var=0.5, times=times)
        np.testing.assert_allclose(out["mean"].values, ref.mean, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(out["var"].values, ref.var, rtol=1e-12)
        fitted = da.kalman.fit(dim="time", time_unit="1D")
        res = ks.fit(y, times=times)
        np.testing.assert_allclose(fitted["theta"].values, res.params["theta"], rtol=1e-4)


def _no_apply_ufunc(*args, **kwargs):
    raise AssertionError("the in-memory path ran apply_ufunc")


_SENSOR_THETA = xr.DataArray([0.3, 0.9], dims="sensor", coords={"sensor": [10, 20]})
_FIRST, _LAST, _MIDDLE = ("time", "site", "sensor"), ("site", "sensor", "time"), ("site", "time", "sensor")


@pytest.mark.parametrize("order, params, dtype, regular", [
    (_FIRST, "site", np.float64, True), (_FIRST, "extra", np.float32, True), (_FIRST, "per_step", np.float64, False),
    (_LAST, "site", np.float32, True), (_LAST, "sensor", np.float64, False), (_LAST, "per_step", np.float64, True),
    (_MIDDLE, "scalars", np.float32, False), (_MIDDLE, "site", np.float64, True),
    (_MIDDLE, "sensor", np.float32, True), (_MIDDLE, "extra", np.float64, False),
])
def test_in_memory_equals_dask_path(monkeypatch, order, params, dtype, regular):
    """The in-memory layout (no apply_ufunc) gives the dask path's Dataset, bit for bit, for filter and
    smooth: time first, last or in the middle, missing values, regular or irregular times, parameters
    along a batch or channel dim, per step, or with a dim that da lacks."""
    da = _data(T=23, dtype=dtype).transpose(*order)
    if regular:
        da = da.assign_coords(time=pd.date_range("2021-03-01", periods=23, freq="6h"))
    kw = {"scalars": dict(theta=0.4),
          "site": dict(theta=_theta(), init_var=_theta() + 1.0),
          "sensor": dict(theta=_SENSOR_THETA, init_mean=_SENSOR_THETA),
          "per_step": dict(theta=_theta(), h=xr.DataArray(np.linspace(0.5, 1.5, 23), dims="time",
                                                        coords={"time": da.time})),
          "extra": dict(theta=xr.DataArray([0.1, 1.0], dims="model", coords={"model": ["x", "y"]}))}[params]
    for op in (kxr.filter, kxr.smooth):
        lazy = op(da.chunk({"site": 2}), time_unit="1D", sigma=0.7, obs_var=0.5, **kw)
        assert isinstance(lazy["mean"].data, dask.array.Array)
        with monkeypatch.context() as m:
            m.setattr(accessor, "_apply", _no_apply_ufunc)
            eager = op(da, time_unit="1D", sigma=0.7, obs_var=0.5, **kw)
        lazy = lazy.compute()
        xr.testing.assert_identical(eager, lazy)
        assert list(eager.data_vars) == list(lazy.data_vars)
        for name, var in eager.variables.items():
            assert var.dims == lazy[name].dims and var.dtype == lazy[name].dtype, name
            np.testing.assert_array_equal(var.values, lazy[name].values, err_msg=name)
        assert eager["mean"].dtype == dtype and eager["mean"].dims == (("model",) if params == "extra" else ()) + order


def test_in_memory_filters_a_view_of_da(monkeypatch):
    """A C-contiguous da reaches the filter without a copy: time first as ``(T, C)``, time in the middle
    as ``(site, T, sensor)``."""
    seen, run = [], ks.filter

    def spy(y, **kwargs):
        seen.append(y)
        return run(y, **kwargs)

    monkeypatch.setattr("kalmanscan.inference.filtering.filter", spy)
    first = _data().transpose(*_FIRST)
    for da in (first.copy(data=np.ascontiguousarray(first.values)), _data()):
        kxr.filter(da, time_unit="1D", theta=_SENSOR_THETA, sigma=0.7, obs_var=0.5)
        assert np.shares_memory(seen[-1], da.values)
    assert seen[0].shape == (37, 6) and seen[1].shape == (3, 37, 2)
