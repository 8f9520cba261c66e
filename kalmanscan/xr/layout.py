"""The in-memory path of :mod:`kalmanscan.xr`: a NumPy-backed DataArray filtered in the filter's own
``(..., T, C)`` layout, with no apply_ufunc and, where the layout allows, nothing transposed in or out.

``da`` with dims ``(*before, dim, *after)`` is ``y`` of shape ``(*extra, *before, T, C)``: the dims
before ``dim`` stay batch dims, those after it are flattened into the channels ``C`` (a view of a
C-contiguous ``da``), and ``extra``, the dims of parameter DataArrays that ``da`` lacks, are leading
batch dims of size 1 that the parameters broadcast. Each parameter is laid out to match: static
``batch + (1, C)``, per step ``batch + (T, C)``, ``init_mean`` and ``init_var`` ``batch + (C,)``, and
``(C,)`` when it varies along ``after`` alone. The filter's fields reshape to ``(*extra, *da.dims)``,
the order of the dask path's output, and ``precision, lower, upper, loglik`` are computed by the
NumPy operations of the dask path, in its order: the same values, bit for bit.

The filter checks static parameters of shape ``(C,)`` on the host (float64, the smoother's decay and
noise too) and others with torch in the compute dtype, which can differ in the last bit. The dask
path flattens every dim but ``dim`` into channels, so its static parameters are ``(C,)``; where a
static parameter varies along a batch dim (and none is per step, the times regular), the batch dims
go into the channels as there (``y`` then a transposed copy, the fields transposed views).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass

import numpy as np
import xarray as xr

__all__ = ["in_memory", "Layout", "layout", "moments", "field_of", "derive"]

_STATIC_ONLY = ("init_mean", "init_var")


def in_memory(da: xr.DataArray, arrays: dict) -> bool:
    """Whether ``da`` and every parameter DataArray in ``arrays`` hold NumPy arrays (not dask)."""
    return all(isinstance(x.data, np.ndarray) for x in (da, *arrays.values()))


@dataclass
class Layout:
    """``da`` and its parameters in the filter's layout: ``y`` ``(*batch, T, C)`` and ``params``
    broadcasting against it; the output's ``dims`` ``(*extra, *da.dims)``, ``shape``, time ``axis``
    and ``coords`` (those of ``da`` and the parameters merged as ``xarray.apply_ufunc`` merges
    them); ``split``, the fields' shape ``(*batch, T, *channels)``, and ``perm``, its axes in the
    order of ``dims``."""

    y: np.ndarray
    params: dict
    dims: tuple
    shape: tuple
    axis: int
    coords: xr.Coordinates
    split: tuple
    perm: tuple

    def unflatten(self, x: np.ndarray) -> np.ndarray:
        """A field ``(*batch, T, C)`` with ``dims``: a view, transposed where the channels hold batch
        dims (a copy of a broadcast field)."""
        return np.ascontiguousarray(x).reshape(self.split).transpose(self.perm)


def layout(da: xr.DataArray, dim: str, arrays: dict, times: np.ndarray | None) -> Layout:
    """The :class:`Layout` of ``da`` (float, NumPy-backed) and the parameter DataArrays ``arrays``,
    aligned exactly (mismatched labels raise, as in the dask path), for irregular ``times`` or
    ``None``."""
    if arrays:
        aligned = xr.align(da, *arrays.values(), join="exact", copy=False)
        da, arrays = aligned[0], dict(zip(arrays, aligned[1:]))
        coords = xr.merge([x.coords.to_dataset() for x in aligned], compat="minimal", join="exact",
                          combine_attrs="drop").coords
    else:
        coords = da.coords
    extra = tuple(dict.fromkeys(d for a in arrays.values() for d in a.dims if d not in da.dims))
    sizes = {**{d: n for a in arrays.values() for d, n in a.sizes.items()}, **da.sizes}
    dims = extra + da.dims
    batch = dims[:dims.index(dim)]
    varies = {d for a in arrays.values() for d in a.dims}
    if times is None and dim not in varies and varies & set(batch):
        batch = ()
    channels = tuple(d for d in dims if d not in batch and d != dim)
    order = (*batch, dim, *channels)
    shape = tuple(sizes[d] for d in dims)
    y = _arrange(da, order, len(batch), sizes)
    params = {} if 0 in shape else {k: _param(k, a, order, len(batch), sizes) for k, a in arrays.items()}
    return Layout(y=y, params=params, dims=dims, shape=shape, axis=dims.index(dim), coords=coords,
                  split=tuple(sizes[d] for d in order), perm=tuple(order.index(d) for d in dims))


def _arrange(a: xr.DataArray, order: tuple, nbatch: int, sizes: dict) -> np.ndarray:
    """``a``'s values ``(*batch, T or 1, C or 1)`` for ``order`` ``(*batch, dim, *channels)``: 1
    along the batch dims and ``dim`` it lacks, its channel dims (broadcast to all where it has
    some) flattened (a view where the layout allows)."""
    x = a.transpose(*[d for d in order if d in a.dims]).data
    x = x.reshape(tuple(sizes[d] if d in a.dims else 1 for d in order))
    k = nbatch + 1
    if 0 < sum(d in a.dims for d in order[k:]) < len(order) - k:
        x = np.broadcast_to(x, x.shape[:k] + tuple(sizes[d] for d in order[k:]))
    return x.reshape(x.shape[:k] + (math.prod(x.shape[k:]),))


def _param(name: str, a: xr.DataArray, order: tuple, nbatch: int, sizes: dict) -> np.ndarray:
    """Parameter ``a`` for the filter: ``(C,)`` when static along the batch dims (as the dask path's
    flattened channels), else ``(*batch, T or 1, C or 1)``, ``(*batch, C or 1)`` for ``init_*``."""
    x = _arrange(a, order, nbatch, sizes)
    if not any(d in a.dims for d in order[:nbatch + 1]):
        return x.reshape(x.shape[-1:])
    return x[..., 0, :] if name in _STATIC_ONLY else x


def moments(op: Callable, lay: Layout, fields: tuple, times: np.ndarray | None, kwargs: dict, z: float) -> dict:
    """``op`` (filter or smooth) on ``lay``: ``{field: array of lay.shape}`` for ``fields`` and the
    derived ``precision, lower, upper`` (``1 / var``, ``mean -+ z sqrt(var)``) and ``loglik``, the
    sum of ``logliks`` over time (NaN as 0), shaped ``lay.shape`` without ``T``."""
    if 0 in lay.shape:
        data = {f: np.empty(lay.shape, lay.y.dtype) for f in fields}
    else:
        post = op(lay.y, times=times, **lay.params, **kwargs)
        data = {f: lay.unflatten(field_of(post, f)) for f in fields}
    return derive(data, lay.axis, z)


def field_of(post: Any, name: str) -> np.ndarray:
    """The posterior's field ``name`` (``filtered_<field>``: of its filtered posterior)."""
    return getattr(post.filtered, name[len("filtered_"):]) if name.startswith("filtered_") else getattr(post, name)


def derive(data: dict, axis: int, z: float) -> dict:
    """``data`` (the fields, time along ``axis``) with the derived ``precision, lower, upper``
    (``1 / var``, ``mean -+ z sqrt(var)``) and ``loglik``, the sum of ``logliks`` over time (NaN as
    0)."""
    var, mean = data["var"], data["mean"]
    band = np.sqrt(var)
    band *= z
    data["precision"] = 1.0 / var
    data["lower"] = mean - band
    data["upper"] = np.add(mean, band, out=band)
    data["loglik"] = _nansum_time(data["logliks"], axis)
    return data


def _nansum_time(x: np.ndarray, axis: int) -> np.ndarray:
    """``x`` summed over the time ``axis``, NaN as 0, accumulated in float64 and returned in
    ``x``'s dtype (as ``ks.filter`` sums ``loglik``), with time contiguous: NumPy's pairwise sum
    along time, as the dask path's xarray ``sum`` over its time-last fields (not the sequential
    sum NumPy makes over a non-contiguous axis). NaN is set to 0 only in the series whose sum is
    NaN (the others' sums are the same)."""
    t = np.moveaxis(x, axis, -1).copy()
    total = t.sum(-1, dtype=np.float64)
    bad = np.isnan(total)
    if bad.any():
        rows = t[bad]
        total[bad] = np.where(np.isnan(rows), 0, rows).sum(-1, dtype=np.float64)
    return total.astype(x.dtype, copy=False)
