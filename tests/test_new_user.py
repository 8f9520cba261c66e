"""What a new user hit (issue 21): silent successes of ks.fit, boolean y, inexact CSV, unchecked
parameter files, touching table columns, datetime plots, the time unit of ks.xr.params, reprs."""

import json
import re
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.dates as mdates  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import xarray as xr  # noqa: E402
from helpers import api_examples  # noqa: E402

import kalmanscan as ks  # noqa: E402
from kalmanscan import cli  # noqa: E402
from kalmanscan.datasets import simulate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRUTH = dict(theta=0.5, sigma=1.0, obs_var=0.5)


def _run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# ks.fit: no silent success -------------------------------------------------------------------------

def test_fit_channel_without_observations_is_not_converged_and_says_which():
    _, y = simulate(T=80, seed=3, **TRUTH)
    y = np.concatenate([y, np.full_like(y, np.nan)], -1)
    before = y.copy()
    res = ks.fit(y, backend="torch")
    assert res.converged is False
    assert "channel 1" in res.reason and "no observations" in res.reason
    assert res.fitted.tolist() == [True, False]
    assert np.isnan(res.stderr["sigma"][1]) and np.isfinite(res.stderr["sigma"][0])
    assert "not converged" in repr(res)
    # the observed channel is fitted as if alone; the input is untouched
    alone = ks.fit(y[:, :1], backend="torch")
    assert alone.converged
    np.testing.assert_allclose(res.params["theta"][0], alone.params["theta"][0], rtol=1e-4)
    np.testing.assert_array_equal(y, before)


@pytest.mark.parametrize("T", [1, 2])
def test_fit_with_fewer_observations_than_parameters_is_not_converged(T):
    _, y = simulate(T=T, seed=0, **TRUTH)
    res = ks.fit(y, backend="torch")
    assert not res.converged
    assert f"{T} observation(s), fewer than the 3 estimated parameters" in res.reason
    assert all(np.isnan(v).all() for v in res.stderr.values())


def test_fit_shared_counts_observations_over_channels():
    _, y = simulate(T=2, seed=0, theta=np.full(2, 0.5), sigma=np.full(2, 1.0), obs_var=np.full(2, 0.5))
    res = ks.fit(y, shared=True, estimate=("sigma", "obs_var"), theta=0.5, backend="torch")
    assert res.fitted.tolist() == [True]    # 4 observations for 2 shared parameters


def test_fit_constant_channel_raises_naming_the_channel():
    _, y = simulate(T=60, seed=1, **TRUTH)
    y = np.concatenate([y, np.full_like(y, 4.25)], -1)
    y[7, 1] = np.nan
    with pytest.raises(ValueError, match=r"y: channel 1 is constant \(every observed value is 4.25\)") as info:
        ks.fit(y, backend="torch")
    assert "obs_var must be finite" not in str(info.value)
    # with obs_var fixed the likelihood is bounded: no error
    res = ks.fit(y, obs_var=0.5, estimate=("theta", "sigma"), backend="torch")
    assert res.params["sigma"].shape == (2,)


def test_fit_parameter_on_its_boundary_loses_only_its_own_stderr():
    # an OU process observed without noise: the MLE of obs_var is on its boundary 0
    _, y = simulate(theta=0.5, sigma=1.0, obs_var=1e-12, T=300, seed=1)
    res = ks.fit(y, backend="torch")
    assert res.converged, res.message
    obs_var = float(res.params["obs_var"][0])

    def nll(flat):
        return -ks.filter(torch.tensor(y), theta=flat[0], sigma=flat[1], obs_var=obs_var, backend="torch").loglik.sum()

    free = torch.tensor([float(res.params["theta"][0]), float(res.params["sigma"][0])], dtype=torch.float64)
    cov = torch.linalg.inv(torch.autograd.functional.hessian(nll, free)).numpy()
    np.testing.assert_allclose(res.cov[0, :2, :2], cov, rtol=1e-6)
    np.testing.assert_allclose([res.stderr["theta"][0], res.stderr["sigma"][0]], np.sqrt(np.diag(cov)), rtol=1e-6)
    assert np.isnan(res.stderr["obs_var"][0])
    assert np.isnan(res.cov[0, 2]).all() and np.isnan(res.cov[0, :, 2]).all()
    assert res.on_boundary["obs_var"].tolist() == [True]
    assert not res.on_boundary["theta"][0] and not res.on_boundary["sigma"][0]
    assert "on the boundary 0 (no standard error): obs_var" in repr(res)


def test_fit_interior_optimum_has_no_boundary():
    _, y = simulate(T=200, seed=2, **TRUTH)
    res = ks.fit(y, backend="torch")
    assert not any(v.any() for v in res.on_boundary.values())
    assert all(np.isfinite(v).all() for v in res.stderr.values())


@pytest.mark.slow  # about 2.3 s
def test_fit_leaks_no_warning_for_read_only_inputs():
    """torch warns once per process about a non-writable NumPy array: check in a fresh one."""
    code = (
        "import warnings, numpy as np, kalmanscan as ks\n"
        "warnings.simplefilter('error')\n"
        "y = np.random.default_rng(0).normal(size=(40, 2)); y.flags.writeable = False\n"
        "g = np.full(2, 0.3); g.flags.writeable = False\n"
        "ks.fit(y, theta=g, sigma=g, obs_var=g, mean=g, max_iter=3, backend='torch')\n"
        "ks.fit(y, theta=0.3, mean=g, estimate=('sigma', 'obs_var'), max_iter=3, backend='torch')\n"
        "print('clean')\n")
    proc = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "clean" in proc.stdout, proc.stderr[-2000:]


def test_fit_progress_bar_ends_at_100_percent_when_converged_early(capsys):
    _, y = simulate(T=100, seed=4, **TRUTH)
    res = ks.fit(y, backend="torch", progress=True, max_iter=200)
    assert res.converged and res.n_iter < 200
    last = re.split(r"[\r\n]", capsys.readouterr().err.strip())[-1]
    assert "100%" in last and f"{res.n_iter}/{res.n_iter}" in last and "converged" in last, last


def test_adam_progress_bar_ends_at_100_percent_when_converged_early(capsys):
    _, y = simulate(T=60, seed=4, **TRUTH)
    res = ks.fit(y, backend="torch", method="adam", progress=True, max_iter=2000, tol=5e-3)
    assert res.converged and res.n_iter < 2000
    last = re.split(r"[\r\n]", capsys.readouterr().err.strip())[-1]
    assert "100%" in last and "converged" in last, last


# boolean y ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [lambda y: y, torch.from_numpy])
def test_boolean_y_is_refused_naming_y(make):
    y = make(np.random.default_rng(0).random((20, 2)) > 0.5)
    with pytest.raises(ValueError, match=r"\by\b.*boolean"):
        ks.filter(y, **TRUTH)
    with pytest.raises(ValueError, match=r"\by\b.*boolean"):
        ks.fit(y)


def test_boolean_dataarray_is_refused_naming_da():
    da = xr.DataArray(np.zeros((5, 2), bool), dims=("time", "x"))
    with pytest.raises(ValueError, match=r"da must be numeric.*boolean"):
        ks.xr.filter(da, **TRUTH)


# CLI: exact CSV, parameter files, tables ------------------------------------------------------------

def _exact(path):
    """Each column of a CSV file parsed by Python's float (correctly rounded), where it parses."""
    out = {}
    for name, col in pd.read_csv(path, dtype=str).items():
        try:
            out[name] = np.array([float(v) for v in col])
        except ValueError:
            out[name] = col.to_numpy()
    return out


def test_csv_output_round_trips_epoch_seconds_and_values_exactly(tmp_path, capsys):
    rng = np.random.default_rng(5)
    times = 1.7e9 + np.cumsum(rng.uniform(0.1, 2.0, 120))   # epoch seconds with fractions
    _, y = simulate(times=times - times[0], seed=6, **TRUTH)
    pd.DataFrame({"t": times, "a": y[:, 0]}).to_csv(tmp_path / "in.csv", index=False, float_format="%.17g")
    code, _, err = _run(capsys, "filter", tmp_path / "in.csv", "--theta", "0.5", "--sigma", "1", "--obs-var",
                        "0.5", "-o", tmp_path / "out.csv")
    assert code == 0, err
    back = _exact(tmp_path / "out.csv")
    np.testing.assert_array_equal(back["t"], times)
    assert np.unique(back["t"]).size == times.size
    ref = ks.filter(y, times=times, **TRUTH)
    for name in ("mean", "var", "logliks", "pred_obs_var"):
        np.testing.assert_array_equal(back[f"a_{name}"], getattr(ref, name)[:, 0])
    # the kalmanscan reader reads the output back to the same bits
    from kalmanscan.cli.io import read_series

    again = read_series(str(tmp_path / "out.csv"), columns=["a_mean"])
    np.testing.assert_array_equal(again["time"].values, times)
    np.testing.assert_array_equal(again.values[:, 0], ref.mean[:, 0])


def test_fit_csv_and_netcdf_hold_the_same_bits(tmp_path, capsys):
    _, y = simulate(T=80, seed=7, theta=np.array([0.5, 0.2]), sigma=np.array([1.0, 2.0]), obs_var=np.array([0.5, 1.0]))
    pd.DataFrame({"t": np.arange(80.0), "a": y[:, 0], "b": y[:, 1]}).to_csv(tmp_path / "in.csv", index=False,
                                                                          float_format="%.17g")
    for out in ("fit.nc", "fit.csv"):
        code, _, err = _run(capsys, "fit", tmp_path / "in.csv", "--max-iter", "30", "-o", tmp_path / out)
        assert code == 0, err
    with xr.open_dataset(tmp_path / "fit.nc") as nc:
        table = _exact(tmp_path / "fit.csv")
        for k in ("theta", "sigma", "obs_var", "theta_stderr", "loglik"):
            np.testing.assert_array_equal(table[k], nc[k].values)


def _one_d(path, name, values):
    da = xr.DataArray(values, dims="time", coords={"time": np.arange(float(len(values)))}, name=name)
    da.to_dataset().to_netcdf(path)
    return str(path)


@pytest.fixture(scope="module")
def two_series():
    _, y = simulate(T=90, seed=8, theta=np.array([0.4, 0.1]), sigma=np.array([1.0, 0.5]), obs_var=np.array([0.3, 0.6]))
    return y


def test_parameter_file_channels_are_checked_for_netcdf_as_for_csv(tmp_path, capsys, two_series):
    flow = _one_d(tmp_path / "flow.nc", "flow", two_series[:, 0])
    temp = _one_d(tmp_path / "temp.nc", "temp", two_series[:, 1])
    pd.DataFrame({"t": np.arange(90.0), "flow": two_series[:, 0]}).to_csv(tmp_path / "flow.csv", index=False,
                                                                         float_format="%.17g")
    fits = {}
    for src in (flow, str(tmp_path / "flow.csv")):        # a 1-D NetCDF and a one-column CSV of the same data
        for fmt in ("nc", "csv"):
            out = tmp_path / f"fit_{Path(src).suffix[1:]}.{fmt}"
            code, _, err = _run(capsys, "fit", src, "--max-iter", "40", "-o", out)
            assert code == 0, err
            fits[out.name] = out
    results = []
    for name, params in fits.items():
        # another series: refused, whichever formats
        code, _, err = _run(capsys, "filter", temp, "--params", params)
        assert code == 2 and "fitted on channel(s) flow, not on temp" in err, (name, err)
        # the same series, as NetCDF or CSV: accepted, whichever formats
        for src in (flow, tmp_path / "flow.csv"):
            out = tmp_path / "f.nc"
            code, _, err = _run(capsys, "filter", src, "--params", params, "-o", out)
            assert code == 0, (name, src, err)
            with xr.open_dataset(out) as ds:
                results.append(float(ds["loglik"].sum()))
    np.testing.assert_allclose(results, results[0], rtol=1e-6)
    # a one-channel fit is refused on a two-channel input; a two-channel fit on a 1-D input of one of them
    pd.DataFrame({"t": np.arange(90.0), "flow": two_series[:, 0], "temp": two_series[:, 1]}).to_csv(
        tmp_path / "both.csv", index=False, float_format="%.17g")
    code, _, err = _run(capsys, "filter", tmp_path / "both.csv", "--params", fits["fit_nc.nc"])
    assert code == 2 and "not on temp" in err
    for fmt in ("nc", "csv"):
        code, _, err = _run(capsys, "fit", tmp_path / "both.csv", "--max-iter", "40",
                            "-o", tmp_path / f"fit_both.{fmt}")
        assert code == 0, err
        code, _, err = _run(capsys, "filter", temp, "--params", tmp_path / f"fit_both.{fmt}")
        assert code == 0, err
    with xr.open_dataset(tmp_path / "fit_both.nc") as ds:
        assert json.loads(ds.attrs["channels"]) == ["flow", "temp"]


def test_parameter_file_time_unit_must_match(tmp_path, capsys, two_series):
    dates = pd.date_range("2020-01-01", periods=90, freq="D").strftime("%Y-%m-%d")
    pd.DataFrame({"date": dates, "a": two_series[:, 0]}).to_csv(tmp_path / "d.csv", index=False)
    for fmt in ("nc", "csv"):
        code, _, err = _run(capsys, "fit", tmp_path / "d.csv", "--time-unit", "1D", "--max-iter", "30",
                            "-o", tmp_path / f"p.{fmt}")
        assert code == 0, err
        code, _, err = _run(capsys, "filter", tmp_path / "d.csv", "--time-unit", "1h", "--params",
                            tmp_path / f"p.{fmt}")
        assert code == 2 and "fitted with time unit 1D" in err, err
        code, _, err = _run(capsys, "filter", tmp_path / "d.csv", "--time-unit", "24h", "--params",
                            tmp_path / f"p.{fmt}")
        assert code == 0, err


def test_fit_table_columns_never_touch(capsys):
    ds = xr.Dataset({"theta": ((), 0.0445), "sigma": ("channel", [1.5]), "obs_var": ("channel", [2.0397e-10]),
                     "sigma_stderr": ("channel", [0.125]), "obs_var_stderr": ("channel", [1.2345e-11]),
                     "mean": ((), -12345.678), "loglik": ("channel", [-1.0]), "n_obs": ("channel", [50]),
                     "converged": ("channel", [True])},
                    attrs={"estimate": "sigma,obs_var", "shared": 0, "time_unit": "coordinate units"})

    class Data:
        labels = ["a_rather_long_channel_label"]

    cli.print_fit(ds, Data(), "fit")
    lines = capsys.readouterr().out.splitlines()
    header, row = lines[1].split(), lines[2].split()
    assert header == ["channel", "theta", "sigma", "obs_var", "mean"]
    assert row == ["a_rather_long_channel_label", "0.0445", "1.5", "+/-", "0.125", "2.0397e-10", "+/-", "1.23e-11",
                   "-12346"]
    # right-aligned columns: each header ends where its cells end
    for name, cell in (("theta", "0.0445"), ("obs_var", "1.23e-11"), ("mean", "-12346")):
        assert lines[1].index(name) + len(name) == lines[2].index(cell) + len(cell)


def test_cli_fit_reports_an_unfitted_and_a_constant_channel(tmp_path, capsys, two_series):
    table = pd.DataFrame({"t": np.arange(90.0), "a": two_series[:, 0], "empty": np.nan})
    table.to_csv(tmp_path / "e.csv", index=False)
    code, out, err = _run(capsys, "fit", tmp_path / "e.csv")
    assert code == 0, err
    assert "NOT converged" in out and "not fitted (no observations): empty" in out and "not fitted" not in err
    table["empty"] = 3.0
    table.to_csv(tmp_path / "c.csv", index=False)
    code, out, err = _run(capsys, "fit", tmp_path / "c.csv")
    assert code == 2 and "channel 'empty' is constant (every observed value is 3)" in err


# plots, xarray, reprs -------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["datetime64", "timestamps"])
def test_plots_take_datetime_times_and_label_dates(kind):
    _, y = simulate(T=100, seed=9, **TRUTH)
    y[40:50] = np.nan
    post = ks.filter(y, **TRUTH)
    dates = pd.date_range("1990-01-01", periods=100, freq="MS")
    times = dates.values if kind == "datetime64" else list(dates)
    for draw in (lambda: ks.plot.belief_band(post, y=y, times=times), lambda: ks.plot.nis(post, y, times=times),
                 lambda: ks.plot.gates(post, times=times)):
        ax = draw()
        ax.figure.canvas.draw()
        lo, hi = ax.get_xlim()
        assert mdates.date2num(dates[0]) - 200 < lo < hi < mdates.date2num(dates[-1]) + 200
        labels = " ".join(t.get_text() for t in ax.get_xticklabels())
        assert "1992" in labels or "1993" in labels, labels
        plt.close(ax.figure)
    with pytest.raises(ValueError, match="times"):
        ks.plot.belief_band(post, times=np.array(["a"] * 100, dtype=object))


def test_xr_params_carry_the_time_unit_to_filter_on_dates():
    _, y = simulate(T=60, seed=10, theta=np.array([0.3, 0.6]), sigma=np.array([1.0, 1.0]), obs_var=np.array([0.5, 0.5]))
    da = xr.DataArray(y, dims=("time", "site"), coords={"time": pd.date_range("2024-01-01", periods=60, freq="6h"),
                                                        "site": ["a", "b"]})
    fit_ds = ks.xr.fit(da, time_unit="1D", max_iter=30)
    params = ks.xr.params(fit_ds)
    assert params["time_unit"] == "1D"
    ds = ks.xr.filter(da, **params)
    np.testing.assert_allclose(ds["loglik"].values, fit_ds["loglik"].values, rtol=1e-10)
    assert ds.attrs["time_unit"] == "1D" and bool(fit_ds["fitted"].all())
    numeric = ks.xr.fit(da.assign_coords(time=np.arange(60.0)), max_iter=5)
    assert "time_unit" not in ks.xr.params(numeric)


def test_docs_api_xr_example_runs():
    for block in api_examples("ks.xr.params(fit_ds)"):
        namespace = {}
        exec(compile(block, "docs/api.md", "exec"), namespace)
        assert "time_unit" in namespace["ks"].xr.params(namespace["fit_ds"])


def _check_short(text, *needles):
    lines = text.splitlines()
    assert 2 <= len(lines) <= 6, text
    assert "array(" not in text and "tensor(" not in text and "[[" not in text, text
    for n in needles:
        assert n in text, (n, text)


def test_posterior_and_forecast_reprs_are_a_few_lines():
    _, y = simulate(T=300, seed=11, theta=np.array([0.5, 0.2]), sigma=np.ones(2), obs_var=np.full(2, 0.5))
    post = ks.filter(y, theta=np.array([0.5, 0.2]), sigma=1.0, obs_var=0.5)
    _check_short(repr(post), "Posterior (filter)", "(300, 2)", "float64", "NumPy", "pred_obs_var", "logliks",
                 f"total {post.loglik.sum():.6g} over 2 series")
    smooth = ks.smooth(torch.tensor(y, dtype=torch.float32), theta=0.5, sigma=1.0, obs_var=0.5)
    _check_short(repr(smooth), "Posterior (smoother)", "torch.float32 on cpu", "filtered")
    fc = ks.forecast(post, 7)
    _check_short(repr(fc), "Forecast", "K = 7", "(7, 2)", "float64", "obs_mean", "lead 1 to 7")
    fc_t = ks.forecast(smooth, times=[305.0, 310.0])
    _check_short(repr(fc_t), "torch.float32 on cpu", "lead 6 to 11")
    assert str(post) == repr(post)
