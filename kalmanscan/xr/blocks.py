"""The dask paths of :mod:`kalmanscan.xr`: a DataArray's blocks as the arrays of the NumPy API.

One block (``xarray.apply_ufunc`` over a DataArray with one chunk along time): ``y (..., T)`` and
the block's parameters are broadcast and their batch dims flattened into channels, ``y (T, n)``;
the filter's (or smoother's) fields come back stacked as ``(..., T, len(fields))`` along the
:data:`FIELD` dimension. Chunked along time, every dim but time goes into the channels and
:mod:`kalmanscan.xr.timechunks` (imported when used: it needs dask and torch) passes beliefs
between the chunks; :func:`kalmanscan.fit` takes the flattened series as dask arrays ``(T, n)``
and holds one time chunk at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import xarray as xr

from kalmanscan.xr.arguments import as_float
from kalmanscan.xr.layout import field_of

__all__ = ["FIELD", "one_time_chunk", "flatten", "moments_block", "time_chunks", "time_chunked",
           "time_chunked_inputs", "flat_time_last"]

FIELD = "kalmanscan_field"


def one_time_chunk(x: xr.DataArray, dim: str) -> xr.DataArray:
    """``x`` rechunked to one chunk along ``dim`` when it is chunked along it, else as it is."""
    if isinstance(x, xr.DataArray) and x.chunks is not None and dim in x.dims and len(x.chunksizes[dim]) > 1:
        return x.chunk({dim: -1})
    return x


def flatten(y: np.ndarray, arrays: tuple, per_step: list) -> tuple[np.ndarray, list, tuple]:
    """Broadcast batch dimensions and flatten them into channels: ``y (..., T) -> (T, n)``; each
    array is ``(..., T) -> (T, n)`` when per step, else ``(...) -> (n,)``. Returns
    ``(flat_y, flat_arrays, batch)``."""
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


def moments_block(y: np.ndarray, *arrays: np.ndarray, names: list, per_step: list, op: Callable, fields: tuple,
                  times: np.ndarray | None, static: dict) -> np.ndarray:
    """Run ``op`` (filter or smooth) on one block; ``y (..., T)`` -> ``(..., T, len(fields))``."""
    flat_y, flat, batch = flatten(y, arrays, per_step)
    T, n = flat_y.shape
    if n == 0 or T == 0:
        return np.empty(batch + (T, len(fields)), dtype=y.dtype)
    post = op(np.ascontiguousarray(flat_y), times=times, **dict(zip(names, flat)), **static)
    return _post_fields(post, fields, batch)


def time_chunks(x: xr.DataArray, dim: str) -> int:
    """How many dask chunks ``x`` has along ``dim`` (1 in memory or without ``dim``)."""
    return len(x.chunksizes[dim]) if x.chunks is not None and dim in x.dims else 1


def time_chunked(op_name: str, da: xr.DataArray, dim: str, arrays: dict, times: np.ndarray | None, static: dict,
                 fields: tuple) -> xr.DataArray:
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
        value = as_float(value).chunk({d: chunks[d] for d in value.dims})
        params[name] = (value.data, dim in value.dims)
    data = timechunks.moments(op_name, y.data, params, times, static, fields)
    coords = {k: v for k, v in y.coords.items() if set(v.dims) <= set(y.dims)}
    return xr.DataArray(data, dims=(*batch_dims, dim, FIELD), coords=coords)


def time_chunked_inputs(da: xr.DataArray, dim: str, arrays: dict) -> tuple[xr.DataArray, dict]:
    """``da`` as ``(..., dim)`` dask-backed, and the parameters for :func:`kalmanscan.fit` of its
    flattened series: per step ones ``(T, n)`` dask arrays, static ones ``(n,)`` NumPy arrays."""
    if da.chunks is None:
        da = da.chunk()
    batch_dims = [d for d in da.dims if d != dim]
    y = da.transpose(*batch_dims, dim)
    params = {}
    for name, value in arrays.items():
        if dim in value.dims:
            params[name] = flat_time_last(as_float(value).broadcast_like(y).transpose(*batch_dims, dim).chunk())
        else:
            params[name] = as_float(value).broadcast_like(y.isel({dim: 0}, drop=True)).transpose(
                *batch_dims).values.reshape(-1)
    return y, params


def flat_time_last(x: xr.DataArray) -> object:
    """A dask-backed ``(..., T)`` DataArray as the dask array ``(T, n)`` (series flattened)."""
    return x.data.reshape(-1, x.shape[-1]).T
