"""Zarr stores on the command line: a Zarr input is filtered and smoothed chunk by chunk (along time
too) into a Zarr output with the same chunks, equal to the in-memory call; NetCDF and CSV stay."""

import numpy as np
import pytest
import xarray as xr

import kalmanscan.xr as kxr
from kalmanscan.cli import main

pytest.importorskip("zarr")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _store(tmp_path, chunks):
    rng = np.random.default_rng(2)
    y = rng.normal(size=(90, 3)).cumsum(0) * 0.1 + rng.normal(size=(90, 3))
    y[30:41, 1] = np.nan
    da = xr.DataArray(y, dims=("time", "channel"), name="level",
                      coords={"time": np.arange(90.0) * 0.5, "channel": ["a", "b", "c"]})
    path = tmp_path / "in.zarr"
    da.to_dataset().chunk(chunks).to_zarr(path, mode="w")
    return da, path


@pytest.mark.parametrize("command", ["filter", "smooth"])
def test_zarr_in_zarr_out_chunk_by_chunk(tmp_path, capsys, command):
    da, path = _store(tmp_path, {"time": 25})
    out = tmp_path / "out.zarr"
    assert main([command, str(path), "-o", str(out), "--theta", "0.1", "--sigma", "0.5", "--obs-var",
                 "1,0.5,2"]) == 0
    assert "chunk by chunk" in capsys.readouterr().out
    got = xr.open_zarr(out)
    assert got["mean"].chunksizes["time"] == (25, 25, 25, 15)
    theta, sigma = 0.1, 0.5
    obs_var = xr.DataArray([1.0, 0.5, 2.0], dims="channel", coords={"channel": da.channel})
    ref = getattr(kxr, command)(da, theta=theta, sigma=sigma, obs_var=obs_var)
    for name in ("mean", "var", "loglik", "lower"):
        np.testing.assert_allclose(got[name].values, ref[name].values, rtol=1e-11, atol=1e-13, err_msg=name)


def test_zarr_input_refuses_what_needs_memory(tmp_path):
    _, path = _store(tmp_path, {"time": 30})
    base = ["filter", str(path), "--theta", "0.1", "--sigma", "0.5", "--obs-var", "1"]
    assert main(base + ["-o", str(tmp_path / "out.csv")]) == 2
    assert main(base + ["-o", str(tmp_path / "out.zarr"), "--plot", str(tmp_path / "p.png")]) == 2
    assert main(["filter", str(tmp_path / "absent.zarr"), "-o", str(tmp_path / "o.zarr"), "--theta", "0.1",
                 "--sigma", "0.5", "--obs-var", "1"]) == 2


def test_netcdf_in_zarr_out_and_zarr_parameters(tmp_path):
    da, _ = _store(tmp_path, {"time": 30})
    nc = tmp_path / "in.nc"
    da.to_dataset().to_netcdf(nc)
    params = tmp_path / "params.zarr"
    assert main(["fit", str(nc), "-o", str(params), "--theta", "0.1", "--sigma", "0.5", "--obs-var", "1"]) == 0
    out = tmp_path / "out.zarr"
    assert main(["filter", str(nc), "--params", str(params), "-o", str(out)]) == 0
    fitted = kxr.params(xr.open_zarr(params).load())
    ref = kxr.filter(da, **fitted)
    np.testing.assert_allclose(xr.open_zarr(out)["mean"].values, ref["mean"].values, rtol=1e-12)
