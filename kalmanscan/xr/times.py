"""Time along an xarray coordinate: model times from ``datetime64``, ``timedelta64`` or numeric
values, and the choice between ``times`` and a regular ``dt`` (see :mod:`kalmanscan.xr`)."""

from __future__ import annotations

import datetime
from typing import Any

import numpy as np

from kalmanscan.types import ArrayLike

TimeUnit = Any
"""A pandas offset string (``"1D"``), ``numpy.timedelta64`` or ``datetime.timedelta``."""

__all__ = ["TimeUnit", "parse_time_unit", "times_from_coord"]


def parse_time_unit(time_unit: TimeUnit) -> np.timedelta64:
    """``time_unit`` (``"1D"``, ``"s"``, ``"15min"``, ``numpy.timedelta64``, ``datetime.timedelta``)
    as a positive ``numpy.timedelta64`` in nanoseconds."""
    import pandas as pd

    try:
        if isinstance(time_unit, str):
            text = time_unit.strip()
            unit = pd.Timedelta(text if text[:1].isdigit() else "1" + text)
        elif isinstance(time_unit, (np.timedelta64, datetime.timedelta, pd.Timedelta)):
            unit = pd.Timedelta(time_unit)
        else:
            raise TypeError
    except (TypeError, ValueError):
        raise ValueError(f"time_unit must be a duration like '1D', 's' or numpy.timedelta64, "
                         f"got {time_unit!r}") from None
    if unit <= pd.Timedelta(0):
        raise ValueError(f"time_unit must be a positive duration, got {time_unit!r}")
    return unit.to_timedelta64().astype("timedelta64[ns]")


def times_from_coord(values: ArrayLike, time_unit: TimeUnit | None = None,
                     name: str = "time") -> tuple[np.ndarray, str]:
    """Model times ``(T,)`` float64 from coordinate ``values``, and the unit's label.

    ``datetime64``/``timedelta64`` values become ``(t - t_0) / time_unit`` (``time_unit`` required);
    numeric values are returned as float64 (``time_unit`` must be ``None``). Raises ``ValueError``
    naming ``name`` unless the times are finite and strictly increasing.
    """
    values = np.asarray(values)
    if values.dtype.kind in "mM":
        if time_unit is None:
            raise ValueError(f"time_unit is required for the {values.dtype} coordinate {name!r} "
                             "(for example time_unit='1D' or 's'; theta and sigma are then per that unit)")
        if np.isnat(values).any():
            raise ValueError(f"coordinate {name!r} contains NaT (missing times)")
        unit = parse_time_unit(time_unit)
        times = (values - values[:1]).astype("timedelta64[ns]") / unit
        label = time_unit if isinstance(time_unit, str) else str(np.timedelta64(unit, "ns"))
    elif values.dtype.kind in "biuf":
        if time_unit is not None:
            raise ValueError(f"time_unit applies to datetime64 coordinates; coordinate {name!r} is numeric "
                             "and is used as times in model units as it is")
        times = values.astype(np.float64)
        label = "coordinate units"
    else:
        raise ValueError(f"coordinate {name!r} must be numeric or datetime64, got dtype {values.dtype}")
    times = np.asarray(times, dtype=np.float64)
    if not np.isfinite(times).all():
        raise ValueError(f"coordinate {name!r} must be finite")
    bad = np.flatnonzero(np.diff(times) <= 0)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"coordinate {name!r} must be strictly increasing; position {i + 1} "
                         f"({values[i + 1]}) does not come after position {i} ({values[i]})")
    return times, label


def time_steps(da: Any, dim: str, time_unit: TimeUnit | None, kwargs: dict) -> tuple[np.ndarray | None, str]:
    """``(times or None, unit label)`` from the coordinate along ``dim`` (see module docstring)."""
    if "times" in kwargs:
        raise ValueError(f"times: ks.xr takes the times from the coordinate {dim!r}; assign it instead "
                         f"(da.assign_coords({dim}=...))")
    if "dt" in kwargs or dim not in da.coords:
        if time_unit is not None:
            raise ValueError("time_unit applies to a datetime64 coordinate; with regular steps dt it has no meaning")
        return None, "steps of dt"
    return times_from_coord(da[dim].values, time_unit, dim)


def regular_steps(times: np.ndarray | None, static: dict) -> np.ndarray | None:
    """``times``, or ``None`` with ``static["dt"]`` set when the times are exactly regular (daily
    dates in days, say): the same filter, whose static parameters then run the static loops
    instead of discretising every step again."""
    if times is not None and len(times) > 1:
        steps = np.diff(times)
        if np.all(steps == steps[0]):
            static["dt"] = float(steps[0])
            return None
    return times
