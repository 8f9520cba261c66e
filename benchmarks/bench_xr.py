"""The xarray front end (``da.kalman.filter``, ``da.kalman.smooth``) beside ``ks.filter`` /
``ks.smooth`` on the same NumPy data, in one process. A script, not a test.

    python -m benchmarks run xr [--out xr.json] [--repeat 7]

For each shape ``(T, C)``: a float64 DataArray ``(time, sensor)`` with a daily ``datetime64``
coordinate and 10% missing, filtered with ``time_unit="1D"`` (exactly regular: the accessor passes
``dt``), against the public call on its NumPy values returning every field; the accessor's result
is checked against that posterior first; and ``ks.xr.to_dataset`` of that posterior (the labelling
alone, as the command line uses it). Best of ``--repeat`` wall times, ms.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import xarray as xr

import kalmanscan as ks
from benchmarks.common import shapes_parser, wall_times, write_shape_rows

SHAPES = [(1000, 1000), (10000, 100), (100, 10000)]
PARAMS = dict(theta=0.1, sigma=1.0, obs_var=0.5)


def best_ms(fn, repeat):
    return 1e3 * min(wall_times(fn, repeat, warmup=False))


def row(T, C, repeat):
    rng = np.random.default_rng(0)
    y = rng.normal(size=(T, C))
    y[rng.random(y.shape) < 0.1] = np.nan
    da = xr.DataArray(y, dims=("time", "sensor"),
                      coords={"time": pd.date_range("2020-01-01", periods=T, freq="D"), "sensor": np.arange(C)})
    out = dict(T=T, C=C)
    for name, public in (("filter", ks.filter), ("smooth", ks.smooth)):
        accessor = getattr(da.kalman, name)
        post, ds = public(y, **PARAMS), accessor(time_unit="1D", **PARAMS)
        np.testing.assert_allclose(ds["mean"].values, post.mean, rtol=1e-12)
        np.testing.assert_allclose(ds["var"].values, post.var, rtol=1e-12)
        out[f"ks_{name}_ms"] = best_ms(lambda: public(y, **PARAMS), repeat)
        out[f"xr_{name}_ms"] = best_ms(lambda: accessor(time_unit="1D", **PARAMS), repeat)
        flat, _ = ks.xr.to_numpy(da, time_unit="1D")
        post = public(flat, **PARAMS)
        out[f"to_dataset_{name}_ms"] = best_ms(lambda: ks.xr.to_dataset(post, da, time_unit="1D"), repeat)
    return out


def parser():
    """The command line: ``--out`` (JSON file) and ``--repeat``."""
    return shapes_parser(__doc__.splitlines()[0])


def main(argv: list[str] | None = None) -> dict:
    return write_shape_rows(parser().parse_args(argv), SHAPES, row)


if __name__ == "__main__":
    main()
