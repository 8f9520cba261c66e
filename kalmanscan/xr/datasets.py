"""The Datasets :mod:`kalmanscan.xr` returns: their variables, in order, and their attrs.

``filter`` and ``smooth`` give ``mean, var, precision, lower, upper, loglik, logliks, pred_mean,
pred_var, pred_obs_mean, pred_obs_var`` (and the smoother's ``filtered_mean, filtered_var``), the
band ``lower, upper = mean -+ z sqrt(var)`` with ``z`` the normal quantile of the central
``level``; ``fit`` gives the parameters and their standard errors. Every variable carries a
``long_name`` (and ``units`` from ``da.attrs["units"]`` where it has the data's units or their
square), every coordinate ``da``'s attrs for it, and the Dataset ``da``'s attrs plus the call's.
"""

from __future__ import annotations

import numbers
from statistics import NormalDist

import numpy as np
import xarray as xr

from kalmanscan.xr.blocks import FIELD

__all__ = ["FILTER_FIELDS", "SMOOTH_FIELDS", "band_z", "variable_names", "in_da_order", "moments_dataset",
           "labelled", "label_fit"]

FILTER_FIELDS = ("mean", "var", "pred_mean", "pred_var", "pred_obs_mean", "pred_obs_var", "logliks")
SMOOTH_FIELDS = FILTER_FIELDS + ("filtered_mean", "filtered_var")
_DESCRIPTIONS = {
    "mean": "posterior mean of the state",
    "var": "posterior variance of the state",
    "precision": "posterior precision (1 / var)",
    "lower": "lower end of the central credible interval of the state",
    "upper": "upper end of the central credible interval of the state",
    "pred_mean": "one-step predicted mean of the state",
    "pred_var": "one-step predicted variance of the state",
    "pred_obs_mean": "one-step predictive mean of the observation",
    "pred_obs_var": "one-step predictive variance of the observation",
    "logliks": "log p(y_t | y_<t); 0 where y_t is missing",
    "loglik": "log-likelihood: sum of logliks over time",
    "filtered_mean": "filtered mean of the state (before smoothing)",
    "filtered_var": "filtered variance of the state (before smoothing)",
}
_FIT_DESCRIPTIONS = {
    "theta": "mean-reversion rate (per time unit)",
    "sigma": "diffusion scale (per square root of the time unit)",
    "obs_var": "observation noise variance",
    "mean": "mean level of the OU prior",
    "init_mean": "mean of the belief at the first time",
    "init_var": "variance of the belief at the first time",
    "loglik": "log-likelihood at the optimum",
    "n_obs": "number of observed (non-NaN) values",
    "converged": "whether the optimiser converged (and every series had enough observations)",
    "fitted": "whether the series had at least as many observations as estimated parameters",
    "n_iter": "optimiser iterations",
}
_FIT_SUFFIXES = {"_stderr": " (standard error)",
                 "_on_boundary": " (on its lower boundary 0 at the optimum: no standard error)"}


def band_z(level: float) -> float:
    """The normal quantile ``z`` of the central credible band of probability ``level`` in (0, 1)."""
    if not (isinstance(level, numbers.Real) and 0 < level < 1):
        raise ValueError(f"level must be a probability in (0, 1), got {level!r}")
    return NormalDist().inv_cdf(0.5 + level / 2)


def variable_names(fields: tuple) -> list[str]:
    """The output's variables in order, for the filter's ``fields``."""
    return ["mean", "var", "precision", "lower", "upper", "loglik", "logliks", "pred_mean", "pred_var",
            "pred_obs_mean", "pred_obs_var", *[f for f in fields if f.startswith("filtered_")]]


def in_da_order(x: xr.DataArray, da: xr.DataArray) -> xr.DataArray:
    """``x`` with the dims ``da`` lacks first, then ``da``'s dims in ``da``'s order."""
    extra = [d for d in x.dims if d not in da.dims]
    return x.transpose(*extra, *[d for d in da.dims if d in x.dims])


def moments_dataset(stacked: xr.DataArray, fields: tuple, da: xr.DataArray, dim: str, op_name: str,
                    unit_label: str, level: float, z: float) -> xr.Dataset:
    """The output Dataset from the stacked fields ``(..., dim, field)`` (derived bands added)."""
    data = {f: in_da_order(stacked.isel({FIELD: i}), da) for i, f in enumerate(fields)}
    std = np.sqrt(data["var"])
    data["precision"] = 1.0 / data["var"]
    data["lower"] = data["mean"] - z * std
    data["upper"] = data["mean"] + z * std
    data["loglik"] = data["logliks"].sum(dim, dtype=np.float64).astype(data["logliks"].dtype)  # as ks.filter
    ds = xr.Dataset({k: data[k] for k in variable_names(fields)})
    return labelled(ds, da, op_name, unit_label, level, z)


def labelled(ds: xr.Dataset, da: xr.DataArray, op_name: str, unit_label: str, level: float,
             z: float) -> xr.Dataset:
    """``ds`` with the variables' and coordinates' attrs and ``da``'s attrs plus the call's."""
    _describe(ds, da)
    ds.attrs = {**da.attrs, "kalmanscan": op_name, "time_unit": unit_label, "level": float(level),
                "z": float(z)}
    return ds


def label_fit(ds: xr.Dataset, da: xr.DataArray) -> None:
    """Give a fit result's variables their ``long_name`` (``<name>_stderr`` and ``<name>_on_boundary``
    that of ``<name>`` with a note) and units, its coordinates ``da``'s attrs; in place."""
    _describe(ds, da)
    for name, var in ds.data_vars.items():
        base, what = next(((name[:-len(end)], note) for end, note in _FIT_SUFFIXES.items() if name.endswith(end)),
                          (name, ""))
        var.attrs["long_name"] = _FIT_DESCRIPTIONS[base] + what


def _describe(ds, da):
    units = da.attrs.get("units")
    for name, var in ds.data_vars.items():
        var.attrs = {"long_name": _DESCRIPTIONS.get(name, name)}
        if units is not None and name in ("mean", "lower", "upper", "pred_mean", "pred_obs_mean", "filtered_mean",
                                          "init_mean"):
            var.attrs["units"] = units
        elif units is not None and name in ("var", "pred_var", "pred_obs_var", "filtered_var", "obs_var", "init_var"):
            var.attrs["units"] = f"({units})^2"
    for name, coord in da.coords.items():
        if name in ds.coords:
            ds.coords[name].attrs = dict(coord.attrs)
