"""pandas in, pandas out for :func:`kalmanscan.filter`, :func:`kalmanscan.smooth` and
:func:`kalmanscan.forecast`; pandas in for :func:`kalmanscan.fit`.

A ``DataFrame`` is ``y`` of shape ``(T, C)``, one channel per column; a ``Series`` is one channel,
``(T, 1)``, named by the series' name. The index gives the times (as a coordinate does in
:mod:`kalmanscan.xr`): a ``DatetimeIndex`` or ``TimedeltaIndex`` becomes ``(t - t_0) /
time_unit`` and needs ``time_unit=`` (``"1D"``, ``"h"``, a ``numpy.timedelta64``: ``theta`` and
``sigma`` are then per that unit); a numeric index is the times as they are; any other index only
labels the rows and the steps are ``dt``. ``times=`` or ``dt=`` given explicitly win over the
index, which then only labels the rows.

Every ``(T, C)`` field of the result (of ``filtered`` too) is a ``DataFrame`` with ``y``'s index
and columns, and ``loglik`` a ``Series`` over the columns; for a ``Series`` ``y`` they are a
``Series`` with its index and name and a number. ``params`` stay NumPy arrays ``(T, C)`` and
``Posterior.frame`` holds the labels (:class:`FrameLabels`). A forecast from such a posterior has
its moments so, indexed by the future times, dates for a date index; its ``times=`` may then be
dates. A stream of dates continues from its Posterior (``state=post``: its dates count
from the first chunk's first date). ``Posterior.to_numpy()`` gives the plain arrays. Nothing here
imports pandas unless the caller's data is pandas (already imported).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["FrameLabels", "is_pandas", "read", "columns", "write", "table", "pandas_io", "pandas_in", "pandas_forecast"]


@dataclasses.dataclass(frozen=True)
class FrameLabels:
    """What a pandas ``y`` labelled: ``index`` (the rows, ``T``), ``columns`` (the channels, ``C``;
    the name of a ``Series``), for an index of dates ``origin`` (its first value, time 0) and
    ``unit`` (the time unit as ``numpy.timedelta64``, else ``None``), and whether ``y`` was a
    ``Series`` (``series``: results are then ``Series`` too)."""

    index: Any
    columns: Any
    origin: Any = None
    unit: np.timedelta64 | None = None
    series: bool = False


def is_pandas(x: Any) -> bool:
    """Whether ``x`` is a pandas ``Series`` or ``DataFrame`` (without importing pandas)."""
    pd = sys.modules.get("pandas")
    return pd is not None and isinstance(x, (pd.Series, pd.DataFrame))


def read(y: Any, time_unit: Any, given: dict, origin: Any = None) -> tuple[np.ndarray, dict, FrameLabels]:
    """``(values, steps, labels)`` of a pandas ``y``: its values ``(T, C)``, the keywords
    ``{"times": ...}`` its index gives (empty when ``given`` holds ``times`` or ``dt``, or the
    index is not times) and its labels. Dates count from ``origin`` (default: the first one; a
    continued stream passes its first chunk's). ``ValueError`` naming ``y`` for a non-numeric column,
    naming ``time_unit`` when dates come without it or it comes without dates."""
    import pandas as pd

    from kalmanscan.xr.times import parse_time_unit, times_from_coord

    frame = y.to_frame(name=y.name if y.name is not None else "y") if isinstance(y, pd.Series) else y
    bad = [c for c, d in frame.dtypes.items() if not pd.api.types.is_numeric_dtype(d)]
    if bad:
        raise ValueError(f"y: column {bad[0]!r} is not numeric (dtype {frame.dtypes[bad[0]]}); select the numeric "
                         "columns, one per channel")
    kinds = {np.dtype(d).kind if isinstance(d, np.dtype) else "x" for d in frame.dtypes}
    values = frame.to_numpy() if kinds <= {"f"} or kinds == {"b"} else frame.to_numpy(np.float64, na_value=np.nan)
    index = frame.index
    dates = isinstance(index, (pd.DatetimeIndex, pd.TimedeltaIndex))
    explicit = given.get("times") is not None or "dt" in given
    series = isinstance(y, pd.Series)
    labels = FrameLabels(index, frame.columns, series=series)
    if explicit or not (dates or pd.api.types.is_numeric_dtype(index.dtype)):
        if time_unit is not None:
            raise ValueError("time_unit applies to a pandas index of dates used as the times; "
                             + ("times or dt was given" if explicit else f"this index has dtype {index.dtype}"))
        return values, {}, labels
    if dates and time_unit is None:
        raise ValueError("time_unit is required for a pandas index of dates (for example time_unit='1D' or 'h'; "
                         "theta and sigma are then per that unit), or give dt= for regular steps")
    stamps = index.tz_convert(None) if getattr(index, "tz", None) is not None else index  # UTC, as the CLI reads
    times, _ = times_from_coord(stamps.to_numpy(), time_unit, "index")
    if dates:
        unit = parse_time_unit(time_unit)
        origin = index[0] if origin is None else origin
        times = times + (index[0] - origin).to_timedelta64() / unit
        labels = FrameLabels(index, frame.columns, origin, unit, series)
    return values, {"times": times}, labels


def columns(x: Any) -> np.ndarray:
    """A pandas ``Series`` or ``DataFrame`` as a float64 ``(T, C)`` array (a ``Series`` is one
    channel, as :func:`read` reads it; missing values NaN)."""
    return x.to_numpy(np.float64, na_value=np.nan).reshape(len(x), -1)


def write(post: Any, labels: FrameLabels) -> Any:
    """``post`` with its ``(T, C)`` fields as ``DataFrame`` and ``loglik`` as a ``Series`` labelled
    by ``labels`` (``filtered`` too), and ``frame = labels``."""
    import pandas as pd

    changes = {"frame": labels}
    for f in dataclasses.fields(post):
        v = getattr(post, f.name)
        if v is None or f.name in ("params", "frame"):
            continue
        if f.name == "filtered":
            changes[f.name] = write(v, labels)
        elif f.name == "loglik":
            changes[f.name] = v[0] if labels.series else pd.Series(v, index=labels.columns, name="loglik")
        else:
            if np.ndim(v) != 2:
                raise ValueError(f"with a pandas y the results are (T, C) tables, but the parameters add batch "
                                 f"dimensions (shape {np.shape(v)}); pass y as a NumPy array for batches")
            changes[f.name] = table(v, labels)
    return dataclasses.replace(post, **changes)


def table(values: np.ndarray, labels: FrameLabels, index: Any = None) -> Any:
    """``values`` ``(T, C)`` as a ``DataFrame`` with the columns of ``labels`` (a ``Series`` named
    by its one column for a ``Series`` ``y``) over ``index`` (default: ``labels.index``)."""
    import pandas as pd

    index = labels.index if index is None else index
    if labels.series:
        return pd.Series(values[:, 0], index=index, name=labels.columns[0])
    return pd.DataFrame(values, index=index, columns=labels.columns)


def pandas_io(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``ks.filter`` or ``ks.smooth`` so that a pandas ``y`` (see the module docstring) gives a
    pandas result; ``time_unit`` is the unit of an index of dates (pandas ``y`` only). Other
    inputs pass through unchanged."""

    @functools.wraps(fn)
    def wrapper(y: Any, *, time_unit: Any = None, **kwargs: Any) -> Any:
        state = kwargs.get("state")
        before = getattr(state, "frame", None)  # a pandas posterior continued: its labels
        if before is not None:
            kwargs["state"] = state.to_numpy()
        if not is_pandas(y):
            _no_time_unit(time_unit)
            return fn(y, **kwargs)
        values, steps, labels = read(y, time_unit, kwargs, None if before is None else before.origin)
        if labels.unit is not None and before is None and getattr(state, "time", None) is not None:
            raise ValueError("state: continue a stream of dates from its Posterior (state=post), which knows the "
                             "first date its times count from; a StreamState holds the times only")
        return write(fn(values, **kwargs, **steps), labels)

    return wrapper


def _no_time_unit(time_unit: Any) -> None:
    """``ValueError`` when a ``time_unit`` comes with arrays (it is for a pandas index)."""
    if time_unit is not None:
        raise ValueError("time_unit applies to a pandas y whose index holds dates; with arrays, give times in "
                         "model units")


def pandas_in(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``ks.fit``: a pandas ``y`` is read as :func:`pandas_io` reads it (its index the times,
    ``time_unit`` for dates), so the fitted ``theta`` and ``sigma`` are per the unit a pandas
    filter of the same data uses; the result is unchanged."""

    @functools.wraps(fn)
    def wrapper(y: Any, *, time_unit: Any = None, **kwargs: Any) -> Any:
        if not is_pandas(y):
            _no_time_unit(time_unit)
            return fn(y, **kwargs)
        values, steps, _ = read(y, time_unit, kwargs)
        return fn(values, **kwargs, **steps)

    return wrapper


def pandas_forecast(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``ks.forecast`` so that a posterior of pandas input (``post.frame``) gives ``DataFrame``
    moments indexed by the future times (dates for an index of dates, whose ``times=`` may then
    be dates too)."""

    @functools.wraps(fn)
    def wrapper(post: Any, steps: int | None = None, *, times: Any = None) -> Any:
        labels = getattr(post, "frame", None)
        if labels is None:
            return fn(post, steps, times=times)
        import pandas as pd

        if times is not None and labels.unit is not None:
            future = np.asarray(times)
            if future.dtype.kind in "mMO":
                times = np.asarray((pd.to_datetime(future) if future.dtype.kind != "m" else pd.to_timedelta(future))
                                   - labels.origin, "timedelta64[ns]") / labels.unit
        fc = fn(post.to_numpy(), steps, times=times)
        model_times = np.asarray(fc.times, np.float64)[:, 0]  # (K, 1) or (K, C), the same times in every column
        if labels.unit is not None:
            index = pd.Index(labels.origin + (model_times * labels.unit.astype(np.float64)).astype("timedelta64[ns]"))
        elif labels.index.dtype.kind in "iu" and np.all(model_times == np.round(model_times)):
            index = pd.Index(model_times.astype(np.int64))  # integer times (years) stay integer
        else:
            index = pd.Index(model_times)
        tables = {k: table(np.asarray(getattr(fc, k)), labels, index) for k in ("mean", "var", "obs_mean", "obs_var")}
        return dataclasses.replace(fc, **tables)

    return wrapper
