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

Importing this module registers the ``.kalman`` accessor on ``xarray.DataArray``; it imports only
NumPy and xarray at module level.
"""

from __future__ import annotations

import math
import numbers
from statistics import NormalDist
from typing import TYPE_CHECKING, Any


import numpy as np
import xarray as xr

from kalmanscan.xr.layout import derive, field_of, in_memory, layout, moments
from kalmanscan.xr.times import TimeUnit, regular_steps, time_steps, parse_time_unit, times_from_coord

if TYPE_CHECKING:
    from kalmanscan.inference.posterior import Posterior



__all__ = ["filter", "smooth", "fit", "params", "to_numpy", "to_dataset", "KalmanAccessor", "times_from_coord",
           "parse_time_unit"]

_FIELD = "kalmanscan_field"
_PARAM_NAMES = ("theta", "sigma", "obs_var", "mean", "h", "init_mean", "init_var")
_STATIC_ONLY = ("init_mean", "init_var")
_FILTER_FIELDS = ("mean", "var", "pred_mean", "pred_var", "pred_obs_mean", "pred_obs_var", "logliks")
_SMOOTH_FIELDS = _FILTER_FIELDS + ("filtered_mean", "filtered_var")
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


def _public(name):
    """The public function ``kalmanscan.<name>`` (``filter``, ``smooth`` or ``fit``), imported from
    its module on first use, keeping this module light."""
    from kalmanscan.estimation.fitting import fit
    from kalmanscan.inference.filtering import filter
    from kalmanscan.inference.smoothing import smooth

    return dict(filter=filter, smooth=smooth, fit=fit)[name]


def _check_dataarray(da, dim):
    if not isinstance(da, xr.DataArray):
        raise ValueError(f"da must be an xarray.DataArray, got {type(da).__name__}")
    if dim not in da.dims:
        raise ValueError(f"dim {dim!r} is not a dimension of da (dims {da.dims})")
    if da.dtype.kind == "b":
        raise ValueError("da must be numeric observations, got a boolean DataArray (convert it with "
                         "da.astype(float) if 0/1 values are really meant)")
    if da.dtype.kind not in "iuf":
        raise ValueError(f"da must be numeric, got dtype {da.dtype}")


def _split_params(da, dim, kwargs):
    """Split keyword arguments into DataArray parameters (with a per-step flag) and plain ones."""
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


def _one_time_chunk(x, dim):
    if isinstance(x, xr.DataArray) and x.chunks is not None and dim in x.dims and len(x.chunksizes[dim]) > 1:
        return x.chunk({dim: -1})
    return x


def _as_float(da):
    return da if da.dtype.kind == "f" else da.astype(np.float64)


def _flatten(y, arrays, per_step):
    """Broadcast batch dimensions and flatten them into channels: ``y (..., T) -> (T, n)``."""
    T = y.shape[-1]
    batch = np.broadcast_shapes(y.shape[:-1], *(a.shape[:-1] if s else a.shape for a, s in zip(arrays, per_step)))
    n = math.prod(batch)
    flat_y = np.broadcast_to(y, batch + (T,)).reshape(n, T).T
    flat = [np.broadcast_to(a, batch + (T,)).reshape(n, T).T if s else np.broadcast_to(a, batch).reshape(n)
            for a, s in zip(arrays, per_step)]
    return flat_y, flat, batch


def _post_fields(post, fields, batch):
    """Stack the named posterior arrays ``(T, n)`` into ``batch + (T, len(fields))``."""
    T, n = post.mean.shape
    out = np.full(batch + (T, len(fields)), np.nan, dtype=post.mean.dtype)
    for i, f in enumerate(fields):
        value = field_of(post, f)
        out[..., i] = np.broadcast_to(value, (T, n)).T.reshape(batch + (T,))
    return out


def _moments_block(y, *arrays, names, per_step, op, fields, times, static):
    """Run ``op`` (filter or smooth) on one block; ``y (..., T)`` -> ``(..., T, len(fields))``."""
    flat_y, flat, batch = _flatten(y, arrays, per_step)
    T, n = flat_y.shape
    if n == 0 or T == 0:
        return np.empty(batch + (T, len(fields)), dtype=y.dtype)
    post = op(np.ascontiguousarray(flat_y), times=times, **dict(zip(names, flat)), **static)
    return _post_fields(post, fields, batch)


def _z(level):
    if not (isinstance(level, numbers.Real) and 0 < level < 1):
        raise ValueError(f"level must be a probability in (0, 1), got {level!r}")
    return NormalDist().inv_cdf(0.5 + level / 2)


def _apply(da, dim, arrays, block, nfields, core_of, dtype):
    """``apply_ufunc`` over ``da`` and the DataArray parameters; output ``(..., *core_of)``."""
    names = list(arrays)
    inputs = [_one_time_chunk(da, dim)] + [_one_time_chunk(arrays[k], dim) for k in names]
    core = [[dim]] + [[dim] if dim in arrays[k].dims else [] for k in names]
    return xr.apply_ufunc(
        block, *inputs,
        input_core_dims=core,
        output_core_dims=[core_of],
        kwargs=dict(names=names, per_step=[bool(c) for c in core[1:]]),
        dask="parallelized",
        output_dtypes=[dtype],
        dask_gufunc_kwargs={"output_sizes": {_FIELD: nfields}},
        keep_attrs=False,
    )


def _order(x, da):
    extra = [d for d in x.dims if d not in da.dims]
    return x.transpose(*extra, *[d for d in da.dims if d in x.dims])


def _moments(op_name, da, dim, time_unit, level, kwargs):
    _check_dataarray(da, dim)
    z = _z(level)
    times, unit_label = time_steps(da, dim, time_unit, kwargs)
    arrays, static = _split_params(da, dim, kwargs)
    times = regular_steps(times, static)
    op = _public(op_name)
    fields = _FILTER_FIELDS if op_name == "filter" else _SMOOTH_FIELDS

    def kalman_block(y, *blocks, names, per_step):
        return _moments_block(y, *blocks, names=names, per_step=per_step, op=op, fields=fields,
                              times=times, static=static)

    da = _as_float(da)
    if in_memory(da, arrays):
        lay = layout(da, dim, arrays, times)
        run = {**static, "outputs": fields} if op_name == "filter" else static  # the loops write only these
        data = moments(op, lay, fields, times, run, z)
        no_time = tuple(d for d in lay.dims if d != dim)
        ds = xr.Dataset({k: (no_time if k == "loglik" else lay.dims, data[k]) for k in _names(fields)},
                        coords=lay.coords)
        return _labelled(ds, da, op_name, unit_label, level, z)
    if any(_time_chunks(x, dim) > 1 for x in (da, *arrays.values())):
        stacked = _time_chunked(op_name, da, dim, arrays, times, static, fields)
    else:
        stacked = _apply(da, dim, arrays, kalman_block, len(fields), [dim, _FIELD], da.dtype)
    return _moments_dataset(stacked, fields, da, dim, op_name, unit_label, level, z)


def _time_chunks(x, dim) -> int:
    """How many dask chunks ``x`` has along ``dim`` (1 in memory or without ``dim``)."""
    return len(x.chunksizes[dim]) if x.chunks is not None and dim in x.dims else 1


def _time_chunked(op_name, da, dim, arrays, times, static, fields):
    """The stacked fields ``(..., dim, field)`` of ``da`` chunked along ``dim``, chunk by chunk
    (:mod:`kalmanscan.xr.timechunks`, imported here: it needs dask and torch): ``da``'s chunks are
    kept, the parameters take them."""
    from kalmanscan.xr import timechunks

    if da.chunks is None:
        da = da.chunk()
    batch_dims = [d for d in da.dims if d != dim]
    y = da.transpose(*batch_dims, dim)
    chunks = dict(zip(y.dims, y.chunks))
    params = {}
    for name, value in arrays.items():
        if dim in value.dims:
            value = value.broadcast_like(y).transpose(*batch_dims, dim)
        else:
            value = value.broadcast_like(y.isel({dim: 0}, drop=True)).transpose(*batch_dims)
        value = _as_float(value).chunk({d: chunks[d] for d in value.dims})
        params[name] = (value.data, dim in value.dims)
    data = timechunks.moments(op_name, y.data, params, times, static, fields)
    coords = {k: v for k, v in y.coords.items() if set(v.dims) <= set(y.dims)}
    return xr.DataArray(data, dims=(*batch_dims, dim, _FIELD), coords=coords)


def _time_chunked_inputs(da, dim, arrays):
    """``da`` as ``(..., dim)`` dask-backed, and the parameters for :func:`kalmanscan.fit` of its
    flattened series: per step ones ``(T, n)`` dask arrays, static ones ``(n,)`` NumPy arrays."""
    if da.chunks is None:
        da = da.chunk()
    batch_dims = [d for d in da.dims if d != dim]
    y = da.transpose(*batch_dims, dim)
    params = {}
    for name, value in arrays.items():
        if dim in value.dims:
            params[name] = _flat_time_last(_as_float(value).broadcast_like(y).transpose(*batch_dims, dim).chunk())
        else:
            params[name] = _as_float(value).broadcast_like(y.isel({dim: 0}, drop=True)).transpose(
                *batch_dims).values.reshape(-1)
    return y, params


def _flat_time_last(x):
    """A dask-backed ``(..., T)`` DataArray as the dask array ``(T, n)`` (series flattened)."""
    return x.data.reshape(-1, x.shape[-1]).T


def _names(fields):
    """The output's variables in order, for the filter's ``fields``."""
    return ["mean", "var", "precision", "lower", "upper", "loglik", "logliks", "pred_mean", "pred_var",
            "pred_obs_mean", "pred_obs_var", *[f for f in fields if f.startswith("filtered_")]]


def _moments_dataset(stacked, fields, da, dim, op_name, unit_label, level, z):
    """The output Dataset from the stacked fields ``(..., dim, field)`` (derived bands added)."""
    data = {f: _order(stacked.isel({_FIELD: i}), da) for i, f in enumerate(fields)}
    std = np.sqrt(data["var"])
    data["precision"] = 1.0 / data["var"]
    data["lower"] = data["mean"] - z * std
    data["upper"] = data["mean"] + z * std
    data["loglik"] = data["logliks"].sum(dim, dtype=np.float64).astype(data["logliks"].dtype)  # as ks.filter
    ds = xr.Dataset({k: data[k] for k in _names(fields)})
    return _labelled(ds, da, op_name, unit_label, level, z)


def _labelled(ds, da, op_name, unit_label, level, z):
    """``ds`` with the variables' and coordinates' attrs (:func:`_describe`) and ``da``'s attrs plus the call's."""
    _describe(ds, da)
    ds.attrs = {**da.attrs, "kalmanscan": op_name, "time_unit": unit_label, "level": float(level),
                "z": float(z)}
    return ds


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


def to_numpy(da: xr.DataArray, dim: str = "time", *,
             time_unit: TimeUnit | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(y, times)`` for the NumPy API: ``y`` of shape ``(T, C)`` (the non-time dimensions of ``da``
    flattened in order into ``C`` channels, float) and ``times`` ``(T,)`` float64 from the coordinate
    along ``dim`` (``None`` without one); the inverse of :func:`to_dataset`. Loads dask data."""
    _check_dataarray(da, dim)
    times, _ = time_steps(da, dim, time_unit, {})
    other = [d for d in da.dims if d != dim]
    y = _as_float(da).transpose(*other, dim).values
    return y.reshape(-1, y.shape[-1]).T.copy(), times


def to_dataset(post: Posterior, da: xr.DataArray, dim: str = "time", *, time_unit: TimeUnit | None = None,
               level: float = 0.95) -> xr.Dataset:
    """The Dataset :func:`filter` (or :func:`smooth`) returns, from a NumPy :class:`~kalmanscan.Posterior`
    computed on ``to_numpy(da, dim)``: its ``(T, C)`` arrays are unflattened onto ``da``'s dims."""
    _check_dataarray(da, dim)
    z = _z(level)
    _, unit_label = time_steps(da, dim, time_unit, {})
    post = post.to_numpy()
    other = [d for d in da.dims if d != dim]
    batch = tuple(da.sizes[d] for d in other)
    if post.mean.shape != (da.sizes[dim], math.prod(batch)):
        raise ValueError(f"post has shape {post.mean.shape}, expected (T, C) = {(da.sizes[dim], math.prod(batch))} "
                         f"from da flattened by to_numpy")
    smoothed = post.filtered is not None
    fields = _SMOOTH_FIELDS if smoothed else _FILTER_FIELDS
    shape = post.mean.shape
    order = (dim, *other)
    perm = tuple(order.index(d) for d in da.dims)
    data = {f: np.ascontiguousarray(np.broadcast_to(field_of(post, f), shape)).reshape(shape[:1] + batch)
            .transpose(perm) for f in fields}
    data = derive(data, da.dims.index(dim), z)
    ds = xr.Dataset({k: (tuple(other) if k == "loglik" else da.dims, data[k]) for k in _names(fields)},
                    coords=da.coords)
    return _labelled(ds, da, "smooth" if smoothed else "filter", unit_label, level, z)


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
FIT_NAMES = ("theta", "sigma", "obs_var", "mean", "init_mean", "init_var")
_FIT_SUFFIXES = {"_stderr": " (standard error)",
                 "_on_boundary": " (on its lower boundary 0 at the optimum: no standard error)"}


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
    _check_dataarray(da, dim)
    times, unit_label = time_steps(da, dim, time_unit, fit_kwargs)
    arrays, static = _split_params(da, dim, fit_kwargs)
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
        flat_y, flat, batch = _flatten(y, blocks, per_step)
        if flat_y.size == 0:
            return np.full(batch + (len(fields),), np.nan)
        return columns(ks_fit(np.ascontiguousarray(flat_y), times=times, **dict(zip(names, flat)), **static), batch)

    da = _as_float(da)
    if any(_time_chunks(x, dim) > 1 for x in (da, *arrays.values())):  # one fit, one time chunk at a time
        y, params = _time_chunked_inputs(da, dim, arrays)
        res = ks_fit(_flat_time_last(y), times=times, **params, **static)
        coords = {k: v for k, v in y.coords.items() if dim not in v.dims}
        stacked = xr.DataArray(columns(res, y.shape[:-1]), dims=(*y.dims[:-1], _FIELD), coords=coords)
    else:
        if shared and da.chunks is not None:
            da = da.chunk({d: -1 for d in da.dims})
        stacked = _apply(da, dim, arrays, kalman_fit_block, len(fields), [_FIELD], np.float64)
    data = {f: _order(stacked.isel({_FIELD: i}), da) for i, f in enumerate(fields)}
    for k, dtype in (("n_obs", np.int64), ("fitted", bool), ("converged", bool), ("n_iter", np.int64),
                     *((b, bool) for b in bound)):
        data[k] = data[k].astype(dtype)
    if shared:
        for k in fields:
            if k not in ("loglik", "n_obs"):
                data[k] = data[k].isel({d: 0 for d in data[k].dims}).reset_coords(drop=True)
    ds = xr.Dataset(data)
    _describe(ds, da)
    for name, var in ds.data_vars.items():
        base, what = next(((name[:-len(end)], note) for end, note in _FIT_SUFFIXES.items() if name.endswith(end)),
                          (name, ""))
        var.attrs["long_name"] = _FIT_DESCRIPTIONS[base] + what
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
