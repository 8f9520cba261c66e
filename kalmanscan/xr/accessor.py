"""xarray front end: filter, smooth and fit labelled arrays, in memory or chunk by chunk with dask.

    import kalmanscan as ks
    ds = ks.xr.filter(da, dim="time", theta=0.1, sigma=1.0, obs_var=0.5)   # or da.kalman.filter(...)
    ds.mean, ds.lower, ds.upper, ds.loglik

Layout. ``da`` has the time dimension ``dim`` and any other dimensions; every position along the
other dimensions is an independent channel. In memory, the dimensions before ``dim`` are batch
dimensions of :func:`kalmanscan.filter`'s ``y`` ``(..., T, C)`` and those after it are flattened into
its channels ``C``: no copy of a C-contiguous ``da`` (:mod:`kalmanscan.xr.layout`, which says when all
go into ``C``). Chunk by chunk (dask), all of them are flattened into ``C`` (``y`` of shape
``(T, C)``). Results keep the input's dimension order, coordinates and attrs, and are the same
either way.

Time. A ``datetime64`` (or ``timedelta64``) coordinate along ``dim`` gives irregular steps
``times = (t - t_0) / time_unit``, with ``time_unit`` required (``"1D"``, ``"6h"``, ``"s"``, a
``numpy.timedelta64`` or ``datetime.timedelta``); the rates ``theta`` and ``sigma^2`` are then per
``time_unit``. A numeric coordinate is used as ``times`` as it is (already in model units). Without
a coordinate, or when ``dt=`` is passed explicitly, the steps are regular (``dt``, default 1).
``ds.attrs["time_unit"]`` records which unit was used.

Parameters (``theta, sigma, obs_var, mean, h, init_mean, init_var``) are scalars or DataArrays
aligned on the non-time dimensions (aligned exactly: mismatched labels raise); a parameter DataArray
that has ``dim`` is per step (``init_mean`` and ``init_var`` never are). Other keywords
(``backend``) pass through to :func:`kalmanscan.filter`.

Dask. A dask-backed ``da`` is processed chunk by chunk: nothing is loaded, the result is
dask-backed with ``da``'s chunks, and the same call runs on a ``dask.distributed`` cluster. With
one chunk along ``dim`` each block is filtered on its own (``xarray.apply_ufunc``); chunked along
``dim`` too, the chunks pass each other only beliefs (:mod:`kalmanscan.xr.timechunks`: memory per
task one block, exact to rounding), so a record longer than a worker's memory is filtered and
smoothed without a rechunk. ``fit`` of a DataArray chunked along ``dim`` is one
:func:`kalmanscan.fit` of all its series that holds one time chunk at a time
(:mod:`kalmanscan.estimation.chunked`); otherwise each chunk of series is fitted on its own.

This module holds the public functions and the accessor, each routing its call in memory, block
by block or chunk by chunk along time; the arguments are checked in :mod:`kalmanscan.xr.arguments`,
the dask blocks and time chunks prepared in :mod:`kalmanscan.xr.blocks`, and the output Datasets
named and labelled in :mod:`kalmanscan.xr.datasets`. Importing it registers the ``.kalman``
accessor on ``xarray.DataArray``; it imports only NumPy and xarray at module level.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import xarray as xr

from kalmanscan.xr.arguments import as_float, check_dataarray, split_params
from kalmanscan.xr.blocks import (FIELD, flat_time_last, flatten, moments_block, one_time_chunk, time_chunked,
                                  time_chunked_inputs, time_chunks)
from kalmanscan.xr.datasets import (FILTER_FIELDS, SMOOTH_FIELDS, band_z, in_da_order, label_fit, labelled,
                                    moments_dataset, variable_names)
from kalmanscan.xr.layout import derive, field_of, in_memory, layout, moments
from kalmanscan.xr.times import TimeUnit, parse_time_unit, regular_steps, time_steps, times_from_coord

if TYPE_CHECKING:
    from kalmanscan.inference.posterior import Posterior

__all__ = ["filter", "smooth", "fit", "params", "to_numpy", "to_dataset", "KalmanAccessor", "times_from_coord",
           "parse_time_unit"]


def _public(name):
    """The public function ``kalmanscan.<name>`` (``filter``, ``smooth`` or ``fit``), imported from
    its module on first use, keeping this module light."""
    from kalmanscan.estimation.fitting import fit
    from kalmanscan.inference.filtering import filter
    from kalmanscan.inference.smoothing import smooth

    return dict(filter=filter, smooth=smooth, fit=fit)[name]


def _apply(da, dim, arrays, block, nfields, core_of, dtype):
    """``apply_ufunc`` over ``da`` and the DataArray parameters; output ``(..., *core_of)``."""
    names = list(arrays)
    inputs = [one_time_chunk(da, dim)] + [one_time_chunk(arrays[k], dim) for k in names]
    core = [[dim]] + [[dim] if dim in arrays[k].dims else [] for k in names]
    return xr.apply_ufunc(
        block, *inputs,
        input_core_dims=core,
        output_core_dims=[core_of],
        kwargs=dict(names=names, per_step=[bool(c) for c in core[1:]]),
        dask="parallelized",
        output_dtypes=[dtype],
        dask_gufunc_kwargs={"output_sizes": {FIELD: nfields}},
        keep_attrs=False,
    )


def _moments(op_name, da, dim, time_unit, level, kwargs):
    check_dataarray(da, dim)
    z = band_z(level)
    times, unit_label = time_steps(da, dim, time_unit, kwargs)
    arrays, static = split_params(da, dim, kwargs)
    times = regular_steps(times, static)
    op = _public(op_name)
    fields = FILTER_FIELDS if op_name == "filter" else SMOOTH_FIELDS

    def kalman_block(y, *blocks, names, per_step):
        return moments_block(y, *blocks, names=names, per_step=per_step, op=op, fields=fields,
                             times=times, static=static)

    da = as_float(da)
    if in_memory(da, arrays):
        lay = layout(da, dim, arrays, times)
        run = {**static, "outputs": fields} if op_name == "filter" else static  # the loops write only these
        data = moments(op, lay, fields, times, run, z)
        no_time = tuple(d for d in lay.dims if d != dim)
        ds = xr.Dataset({k: (no_time if k == "loglik" else lay.dims, data[k]) for k in variable_names(fields)},
                        coords=lay.coords)
        return labelled(ds, da, op_name, unit_label, level, z)
    if any(time_chunks(x, dim) > 1 for x in (da, *arrays.values())):
        stacked = time_chunked(op_name, da, dim, arrays, times, static, fields)
    else:
        stacked = _apply(da, dim, arrays, kalman_block, len(fields), [dim, FIELD], da.dtype)
    return moments_dataset(stacked, fields, da, dim, op_name, unit_label, level, z)


def to_numpy(da: xr.DataArray, dim: str = "time", *,
             time_unit: TimeUnit | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(y, times)`` for the NumPy API: ``y`` of shape ``(T, C)`` (the non-time dimensions of ``da``
    flattened in order into ``C`` channels, float) and ``times`` ``(T,)`` float64 from the coordinate
    along ``dim`` (``None`` without one); the inverse of :func:`to_dataset`. Loads dask data."""
    check_dataarray(da, dim)
    times, _ = time_steps(da, dim, time_unit, {})
    other = [d for d in da.dims if d != dim]
    y = as_float(da).transpose(*other, dim).values
    return y.reshape(-1, y.shape[-1]).T.copy(), times


def to_dataset(post: Posterior, da: xr.DataArray, dim: str = "time", *, time_unit: TimeUnit | None = None,
               level: float = 0.95) -> xr.Dataset:
    """The Dataset :func:`filter` (or :func:`smooth`) returns, from a NumPy :class:`~kalmanscan.Posterior`
    computed on ``to_numpy(da, dim)``: its ``(T, C)`` arrays are unflattened onto ``da``'s dims."""
    check_dataarray(da, dim)
    z = band_z(level)
    _, unit_label = time_steps(da, dim, time_unit, {})
    post = post.to_numpy()
    other = [d for d in da.dims if d != dim]
    batch = tuple(da.sizes[d] for d in other)
    if post.mean.shape != (da.sizes[dim], math.prod(batch)):
        raise ValueError(f"post has shape {post.mean.shape}, expected (T, C) = {(da.sizes[dim], math.prod(batch))} "
                         f"from da flattened by to_numpy")
    smoothed = post.filtered is not None
    fields = SMOOTH_FIELDS if smoothed else FILTER_FIELDS
    shape = post.mean.shape
    order = (dim, *other)
    perm = tuple(order.index(d) for d in da.dims)
    data = {f: np.ascontiguousarray(np.broadcast_to(field_of(post, f), shape)).reshape(shape[:1] + batch)
            .transpose(perm) for f in fields}
    data = derive(data, da.dims.index(dim), z)
    ds = xr.Dataset({k: (tuple(other) if k == "loglik" else da.dims, data[k]) for k in variable_names(fields)},
                    coords=da.coords)
    return labelled(ds, da, "smooth" if smoothed else "filter", unit_label, level, z)


def filter(da: xr.DataArray, dim: str = "time", *, time_unit: TimeUnit | None = None, level: float = 0.95,
           **filter_kwargs: Any) -> xr.Dataset:
    """Filter every non-time position of ``da`` along ``dim``; returns an ``xarray.Dataset``.

    Args:
        da: DataArray with dimension ``dim`` and any others (each other position is a channel);
            NaN marks a missing value. Dask-backed arrays give dask-backed results.
        dim: the time dimension.
        time_unit: the unit of a datetime64 coordinate along ``dim`` (required for one, see the
            module docstring); must be ``None`` otherwise.
        level: probability of the central credible band ``lower, upper = mean -+ z sqrt(var)``.
        **filter_kwargs: ``theta, sigma, obs_var`` (required), ``mean, h, init_mean, init_var``
            (scalars or DataArrays), ``dt``, ``backend``, as :func:`kalmanscan.filter`.

    Returns:
        Dataset with ``mean, var, precision, lower, upper, logliks, pred_mean, pred_var,
        pred_obs_mean, pred_obs_var`` shaped like ``da`` (dimension order kept), ``loglik`` (the
        sum over time: ``da``'s dims without ``dim``), ``da``'s coordinates, and ``da``'s attrs
        plus ``time_unit``, ``level`` and ``z``.
    """
    return _moments("filter", da, dim, time_unit, level, filter_kwargs)


def smooth(da: xr.DataArray, dim: str = "time", *, time_unit: TimeUnit | None = None, level: float = 0.95,
           **filter_kwargs: Any) -> xr.Dataset:
    """As :func:`filter` with smoothed ``mean, var, precision, lower, upper``
    (:func:`kalmanscan.smooth`), plus the filter's ``filtered_mean`` and ``filtered_var``."""
    return _moments("smooth", da, dim, time_unit, level, filter_kwargs)


FIT_NAMES = ("theta", "sigma", "obs_var", "mean", "init_mean", "init_var")


def fit(da: xr.DataArray, dim: str = "time", *, time_unit: TimeUnit | None = None, **fit_kwargs: Any) -> xr.Dataset:
    """Maximum-likelihood parameters for every non-time position of ``da`` (:func:`kalmanscan.fit`).

    Args:
        da: DataArray with dimension ``dim`` and any others; NaN marks a missing value.
        dim, time_unit: as :func:`filter` (the fitted ``theta`` and ``sigma`` are per ``time_unit``;
            filter with the same ``time_unit``).
        **fit_kwargs: as :func:`kalmanscan.fit`: initial guesses or fixed values (scalars or
            DataArrays aligned on the non-time dims; fixed ones may be per step), ``estimate``,
            ``shared``, ``method``, ``max_iter``, ``tol``, ``progress``, ``dt``, ``h``, ``backend``.

    Returns:
        Dataset over ``da``'s non-time dims with the parameters (estimated and fixed static ones:
        ``theta, sigma, obs_var, mean`` and ``init_*`` when given or estimated), ``<name>_stderr``
        and ``<name>_on_boundary`` (the optimum on the lower boundary 0: no standard error) for each
        estimated name, ``loglik``, ``n_obs``, ``fitted`` (False for a series with fewer
        observations than estimated names: its parameters are the initial guess, its standard
        errors NaN), ``converged``, ``n_iter``; attrs ``da``'s plus ``time_unit``, ``estimate``,
        ``shared``, ``method``. ``ks.xr.params(result)`` gives the keywords to filter with (the
        time unit included). With ``shared=True`` the parameters (and their standard errors,
        ``fitted``, ``converged``, ``n_iter``) are scalars.

    Dask: with ``shared=False`` each chunk of the non-time dims is fitted on its own (channels are
    independent, so the estimates agree with one joint fit to the optimiser's tolerance) and the
    result is dask-backed; ``converged`` and ``n_iter`` then describe each channel's chunk.
    ``shared=True`` needs every channel in one fit, so the non-time dims are rechunked to one chunk.
    Chunked along ``dim`` (``da`` or a parameter), every series is fitted in one :func:`kalmanscan.fit`
    that holds one time chunk at a time (:mod:`kalmanscan.estimation.chunked`), run when called:
    the result is in memory.
    """
    check_dataarray(da, dim)
    times, unit_label = time_steps(da, dim, time_unit, fit_kwargs)
    arrays, static = split_params(da, dim, fit_kwargs)
    times = regular_steps(times, static)
    estimate = static.get("estimate", ("theta", "sigma", "obs_var"))
    estimate = (estimate,) if isinstance(estimate, str) else tuple(estimate)
    shared = bool(static.get("shared", False))
    given = {k for k in FIT_NAMES if (k in arrays and dim not in arrays[k].dims) or static.get(k) is not None}
    out_names = [k for k in FIT_NAMES if k in estimate or k in given or (k == "mean" and "mean" not in fit_kwargs)]
    stderr, bound = [f"{k}_stderr" for k in estimate], [f"{k}_on_boundary" for k in estimate]
    fields = out_names + stderr + bound + ["loglik", "n_obs", "fitted", "converged", "n_iter"]
    ks_fit = _public("fit")

    def columns(res, batch):
        cols = ([res.params[k] for k in out_names] + [res.stderr[k] for k in estimate]
                + [res.on_boundary[k] for k in estimate]
                + [res.loglik, res.n_obs, res.fitted, float(res.converged), float(res.n_iter)])
        n = math.prod(batch)
        return np.stack([np.broadcast_to(np.asarray(c, dtype=np.float64), (n,)) for c in cols], -1).reshape(
            batch + (len(fields),))

    def kalman_fit_block(y, *blocks, names, per_step):
        flat_y, flat, batch = flatten(y, blocks, per_step)
        if flat_y.size == 0:
            return np.full(batch + (len(fields),), np.nan)
        return columns(ks_fit(np.ascontiguousarray(flat_y), times=times, **dict(zip(names, flat)), **static), batch)

    da = as_float(da)
    if any(time_chunks(x, dim) > 1 for x in (da, *arrays.values())):  # one fit, one time chunk at a time
        y, params = time_chunked_inputs(da, dim, arrays)
        res = ks_fit(flat_time_last(y), times=times, **params, **static)
        coords = {k: v for k, v in y.coords.items() if dim not in v.dims}
        stacked = xr.DataArray(columns(res, y.shape[:-1]), dims=(*y.dims[:-1], FIELD), coords=coords)
    else:
        if shared and da.chunks is not None:
            da = da.chunk({d: -1 for d in da.dims})
        stacked = _apply(da, dim, arrays, kalman_fit_block, len(fields), [FIELD], np.float64)
    data = {f: in_da_order(stacked.isel({FIELD: i}), da) for i, f in enumerate(fields)}
    for k, dtype in (("n_obs", np.int64), ("fitted", bool), ("converged", bool), ("n_iter", np.int64),
                     *((b, bool) for b in bound)):
        data[k] = data[k].astype(dtype)
    if shared:
        for k in fields:
            if k not in ("loglik", "n_obs"):
                data[k] = data[k].isel({d: 0 for d in data[k].dims}).reset_coords(drop=True)
    ds = xr.Dataset(data)
    label_fit(ds, da)
    ds.attrs = {**da.attrs, "kalmanscan": "fit", "time_unit": unit_label, "estimate": ",".join(estimate),
                "shared": int(shared), "method": str(static.get("method", "lbfgs"))}
    return ds


_NO_UNIT = ("coordinate units", "steps of dt")


def params(fit_result: xr.Dataset) -> dict:
    """The model parameters in a :func:`fit` result, as keywords for :func:`filter` and :func:`smooth`.

    A fit on a datetime64 coordinate also gives ``time_unit`` (the unit ``theta`` and ``sigma`` are
    per), so ``ks.xr.filter(da, **ks.xr.params(fit_ds))`` works on the same coordinate; a fit on
    numeric times or regular steps gives none.
    """
    if not isinstance(fit_result, xr.Dataset) or fit_result.attrs.get("kalmanscan") != "fit":
        raise ValueError("fit_result must be the Dataset returned by kalmanscan.xr.fit")
    out = {k: fit_result[k] for k in FIT_NAMES if k in fit_result.data_vars}
    unit = fit_result.attrs.get("time_unit")
    if isinstance(unit, str) and unit not in _NO_UNIT:
        try:
            parse_time_unit(unit)
        except ValueError:  # not a duration (an attribute edited by hand): leave it to the caller
            return out
        out["time_unit"] = unit
    return out


@xr.register_dataarray_accessor("kalman")
class KalmanAccessor:
    """``da.kalman.filter(...)``, ``da.kalman.smooth(...)``, ``da.kalman.fit(...)``: the functions of
    :mod:`kalmanscan.xr` with ``da`` as their first argument."""

    def __init__(self, da: xr.DataArray):
        self._da = da

    def filter(self, dim: str = "time", **kwargs: Any) -> xr.Dataset:
        """:func:`kalmanscan.xr.filter` of this DataArray."""
        return filter(self._da, dim, **kwargs)

    def smooth(self, dim: str = "time", **kwargs: Any) -> xr.Dataset:
        """:func:`kalmanscan.xr.smooth` of this DataArray."""
        return smooth(self._da, dim, **kwargs)

    def fit(self, dim: str = "time", **kwargs: Any) -> xr.Dataset:
        """:func:`kalmanscan.xr.fit` of this DataArray."""
        return fit(self._da, dim, **kwargs)
