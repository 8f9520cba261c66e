"""The arguments of :mod:`kalmanscan.xr`'s functions: the observations DataArray checked, and the
keywords split into parameter DataArrays and plain values.

A parameter (``theta, sigma, obs_var, mean, h, init_mean, init_var``) is a scalar or a DataArray
aligned on ``da``'s non-time dims; one that has the time dimension is per step and must have
``da``'s number of steps (``init_mean`` and ``init_var``, the belief at the first time, never have
it). Any other keyword (``dt``, ``backend``, the fit's options) passes through as it is.
"""

from __future__ import annotations

import numpy as np
import xarray as xr

__all__ = ["check_dataarray", "split_params", "as_float"]

_PARAM_NAMES = ("theta", "sigma", "obs_var", "mean", "h", "init_mean", "init_var")
_STATIC_ONLY = ("init_mean", "init_var")


def check_dataarray(da: xr.DataArray, dim: str) -> None:
    """Raise ``ValueError`` unless ``da`` is a numeric (not boolean) DataArray with dimension ``dim``."""
    if not isinstance(da, xr.DataArray):
        raise ValueError(f"da must be an xarray.DataArray, got {type(da).__name__}")
    if dim not in da.dims:
        raise ValueError(f"dim {dim!r} is not a dimension of da (dims {da.dims})")
    if da.dtype.kind == "b":
        raise ValueError("da must be numeric observations, got a boolean DataArray (convert it with "
                         "da.astype(float) if 0/1 values are really meant)")
    if da.dtype.kind not in "iuf":
        raise ValueError(f"da must be numeric, got dtype {da.dtype}")


def split_params(da: xr.DataArray, dim: str, kwargs: dict) -> tuple[dict, dict]:
    """Split keyword arguments into ``(arrays, static)``: the DataArray parameters (checked as the
    module docstring says) and the plain values (scalar parameters and every other keyword)."""
    arrays, static = {}, {}
    for name, value in kwargs.items():
        if isinstance(value, xr.DataArray):
            if name not in _PARAM_NAMES:
                raise ValueError(f"{name} cannot be a DataArray (only {', '.join(_PARAM_NAMES)} can)")
            if name in _STATIC_ONLY and dim in value.dims:
                raise ValueError(f"{name} must not have the time dimension {dim!r} "
                                 "(it is the belief at the first time)")
            if dim in value.dims and value.sizes[dim] != da.sizes[dim]:
                raise ValueError(f"{name} has {value.sizes[dim]} steps along {dim!r}, da has {da.sizes[dim]}")
            arrays[name] = value
        elif name in _PARAM_NAMES and np.ndim(value) != 0:
            raise ValueError(f"{name} must be a scalar or an xarray.DataArray aligned on da's dims, "
                             f"got an array of shape {np.shape(value)}")
        else:
            static[name] = value
    return arrays, static


def as_float(da: xr.DataArray) -> xr.DataArray:
    """``da`` itself when it is floating point, else converted to float64."""
    return da if da.dtype.kind == "f" else da.astype(np.float64)
