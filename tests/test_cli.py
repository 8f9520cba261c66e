"""The ``kalmanscan`` command line: filter/smooth/fit/calibrate on CSV and NetCDF, and its errors."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import xarray as xr

import kalmanscan as ks
from kalmanscan.cli import main
from kalmanscan.cli.io import write_dataset

CHANNELS = ["temperature", "pressure", "level"]


@pytest.fixture(scope="module")
def sensors():
    return ks.datasets.sensors(T=150, seed=2)


def _csv(path, sensors, dates=False):
    table = pd.DataFrame(sensors.y, columns=CHANNELS)
    if dates:
        table.insert(0, "date", pd.date_range("2023-05-01", periods=len(table), freq="D").strftime("%Y-%m-%d"))
    else:
        table.insert(0, "t", sensors.times)
    table.to_csv(path, index=False, float_format="%.17g", na_rep="")
    return str(path)


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


MODEL = ["--theta", "0.02,0.05,0.1", "--sigma", "0.3,0.4,0.5", "--obs-var", "0.05,0.2,0.8", "--mean", "20,5,-3"]


def _model(sensors):
    return {k: sensors.params[k] for k in ("theta", "sigma", "obs_var", "mean")}


def test_filter_csv_to_netcdf_and_png(tmp_path, capsys, sensors):
    src = _csv(tmp_path / "s.csv", sensors)
    code, out, err = _run(capsys, "filter", src, *MODEL, "-o", tmp_path / "f.nc", "--plot", tmp_path / "f.png",
                          "--progress")
    assert code == 0, err
    assert "temperature" in out and "wrote" in out
    assert "kalmanscan filter" in err and "5/5" in err
    ref = ks.filter(sensors.y, times=sensors.times, **_model(sensors))
    with xr.open_dataset(tmp_path / "f.nc") as ds:
        assert ds["mean"].dims == ("time", "channel") and list(ds["channel"].values) == CHANNELS
        assert ds.attrs["time_column"] == "t"
        np.testing.assert_allclose(ds["mean"].values, ref.mean, rtol=1e-12)
        np.testing.assert_allclose(ds["upper"].values, ref.mean + 1.959963984540054 * np.sqrt(ref.var), rtol=1e-12)
        np.testing.assert_allclose(ds["loglik"].values, ref.loglik, rtol=1e-12)
        np.testing.assert_array_equal(ds["time"].values, sensors.times)
    assert (tmp_path / "f.png").stat().st_size > 20_000


def test_smooth_iso_dates_to_csv(tmp_path, capsys, sensors):
    src = _csv(tmp_path / "d.csv", sensors, dates=True)
    code, _, err = _run(capsys, "smooth", src, "--time-unit", "1D", *MODEL, "--level", "0.9", "-o", tmp_path / "s.csv")
    assert code == 0, err
    table = pd.read_csv(tmp_path / "s.csv")
    assert table.columns[0] == "date" and table["date"].iloc[2] == "2023-05-03"
    ref = ks.smooth(sensors.y, dt=1.0, **_model(sensors))
    for c, name in enumerate(CHANNELS):
        np.testing.assert_allclose(table[f"{name}_mean"], ref.mean[:, c], rtol=1e-9)
        np.testing.assert_allclose(table[f"{name}_filtered_var"], ref.filtered.var[:, c], rtol=1e-9)
        np.testing.assert_allclose(table[f"{name}_lower"], ref.mean[:, c] - 1.6448536269514722 * np.sqrt(ref.var[:, c]),
                                   rtol=1e-9)


def test_fit_writes_params_that_filter_and_calibrate_read(tmp_path, capsys, sensors):
    src = _csv(tmp_path / "s.csv", sensors)
    code, out, err = _run(capsys, "fit", src, "--estimate", "theta,sigma,obs_var,mean", "--max-iter", "60",
                          "-o", tmp_path / "fit.nc")
    assert code == 0, err
    assert "obs_var" in out and "+/-" in out
    with xr.open_dataset(tmp_path / "fit.nc") as fit:
        fit = fit.load()
    write_dataset(fit, tmp_path / "fit.csv")
    assert pd.read_csv(tmp_path / "fit.csv")["channel"].tolist() == CHANNELS
    assert fit.attrs["kalmanscan"] == "fit" and fit["theta"].dims == ("channel",)
    flags = [f"--{k.replace('_', '-')}" if i % 2 == 0 else ",".join(repr(float(v)) for v in fit[k].values)
             for k in ("theta", "sigma", "obs_var", "mean") for i in range(2)]
    results = []
    for extra in (["--params", tmp_path / "fit.nc"], ["--params", tmp_path / "fit.csv"], flags):
        out_file = tmp_path / f"f{len(results)}.nc"
        code, _, err = _run(capsys, "filter", src, *extra, "-o", out_file)
        assert code == 0, err
        with xr.open_dataset(out_file) as ds:
            results.append(ds.load())
    np.testing.assert_allclose(results[0]["loglik"].values, fit["loglik"].values, rtol=1e-10)
    xr.testing.assert_allclose(results[0], results[1], rtol=1e-9)
    xr.testing.assert_allclose(results[0], results[2], rtol=1e-12)
    code, out, err = _run(capsys, "calibrate", src, "--params", tmp_path / "fit.nc", "--strict")
    assert code == 0, err
    assert "CalibrationReport: calibrated" in out


def test_calibrate_catches_a_misspecified_model(tmp_path, capsys, sensors):
    src = _csv(tmp_path / "s.csv", sensors)
    wrong = MODEL[:5] + ["0.8,3.2,12.8"] + MODEL[6:]
    code, out, err = _run(capsys, "calibrate", src, *wrong, "--plot", tmp_path / "cal.png")
    assert code == 0, err
    assert "NOT calibrated" in out and "over-dispersed" in out
    code, _, _ = _run(capsys, "calibrate", src, *wrong, "--strict")
    assert code == 1
    assert (tmp_path / "cal.png").stat().st_size > 20_000


def test_netcdf_with_extra_dims_and_fit_first(tmp_path, capsys):
    rng = np.random.default_rng(0)
    y = np.cumsum(rng.normal(size=(2, 60, 3)), axis=1) + 0.5 * rng.normal(size=(2, 60, 3))
    y[1, 10:20, 2] = np.nan
    da = xr.DataArray(y, dims=("site", "hour", "depth"),
                      coords={"site": ["n", "s"], "hour": pd.date_range("2020-01-01", periods=60, freq="h"),
                              "depth": [1.0, 5.0, 10.0]}, attrs={"units": "degC"})
    src = tmp_path / "grid.nc"
    xr.Dataset({"temp": da, "mask": da.isel(hour=0, drop=True)}).to_netcdf(src)
    code, out, err = _run(capsys, "filter", src, "--var", "temp", "--dim", "hour", "--time-unit", "1h", "--fit",
                          "--theta", "0", "--init-var", "100", "--estimate", "sigma,obs_var", "-o", tmp_path / "o.nc")
    assert code == 0, err
    assert "fitted model" in out and "site=s,depth=10.0" in out
    with xr.open_dataset(tmp_path / "o.nc") as ds:
        assert ds["mean"].dims == ("site", "hour", "depth") and ds.attrs["units"] == "degC"
        assert ds.attrs["time_unit"] == "1h"
        assert np.isfinite(ds["mean"].values).all()


@pytest.mark.parametrize("content, extra, message", [
    ("t,a,b\n1,2,3\n2,x,4\n3,5,6\n", [], "column 'a' has a non-numeric value 'x' at line 3"),
    ("t,a,b\n1,2,3\n3,1,4\n2,5,6\n", [], "not strictly increasing: line 4 (2) comes before line 3 (3)"),
    ("t,a,b\n1,2,3\n1,1,4\n2,5,6\n", [], "line 3 (1) repeats line 2 (1)"),
    ("t,a,b\n1,2,3\n,1,4\n", [], "time column 't' is empty at line 3"),
    ("t,a,b\n1,2,3\nnoon,1,4\n", [], "time column 't' has 'noon' at line 3; times are numbers"),
    ("t,a,b\n2020-01-01,2,3\nnoon,1,4\n", [], "'noon' at line 3, which is neither a number nor an ISO 8601"),
    ("t,a,b\n1,2,3\n2,1,4\n", ["--columns", "a,c"], "has no column 'c' (columns: t, a, b)"),
    ("t,a,b\n1,2,3\n2,1,4\n", ["--time-col", "time"], "has no time column 'time'"),
    ("t,a,b\n", [], "has a header but no data rows"),
    ("", [], "is empty"),
    ("t,a,b\n2020-01-01,2,3\n2020-01-02,1,4\n", [], "are dates; give --time-unit"),
    ("t,a,b\n1,2,3\n2,1,4\n", ["--obs-var", "1,2,3"], "--obs-var has 3 values; give one, or one per channel (2: a, b)"),
    ("t,a,b\n1,2,3\n2,1,inf\n", [], "column 'b' has an infinite value at line 3"),
])
def test_bad_csv_files_exit_2_with_a_message(tmp_path, capsys, content, extra, message):
    src = tmp_path / "bad.csv"
    src.write_text(content)
    argv = ["filter", src, "--theta", "1", "--sigma", "1", "--obs-var", "1", *extra]
    code, out, err = _run(capsys, *argv)
    assert code == 2
    assert message in err and "Traceback" not in err


def test_bad_invocations_exit_2_and_never_overwrite_the_input(tmp_path, capsys, sensors):
    src = _csv(tmp_path / "s.csv", sensors)
    before = Path(src).read_bytes()
    cases = [
        (["-o", src], "refusing to overwrite the input file"),
        (["-o", str(tmp_path / "." / "s.csv")], "refusing to overwrite the input file"),
        (["--plot", src], "refusing to overwrite the input file"),
        (["-o", tmp_path / "x.png", "--plot", tmp_path / "x.png"], "cannot tell its format"),
        (["-o", tmp_path / "x.nc", "--plot", tmp_path / "x.nc"], "-o and --plot both name the file"),
        (["-o", tmp_path / "p.nc", "--params", tmp_path / "p.nc"], "refusing to overwrite the parameter file"),
        (["--fit", "--params", tmp_path / "p.nc"], "--fit and --params exclude each other"),
    ]
    for extra, message in cases:
        code, _, err = _run(capsys, "filter", src, *MODEL, *extra)
        assert code == 2 and message in err, (extra, err)
    assert Path(src).read_bytes() == before
    code, _, err = _run(capsys, "filter", src, "--theta", "1", "--sigma", "1")
    assert code == 2 and "the model needs --obs-var" in err
    code, _, err = _run(capsys, "filter", tmp_path / "missing.csv", *MODEL)
    assert code == 2 and "does not exist" in err
    (tmp_path / "dir.csv").mkdir()
    code, _, err = _run(capsys, "filter", tmp_path / "dir.csv", *MODEL)
    assert code == 2 and "input file" in err and "is a directory" in err
    code, _, err = _run(capsys, "filter", src, "--params", tmp_path / "dir.csv")
    assert code == 2 and "parameter file" in err and "is a directory" in err
    code, _, err = _run(capsys, "filter", src, "--theta", "1", "--sigma", "1", "--obs-var", "-1")
    assert code == 2 and "obs_var must be finite and > 0" in err
    code, _, err = _run(capsys, "filter", src, *MODEL, "--params", src)
    assert code == 2 and "no parameter column" in err
    with pytest.raises(SystemExit) as exit_info:
        main(["filter", src, "--theta", "abc"])
    assert exit_info.value.code == 2


def test_dt_ignores_dates_and_keeps_them_as_labels(tmp_path, capsys, sensors):
    src = _csv(tmp_path / "d.csv", sensors, dates=True)
    code, out, err = _run(capsys, "filter", src, "--dt", "1", *MODEL, "-o", tmp_path / "f.nc")
    assert code == 0, err
    assert "steps of dt = 1" in out
    ref = ks.filter(sensors.y, dt=1.0, **_model(sensors))
    with xr.open_dataset(tmp_path / "f.nc") as ds:
        np.testing.assert_allclose(ds["mean"].values, ref.mean, rtol=1e-12)
        assert ds["time"].values[2] == np.datetime64("2023-05-03") and ds.attrs["time_unit"] == "steps of dt = 1"
    code, _, err = _run(capsys, "smooth", src, "--dt", "1", "--time-unit", "1D", *MODEL, "-o", tmp_path / "s.csv",
                        "--plot", tmp_path / "s.png")
    assert code == 0, err
    table = pd.read_csv(tmp_path / "s.csv")
    assert table["date"].iloc[2] == "2023-05-03"
    np.testing.assert_allclose(table["level_mean"], ks.smooth(sensors.y, dt=1.0, **_model(sensors)).mean[:, 2],
                               rtol=1e-9)
    nc = tmp_path / "plain.nc"  # a time dimension without a coordinate
    xr.Dataset({"v": (("time",), sensors.y[:, 0])}).to_netcdf(nc)
    code, _, err = _run(capsys, "filter", nc, "--dt", "2", "--theta", "0.1", "--sigma", "1", "--obs-var", "1")
    assert code == 0, err


def test_per_channel_flags_over_two_non_time_dims(tmp_path, capsys):
    y = np.random.default_rng(0).normal(size=(2, 3, 20))
    src = tmp_path / "g.nc"
    xr.DataArray(y, dims=("lat", "lon", "time"), name="v",
                 coords={"time": np.arange(20.0), "lat": [1.0, 2.0], "lon": [1, 2, 3]}).to_dataset().to_netcdf(src)
    theta = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    code, out, err = _run(capsys, "filter", src, "--theta", ",".join(map(str, theta)), "--sigma", "1",
                          "--obs-var", "0.5,1,1.5,2,2.5,3", "-o", tmp_path / "o.nc")
    assert code == 0, err
    assert "lat=2.0,lon=3" in out
    ref = ks.filter(y.reshape(6, 20).T, times=np.arange(20.0), theta=np.array(theta), sigma=1.0,
                    obs_var=np.array([0.5, 1, 1.5, 2, 2.5, 3]))
    with xr.open_dataset(tmp_path / "o.nc") as ds:
        np.testing.assert_allclose(ds["mean"].transpose("lat", "lon", "time").values.reshape(6, 20).T, ref.mean,
                                   rtol=1e-12)
    code, _, err = _run(capsys, "filter", src, "--theta", "0.1,0.2,0.3", "--sigma", "1", "--obs-var", "1")
    assert code == 2 and "--theta has 3 values; give one, or one per channel (6: lat=1.0,lon=1" in err


def test_csv_params_with_infinite_init_var_read_back(tmp_path, capsys):
    src = str(Path(ks.__file__).parent / "datasets" / "nile.csv")
    fit = ["fit", src, "--theta", "0", "--init-var", "inf", "--estimate", "sigma,obs_var"]
    results = []
    for name in ("fit.csv", "fit.nc"):
        code, _, err = _run(capsys, *fit, "-o", tmp_path / name)
        assert code == 0, err
        code, _, err = _run(capsys, "filter", src, "--params", tmp_path / name, "-o", tmp_path / f"f-{name}.nc")
        assert code == 0, err
        with xr.open_dataset(tmp_path / f"f-{name}.nc") as ds:
            results.append(ds.load())
    xr.testing.assert_allclose(results[0], results[1], rtol=1e-12)
    bad = tmp_path / "bad.csv"
    bad.write_text("channel,theta,sigma,obs_var\nvolume,x,1,1\n")
    code, _, err = _run(capsys, "filter", src, "--params", bad)
    assert code == 2 and f"parameter file '{bad}': column 'theta' has a non-numeric value 'x'" in err


def test_calibrate_plot_uses_the_first_channel_with_observations(tmp_path, capsys, monkeypatch):
    values = np.random.default_rng(0).normal(size=50)
    src = tmp_path / "in.csv"
    src.write_text("t,a,b\n" + "".join(f"{i},,{v!r}\n" for i, v in enumerate(values.tolist())))
    titles = []
    nis = ks.plot.nis
    monkeypatch.setattr(ks.plot, "nis", lambda *a, **kw: (titles.append((kw["channel"], kw["title"])), nis(*a, **kw)))
    code, out, err = _run(capsys, "calibrate", src, "--theta", "0.3", "--sigma", "1", "--obs-var", "0.5",
                          "--plot", tmp_path / "c.png")
    assert code == 0, err
    assert "CalibrationReport" in out and "wrote" in out
    assert titles == [(1, "NIS, b (the first channel with observations)")]
    assert (tmp_path / "c.png").stat().st_size > 20_000


def test_netcdf_input_errors(tmp_path, capsys):
    ds = xr.Dataset({"a": (("time", "x"), np.ones((4, 2))), "b": (("time",), np.ones(4))},
                    coords={"time": [0.0, 1.0, 3.0, 2.0]})
    src = tmp_path / "two.nc"
    ds.to_netcdf(src)
    code, _, err = _run(capsys, "filter", src, *MODEL)
    assert code == 2 and "has 2 data variables with dimension 'time' (a, b" in err
    code, _, err = _run(capsys, "filter", src, "--var", "a", "--theta", "1", "--sigma", "1", "--obs-var", "1")
    assert code == 2 and "coordinate 'time' must be strictly increasing" in err
    code, _, err = _run(capsys, "filter", src, "--var", "a", "--dim", "step", *MODEL)
    assert code == 2 and "has no dimension 'step'" in err


def test_demo_still_runs(tmp_path, capsys):
    code, out, err = _run(capsys, "demo", "--out", tmp_path / "demo.png")
    assert code == 0, err
    assert "Nile" in out and (tmp_path / "demo.png").stat().st_size > 10_000


@pytest.mark.slow  # about 2.5 s: child processes
def test_installed_console_script_reports_bad_files(tmp_path):
    src = tmp_path / "unsorted.csv"
    src.write_text("t,a\n1,2\n3,1\n2,5\n")
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    script = shutil.which("kalmanscan", path=search)
    assert script is not None, "the kalmanscan console script is not installed"
    proc = subprocess.run([script, "filter", str(src), "--theta", "1", "--sigma", "1", "--obs-var", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "time column 't' is not strictly increasing" in proc.stderr and "Traceback" not in proc.stderr


def test_fit_table_sums_the_loglik_and_shows_boundary_estimates(capsys):
    from kalmanscan.cli import print_fit

    ds = xr.Dataset({"theta": ("channel", [0.8, 0.3]), "obs_var": ("channel", [3.788e-10, 0.28]),
                     "theta_stderr": ("channel", [0.115, 0.09]), "obs_var_stderr": ("channel", [np.nan, 0.056]),
                     "theta_on_boundary": ("channel", [False, False]),
                     "obs_var_on_boundary": ("channel", [True, False]),
                     "loglik": ("channel", [-300.0, -200.5]), "n_obs": ("channel", [300, 300]),
                     "converged": ("channel", [True, True]), "fitted": ("channel", [True, True])},
                    attrs={"estimate": "theta,obs_var", "shared": 0, "time_unit": "coordinate units"})

    class Data:
        labels = ["exact", "noisy"]

    print_fit(ds, Data(), "fit")
    out = capsys.readouterr().out
    assert "log-likelihood -500.5 (summed over 2 channels; parameters per channel;" in out
    assert "3.788e-10 (on the boundary 0)" in out and "nan" not in out
    assert "0.28 +/- 0.056" in out


def test_unfitted_channel_is_reported_once(tmp_path, capsys, sensors):
    table = pd.DataFrame({"t": sensors.times[:60], "a": sensors.y[:60, 0], "empty": np.nan})
    table.to_csv(tmp_path / "e.csv", index=False)
    code, out, err = _run(capsys, "fit", tmp_path / "e.csv", "--max-iter", "30")
    assert code == 0, err
    assert (out + err).count("not fitted") == 1 and "not fitted (no observations): empty" in out
    row = next(line for line in out.splitlines() if line.split()[0] == "empty")
    assert "nan" not in row


def test_integer_times_stay_integers(tmp_path, capsys):
    src = tmp_path / "nile.csv"
    src.write_text("year,volume\n1871,1120\n1872,1160\n1873,963\n1874,1210\n")
    for suffix in ("csv", "nc"):
        code, _, err = _run(capsys, "filter", src, "--theta", "0", "--sigma", "38", "--obs-var", "15099",
                            "--init-var", "inf", "-o", tmp_path / f"f.{suffix}")
        assert code == 0, err
    assert (tmp_path / "f.csv").read_text().splitlines()[1].startswith("1871,")
    with xr.open_dataset(tmp_path / "f.nc") as ds:
        assert ds["time"].dtype == np.int64 and ds["time"].values.tolist() == [1871, 1872, 1873, 1874]


def test_band_legend_agrees_with_the_api(tmp_path, capsys, sensors, monkeypatch):
    """The CLI's exact 95% quantile and the API's default z = 1.96 are labelled alike."""
    import matplotlib

    matplotlib.use("Agg")
    labels = []
    real = ks.plot.belief_band

    def spy(*args, **kwargs):
        ax = real(*args, **kwargs)
        labels.append([t.get_text() for t in ax.get_legend().get_texts()])
        return ax

    monkeypatch.setattr(ks.plot, "belief_band", spy)
    src = _csv(tmp_path / "s.csv", sensors)
    code, _, err = _run(capsys, "filter", src, *MODEL, "--plot", tmp_path / "f.png")
    assert code == 0, err
    post = ks.filter(sensors.y, times=sensors.times, **_model(sensors))
    spy(post)
    assert "mean ± 1.96σ" in labels[0] and "mean ± 1.96σ" in labels[-1]
