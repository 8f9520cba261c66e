"""A command's inputs: the series read from its file, and the model's parameters from flags, a
parameter file (``--params``) or a fit run first (``--fit``).

The series is a DataArray over the time dimension and the channel dims, seen by the NumPy API as
``y (T, C)`` (the non-time dims flattened in order, the last fastest) with the model's ``times``;
a parameter is one value, or one per channel (a flag's comma-separated values in the order of the
channel labels, or a DataArray over the channel dims or matched to the channels by label).
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

import numpy as np

from kalmanscan.cli.report import MAX_ROWS, print_fit

if TYPE_CHECKING:
    import xarray as xr

__all__ = ["MODEL_FLAGS", "InputSeries", "flag_params", "fit_dataset", "model", "model_params"]

MODEL_FLAGS = ("theta", "sigma", "obs_var", "mean", "init_mean", "init_var")


class InputSeries:
    """The input series as a DataArray plus its NumPy view ``y (T, C)`` and model ``times``."""

    def __init__(self, args: argparse.Namespace, lazy: bool = False):
        import kalmanscan as ks
        from kalmanscan.cli import io

        columns = None if args.columns is None else [c.strip() for c in args.columns.split(",")]
        self.da = io.read_series(args.input, time_col=args.time_col, columns=columns, var=args.var, dim=args.dim)
        self.dim = args.dim
        coord = self.da[self.dim].values if self.dim in self.da.coords else None
        if coord is not None and coord.dtype.kind in "mM" and args.time_unit is None and args.dt is None:
            raise ValueError(f"the times in '{args.input}' are dates; give --time-unit (for example 1D, 1h or 30s): "
                             "theta is then per that unit")
        self.time_unit = None if args.dt is not None else args.time_unit
        self.dt = args.dt
        self.y, self.times = (None, None) if lazy else ks.xr.to_numpy(self.source(), self.dim,
                                                                       time_unit=self.time_unit)
        self.labels = io.channel_labels(self.da, self.dim)
        self.datetime = coord is not None and coord.dtype.kind in "mM" and args.dt is None

    def source(self) -> xr.DataArray:
        """The DataArray the model sees: without its time coordinate under ``--dt`` (regular steps)."""
        return self.da.drop_vars(self.dim) if self.dt is not None and self.dim in self.da.coords else self.da

    def steps(self) -> dict:
        """``times=`` or ``dt=`` keywords for the NumPy API."""
        return {"times": self.times} if self.times is not None else {"dt": self.dt if self.dt is not None else 1.0}

    def plot_times(self) -> np.ndarray:
        """The x values of the plots: the dates themselves for a date coordinate (a date axis)."""
        if self._dates():
            return self.da[self.dim].values
        if self.times is not None:
            return self.times
        return np.arange(self.y.shape[0]) * (self.dt if self.dt is not None else 1.0)

    def _dates(self) -> bool:
        return self.datetime and self.da[self.dim].dtype.kind == "M"

    def time_label(self) -> str:
        """The label of the plots' time axis: ``date``, ``time (<time unit>)`` or ``time``."""
        if self._dates():
            return "date"
        return f"time ({self.time_unit})" if self.datetime else "time"

    def flat(self, name: str, value: object) -> object:
        """A parameter (scalar or DataArray over the non-time dims) as a scalar or ``(C,)`` array."""
        import xarray as xr

        if not isinstance(value, xr.DataArray):
            return value
        template = self.da.isel({self.dim: 0}, drop=True)
        extra = [d for d in value.dims if d not in template.dims]
        if extra and value.ndim == 1 and template.ndim <= 1:
            return self._by_label(name, value)
        if extra:
            raise ValueError(f"parameter '{name}' has dimensions {extra} that the input does not have")
        try:
            value = value.sel({d: template[d].values for d in value.dims if d in template.coords})
        except KeyError:
            raise ValueError(f"parameter '{name}' is not given for every channel of the input "
                             f"({', '.join(self.labels[:MAX_ROWS])})") from None
        return value.broadcast_like(template).transpose(*template.dims).values.reshape(-1)

    def _by_label(self, name, value):
        """A parameter over one dimension matched to the input's channels by label (for a 1-D input,
        or channels under another dimension name)."""
        d = value.dims[0]
        given = [str(v) for v in (value[d].values if d in value.coords else range(value.sizes[d]))]
        absent = [lab for lab in self.labels if lab not in given]
        if absent:
            raise ValueError(f"parameter '{name}' is given for {d} {', '.join(given[:MAX_ROWS])}, not for "
                             f"{', '.join(absent[:MAX_ROWS])} of the input")
        return value.values[[given.index(lab) for lab in self.labels]]


def flag_params(args: argparse.Namespace, data: InputSeries) -> dict:
    """Model parameters given as flags: one value, or one per channel in the order of ``data.labels``
    (the non-time dims flattened in order, the last fastest), as a DataArray over those dims."""
    import xarray as xr

    other = [d for d in data.da.dims if d != data.dim]
    shape = [data.da.sizes[d] for d in other]
    coords = {d: data.da[d].values for d in other if d in data.da.coords}
    out = {}
    for name in MODEL_FLAGS:
        values = getattr(args, name)
        if values is None:
            continue
        if len(values) == 1:
            out[name] = values[0]
        elif other and len(values) == len(data.labels):
            out[name] = xr.DataArray(np.reshape(values, shape), dims=other, coords=coords)
        else:
            raise ValueError(f"--{name.replace('_', '-')} has {len(values)} values; give one, or one per channel "
                             f"({len(data.labels)}: {', '.join(data.labels[:MAX_ROWS])})")
    return out


def _estimate(args):
    return tuple(s.strip() for s in args.estimate.split(",") if s.strip())


def fit_dataset(args: argparse.Namespace, data: InputSeries, flags: dict) -> xr.Dataset:
    """``ks.xr.fit`` of the series with the fit's flags (``--estimate``, ``--shared``, ...) and the
    model ``flags`` as initial guesses or fixed values; the channel labels go into its attrs."""
    import kalmanscan as ks
    from kalmanscan.cli import io

    kw = dict(estimate=_estimate(args), backend=args.backend, progress=getattr(args, "progress", None))
    for name in ("shared", "method", "max_iter", "tol"):
        if getattr(args, name, None) is not None:
            kw[name] = getattr(args, name)
    if data.dt is not None:
        kw["dt"] = data.dt
    if "obs_var" in kw["estimate"]:
        _check_constant(data, len(kw["estimate"]), bool(kw.get("shared")))
    ds = ks.xr.fit(data.source(), data.dim, time_unit=data.time_unit, **flags, **kw)
    ds.attrs[io.CHANNELS_ATTR] = json.dumps(data.labels)
    return ds


def _check_constant(data, n_params, shared):
    """Name a constant channel (its obs_var has no maximum-likelihood estimate) before ks.fit does."""
    seen = ~np.isnan(data.y)
    lo = np.where(seen, data.y, np.inf).min(0)
    hi = np.where(seen, data.y, -np.inf).max(0)
    const = (lo == hi) & (seen.sum(0) >= n_params)
    if shared and not np.all(const | ~seen.any(0)):
        return
    for c in np.flatnonzero(const):
        every = ", as is every channel" if shared else ""
        raise ValueError(f"channel '{data.labels[c]}' is constant (every observed value is {lo[c]:g}){every}: "
                         "obs_var has no maximum-likelihood estimate (it goes to 0); leave the channel out "
                         "(--columns) or give --obs-var and leave obs_var out of --estimate")


def model(args: argparse.Namespace, data: InputSeries) -> dict:
    """NumPy keywords of the model (``theta, sigma, obs_var, ...``) from flags, --params or --fit."""
    return {k: data.flat(k, v) for k, v in model_params(args, data).items()}


def model_params(args: argparse.Namespace, data: InputSeries) -> dict:
    """The model's keywords for ``ks.xr`` (scalars or DataArrays over the non-time dims) from
    flags, --params or --fit."""
    import kalmanscan as ks
    from kalmanscan.cli import io

    flags = flag_params(args, data)
    if args.fit:
        if args.params:
            raise ValueError("--fit and --params exclude each other")
        ds = fit_dataset(args, data, flags)
        print_fit(ds, data, heading="fitted model")
        params = ks.xr.params(ds)
    elif args.params:
        params = {**io.read_params(args.params, data.da, data.dim), **flags}
    else:
        params = flags
    unit = params.pop("time_unit", None)
    if unit is not None and data.time_unit is not None and \
            ks.xr.parse_time_unit(unit) != ks.xr.parse_time_unit(data.time_unit):
        raise ValueError(f"the parameters were fitted with time unit {unit} (theta and sigma are per {unit}), "
                         f"but --time-unit is {data.time_unit}; give --time-unit {unit}")
    missing = [f"--{k.replace('_', '-')}" for k in ("theta", "sigma", "obs_var") if k not in params]
    if missing:
        raise ValueError(f"the model needs {', '.join(missing)} (or --params FILE from 'kalmanscan fit', or --fit)")
    return params
