"""xarray front end (``ks.xr``): importing it registers the ``.kalman`` accessor on
``xarray.DataArray``. The accessor and the functions behind it are in :mod:`.accessor`, their
arguments' checks in :mod:`.arguments`, the dask blocks in :mod:`.blocks` (chunked along time:
:mod:`.timechunks`), the output Datasets in :mod:`.datasets`, the in-memory layout in :mod:`.layout`,
time coordinates in :mod:`.times`."""

from __future__ import annotations

from kalmanscan.xr.accessor import (KalmanAccessor, filter, fit, params, parse_time_unit, smooth, times_from_coord,
                                    to_dataset, to_numpy)

__all__ = ["filter", "smooth", "fit", "params", "to_numpy", "to_dataset", "KalmanAccessor", "times_from_coord",
           "parse_time_unit"]
