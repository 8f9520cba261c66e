"""Reading and writing the files of the ``kalmanscan`` command line: CSV tables, NetCDF and Zarr.

A CSV input has a header row, one time column (numeric, or ISO 8601 dates and times) and one
column per channel; empty cells, ``NA`` and ``NaN`` are missing values. It is read into a
DataArray of dims ``("time", "channel")`` whose ``channel`` coordinate holds the column names and
whose ``time`` coordinate holds the times (int64, float64 or datetime64). A NetCDF input names one data
variable (``var``) with a time dimension (``dim``) and any others; its coordinates and attrs are
kept. A Zarr store (a ``.zarr`` directory) is read as NetCDF is, but lazily: its chunks become the
input's dask chunks (along time too: :mod:`kalmanscan.xr.timechunks` filters such a record chunk by
chunk), and a Zarr output is written chunk by chunk with the same chunks, with a progress bar.
Every problem is a ``ValueError`` whose message names the file, the column and the line.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from pathlib import Path
from typing import Any


import numpy as np
import pandas as pd
import xarray as xr

__all__ = ["read_series", "read_params", "write_dataset", "check_output", "same_file", "file_format", "channel_labels",
           "MISSING", "CHANNELS_ATTR"]

MISSING = ("", "na", "nan", "n/a", "null", "none")
_CSV = (".csv", ".txt")
_NETCDF = (".nc", ".nc4", ".netcdf", ".cdf")
_ZARR = (".zarr",)


def file_format(path: str | os.PathLike, role: str = "input") -> str:
    """``"csv"``, ``"netcdf"`` or ``"zarr"`` from the suffix of ``path``; ``ValueError`` for
    anything else."""
    suffix = Path(path).suffix.lower()
    if suffix in _CSV:
        return "csv"
    if suffix in _NETCDF:
        return "netcdf"
    if suffix in _ZARR:
        return "zarr"
    raise ValueError(f"{role} file '{path}': cannot tell its format from the suffix {suffix!r} "
                     f"(use one of {', '.join(_CSV + _NETCDF + _ZARR)})")


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether paths ``a`` and ``b`` name the same file (the same path, or the same existing file)."""
    if os.path.abspath(a) == os.path.abspath(b):
        return True
    return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)


def check_output(path: str | os.PathLike, inputs: Iterable[str | os.PathLike], role: str = "input") -> None:
    """Refuse to write ``path`` when it is one of ``inputs`` (the same file under any name); the
    message calls that file the ``role`` file (``"input"``, ``"parameter"``)."""
    for src in inputs:
        if src is not None and same_file(path, src):
            raise ValueError(f"refusing to overwrite the {role} file '{src}' with output '{path}'; choose another name")


def _check_readable(path, role):
    """``ValueError`` unless ``path`` is an existing file (a directory is named as one), or an
    existing directory for a Zarr store."""
    if Path(path).suffix.lower() in _ZARR:
        if not os.path.isdir(path):
            raise ValueError(f"{role} store '{path}' does not exist (a Zarr store is a directory)")
        return
    if os.path.isdir(path):
        raise ValueError(f"{role} file '{path}' is a directory, not a file")
    if not os.path.isfile(path):
        raise ValueError(f"{role} file '{path}' does not exist")


def read_series(path: str | os.PathLike, *, time_col: str | None = None, columns: Sequence[str] | None = None,
                var: str | None = None, dim: str = "time") -> xr.DataArray:
    """The series in ``path`` (CSV, NetCDF or Zarr) as a DataArray with time dimension ``dim``.

    CSV: ``time_col`` (default: the first column) and ``columns`` (default: every other column).
    NetCDF and Zarr: the data variable ``var`` (default: the only one with dimension ``dim``); a
    Zarr store's variable stays lazy (dask, the store's chunks). Times must be strictly increasing;
    values numeric or missing.
    """
    _check_readable(path, "input")
    if file_format(path) == "csv":
        if var is not None:
            raise ValueError("--var applies to NetCDF input; a CSV file names its channels by column")
        return _read_csv(path, time_col, columns, dim)
    if time_col is not None or columns is not None:
        raise ValueError("--time-col and --columns apply to CSV input; for NetCDF and Zarr use --var and --dim")
    return _read_netcdf(path, var, dim)


def _read_table(path, role="input"):
    try:
        table = pd.read_csv(path, dtype=str, keep_default_na=False, skipinitialspace=True)
    except pd.errors.EmptyDataError:
        raise ValueError(f"{role} file '{path}' is empty") from None
    except (pd.errors.ParserError, UnicodeDecodeError) as err:
        raise ValueError(f"{role} file '{path}' is not a readable CSV table: {err}") from None
    if table.shape[0] == 0:
        raise ValueError(f"{role} file '{path}' has a header but no data rows")
    return table


def _numeric(path, name, text, role="input", finite=True):
    """Column values as float64, NaN for missing markers; ``ValueError`` at the first bad cell
    (a non-number, or with ``finite`` an infinity: data must be finite, while a parameter file
    may hold ``inf``, as ``init_var = inf``, the diffuse prior). ``role`` names the file in messages."""
    raw = text.str.strip()
    missing = raw.str.lower().isin(MISSING)
    values = pd.to_numeric(raw.where(~missing, "nan"), errors="coerce").to_numpy(np.float64)
    bad = np.flatnonzero(np.isnan(values) & ~missing.to_numpy())
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{role} file '{path}': column '{name}' has a non-numeric value {raw.iloc[i]!r} "
                         f"at line {i + 2}" + (f" (and {bad.size - 1} more)" if bad.size > 1 else ""))
    inf = np.flatnonzero(np.isinf(values))
    if finite and inf.size:
        raise ValueError(f"{role} file '{path}': column '{name}' has an infinite value at line {int(inf[0]) + 2}")
    return _exactly(raw, values, ~missing.to_numpy())


def _exactly(raw, values, cells):
    """``values`` with its ``cells`` parsed from ``raw``'s text by NumPy (correctly rounded: the
    nearest float64, so a number written as its shortest repr reads back to the same bits; pandas'
    own parser, used to find the bad cells, can be an ulp off)."""
    values = np.array(values, np.float64)
    values[cells] = raw.to_numpy()[cells].astype(np.float64)
    return values


def _times(path, name, text):
    """The time column as int64 (integers), float64 (other numbers) or datetime64[ns] (ISO 8601;
    time zones -> UTC)."""
    raw = text.str.strip()
    empty = np.flatnonzero(raw.str.lower().isin(MISSING).to_numpy())
    if empty.size:
        raise ValueError(f"input file '{path}': time column '{name}' is empty at line {int(empty[0]) + 2}")
    numeric = pd.to_numeric(raw, errors="coerce")
    if not np.isnan(numeric.iloc[0]):
        values = numeric.to_numpy(np.float64)
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"input file '{path}': time column '{name}' has {raw.iloc[i]!r} at line {i + 2}; "
                             "times are numbers (or ISO 8601 dates throughout)")
        if numeric.dtype.kind in "iu":  # integer times (years) stay integers, in the output files too
            return numeric.to_numpy(np.int64)
        return _exactly(raw, values, np.ones(values.shape, bool))
    parsed = pd.to_datetime(raw, format="ISO8601", errors="coerce", utc=True)
    bad = np.flatnonzero(parsed.isna().to_numpy())
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"input file '{path}': time column '{name}' has {raw.iloc[i]!r} at line {i + 2}, "
                         "which is neither a number nor an ISO 8601 date/time")
    return parsed.dt.tz_localize(None).to_numpy().astype("datetime64[ns]")


def _check_sorted(path, name, times, raw):
    step = np.diff(times)
    bad = np.flatnonzero(step <= step.dtype.type(0))
    if bad.size:
        i = int(bad[0])
        how = "repeats" if times[i + 1] == times[i] else "comes before"
        raise ValueError(f"input file '{path}': time column '{name}' is not strictly increasing: "
                         f"line {i + 3} ({raw.iloc[i + 1].strip()}) {how} line {i + 2} ({raw.iloc[i].strip()}); "
                         "sort the rows by time and merge repeated times")


def _read_csv(path, time_col, columns, dim):
    table = _read_table(path)
    names = list(table.columns)
    time_col = names[0] if time_col is None else time_col
    if time_col not in names:
        raise ValueError(f"input file '{path}' has no time column '{time_col}' (columns: {', '.join(names)})")
    if columns is None:
        columns = [c for c in names if c != time_col]
    missing = [c for c in columns if c not in names]
    if missing:
        raise ValueError(f"input file '{path}' has no column {', '.join(repr(c) for c in missing)} "
                         f"(columns: {', '.join(names)})")
    if not columns:
        raise ValueError(f"input file '{path}' has no data column besides the time column '{time_col}'")
    if time_col in columns:
        raise ValueError(f"column '{time_col}' cannot be both the time column and a channel")
    times = _times(path, time_col, table[time_col])
    _check_sorted(path, time_col, times, table[time_col])
    y = np.stack([_numeric(path, c, table[c]) for c in columns], -1)
    return xr.DataArray(y, dims=(dim, "channel"), coords={dim: times, "channel": list(columns)},
                        attrs={"source": os.path.basename(path), "time_column": time_col})


def _open(path, role):
    """The Dataset in the NetCDF file (loaded) or Zarr store (lazy) ``path``."""
    zarr = file_format(path, role) == "zarr"
    try:
        if zarr:
            return xr.open_zarr(path)
        with xr.open_dataset(path) as ds:
            return ds.load()
    except (OSError, ValueError, KeyError, ImportError) as err:
        kind = "Zarr store" if zarr else "NetCDF file"
        raise ValueError(f"{role} file '{path}' is not a readable {kind}: {err}") from None


def _read_netcdf(path, var, dim):
    ds = _open(path, "input")
    if var is None:
        candidates = [k for k, v in ds.data_vars.items() if dim in v.dims]
        if len(candidates) != 1:
            raise ValueError(f"input file '{path}' has {len(candidates)} data variables with dimension '{dim}' "
                             f"({', '.join(candidates) or 'none'}; variables: {', '.join(ds.data_vars)}); "
                             "choose one with --var" + ("" if candidates else " and the time dimension with --dim"))
        var = candidates[0]
    if var not in ds.data_vars:
        raise ValueError(f"input file '{path}' has no data variable '{var}' (variables: {', '.join(ds.data_vars)})")
    da = ds[var]
    if dim not in da.dims:
        raise ValueError(f"variable '{var}' in '{path}' has no dimension '{dim}' (dims: {', '.join(da.dims)}); "
                         "name the time dimension with --dim")
    if da.dtype.kind not in "biuf":
        raise ValueError(f"variable '{var}' in '{path}' is not numeric (dtype {da.dtype})")
    if da.chunks is None and np.isinf(da.values).any():  # a lazy store's blocks are checked as they are filtered
        raise ValueError(f"variable '{var}' in '{path}' has infinite values")
    if dim in da.coords:
        from kalmanscan.xr.accessor import times_from_coord

        values = da[dim].values
        times_from_coord(values, "1s" if values.dtype.kind in "mM" else None, dim)
    return da


def channel_labels(da: xr.DataArray, dim: str = "time") -> list[str]:
    """One label per channel of :func:`kalmanscan.xr.to_numpy`'s flattening of ``da``'s other dims."""
    other = [d for d in da.dims if d != dim]
    if not other:
        return [str(da.name or "y")]
    grids = np.meshgrid(*[da[d].values if d in da.coords else np.arange(da.sizes[d]) for d in other], indexing="ij")
    flat = [g.reshape(-1) for g in grids]
    if len(other) == 1:
        return [str(v) for v in flat[0]]
    return [",".join(f"{d}={v[i]}" for d, v in zip(other, flat)) for i in range(flat[0].size)]


def read_params(path: str | os.PathLike, like: xr.DataArray, dim: str = "time") -> dict[str, Any]:
    """Model parameters saved by ``kalmanscan fit -o`` (NetCDF or CSV), as keywords for ``ks.xr``.

    Both formats are checked against ``like`` the same way: a fit that records the channels it was
    fitted on (the ``channels`` attribute of a NetCDF fit, the ``channel`` column of a CSV one that
    is not a dimension of ``like``) must cover every channel of ``like`` (:func:`channel_labels`),
    or a ``ValueError`` names both. A fit on dates also gives ``time_unit``.
    """
    from kalmanscan.xr import accessor as kxr

    _check_readable(path, "parameter")
    if file_format(path, "parameter") in ("netcdf", "zarr"):
        ds = _open(path, "parameter").load()
        fitted_on = _recorded_channels(path, ds.attrs.get(CHANNELS_ATTR))
        if fitted_on is None:
            fitted_on = _labels_of(ds, like, dim)
    else:
        ds, fitted_on = _params_table(path, like, dim)
    try:
        params = kxr.params(ds)
    except ValueError:
        raise ValueError(f"parameter file '{path}' is not a fit result of kalmanscan (write one with "
                         "'kalmanscan fit INPUT -o params.nc')") from None
    if fitted_on is not None:
        wanted = channel_labels(like, dim)
        absent = [c for c in wanted if c not in fitted_on]
        if absent:
            raise ValueError(f"parameter file '{path}' was fitted on channel(s) {', '.join(fitted_on[:20])}, "
                             f"not on {', '.join(absent[:20])} of the input; fit this input "
                             "('kalmanscan fit' or --fit) or give the parameters as flags")
    return params


CHANNELS_ATTR = "channels"


def _recorded_channels(path, text):
    """The channel labels a fit file records (a JSON list), or ``None`` when it records none."""
    if text is None:
        return None
    import json

    try:
        labels = json.loads(text)
    except (TypeError, ValueError):
        labels = None
    if not (isinstance(labels, list) and all(isinstance(c, str) for c in labels)):
        raise ValueError(f"parameter file '{path}': attribute '{CHANNELS_ATTR}' is not a JSON list of channel labels")
    return labels


def _labels_of(ds, like, dim):
    """The channel labels of a fit over exactly ``like``'s non-time dims (else ``None``)."""
    from kalmanscan.xr import accessor as kxr

    other = [d for d in like.dims if d != dim]
    for k in kxr.FIT_NAMES:
        if k in ds.data_vars and ds[k].ndim:
            if not other or set(ds[k].dims) != set(other):
                return None
            return channel_labels(ds[k].transpose(*other), dim)
    return None


def _params_table(path, like, dim):
    """A CSV fit table as a Dataset, and the channels it names (``None`` when it names none)."""
    from kalmanscan.xr import accessor as kxr

    table = _read_table(path, "parameter")
    index = [c for c in table.columns if c in like.dims and c != dim]
    names = [c for c in table.columns if c in kxr.FIT_NAMES]
    if not names:
        raise ValueError(f"parameter file '{path}' has no parameter column ({', '.join(kxr.FIT_NAMES)})")
    label = "channel" if "channel" in table.columns and not index else None
    fitted_on = None if label is None else [str(c).strip() for c in table[label]]
    unit = table["time_unit"].iloc[0].strip() if "time_unit" in table.columns else None
    table = table[index + ([label] if label else []) + names].copy()
    for c in names:
        table[c] = _numeric(path, c, table[c], "parameter", finite=False)
    if index:
        for d in index:
            table[d] = table[d].str.strip().to_numpy().astype(like[d].dtype if d in like.coords else int)
        ds = table.set_index(index).to_xarray()
        fitted_on = _labels_of(ds, like, dim)
    elif table.shape[0] == 1:
        ds = xr.Dataset({c: ((), table[c].iloc[0]) for c in names})
    elif label:
        table[label] = fitted_on
        if len(set(fitted_on)) != len(fitted_on):
            raise ValueError(f"parameter file '{path}' names a channel twice in its column '{label}'")
        ds = table.set_index(label).to_xarray()
    else:
        raise ValueError(f"parameter file '{path}' has {table.shape[0]} rows but no column naming the "
                         f"channels ({', '.join(d for d in like.dims if d != dim) or 'channel'})")
    ds.attrs["kalmanscan"] = "fit"
    if unit:
        ds.attrs["time_unit"] = unit
    return ds, fitted_on


def write_dataset(ds: xr.Dataset, path: str | os.PathLike, dim: str = "time", time_name: str | None = None) -> None:
    """Write ``ds`` to NetCDF, to a Zarr store (replaced if it exists; a dask-backed ``ds`` chunk
    by chunk with its chunks, under a progress bar), or to CSV: one row per time (variables with
    ``dim`` as columns ``<channel>_<variable>``), or one row per channel for a dataset without
    ``dim`` (a fit, with its ``time_unit`` and, for one channel without a channel dimension, a
    ``channel`` column). Every float is written as its shortest repr, which reads back to the same
    bits."""
    kind = file_format(path, "output")
    if kind == "netcdf":
        ds.to_netcdf(path)
        return
    if kind == "zarr":
        _write_zarr(ds, path)
        return
    if dim in ds.dims:
        table = _wide_table(ds, dim, time_name or dim)
    else:
        other = list(ds.dims)
        table = ds.to_dataframe().reset_index() if other else pd.DataFrame({k: [v.item()] for k, v in ds.items()})
        if ds.attrs.get("kalmanscan") == "fit":
            labels = _recorded_channels(path, ds.attrs.get(CHANNELS_ATTR))
            if not other and labels is not None and len(labels) == 1:
                table.insert(0, "channel", labels)
            if "time_unit" in ds.attrs:
                table["time_unit"] = ds.attrs["time_unit"]
    table.to_csv(path, index=False, float_format=None)  # the shortest repr of each float: exact round trip


def _write_zarr(ds: xr.Dataset, path) -> None:
    """``ds`` to the Zarr store ``path``: the graph built lazily, then computed chunk by chunk with
    a progress bar (tqdm) when ``ds`` is dask-backed."""
    delayed = ds.to_zarr(path, mode="w", compute=False)
    if not any(v.chunks is not None for v in ds.variables.values()):
        delayed.compute()
        return
    from tqdm.dask import TqdmCallback

    with TqdmCallback(desc=f"writing {Path(path).name}", leave=False):
        delayed.compute()


def _wide_table(ds, dim, time_name):
    timed = [k for k, v in ds.data_vars.items() if dim in v.dims]
    first = ds[timed[0]]
    labels = channel_labels(first, dim)
    other = [d for d in first.dims if d != dim]
    coord = ds[dim].values if dim in ds.coords else np.arange(ds.sizes[dim])
    columns = {time_name: coord}
    for k in timed:
        values = ds[k].transpose(dim, *other).values.reshape(ds.sizes[dim], -1)
        for c, label in enumerate(labels):
            columns[f"{label}_{k}" if other else k] = values[:, c]
    return pd.DataFrame(columns)
