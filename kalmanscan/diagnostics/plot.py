"""Plots of a filter run and of its calibration (``ks.plot``, matplotlib).

Every function draws on ``ax`` (a new figure's Axes when ``None``) and returns the Axes. A
posterior over ``(..., T, C)`` is reduced to one series by ``channel`` (the last axis) and
``index`` (a tuple over the batch dimensions ``...``, empty when there are none). Times on the
x axis default to ``post.params["times"]``; ``times=`` may be numbers or dates (``datetime64``,
``datetime`` or pandas timestamps), which get a date axis. See ``docs/calibration.md`` for how to read each plot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from scipy import stats

from kalmanscan import diagnostics

from kalmanscan.diagnostics import state_errors
from kalmanscan.inference.frames import columns, is_pandas
from kalmanscan.types import ArrayLike


if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from kalmanscan.inference.posterior import Posterior


__all__ = ["belief_band", "pit_histogram", "reliability", "nis", "gates"]

_FIGSIZE = (9.0, 3.6)
_MISSING = dict(color="0.6", alpha=0.25, lw=0)


def _axes(ax, figsize=_FIGSIZE):
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=figsize, layout="constrained")[1]


def _np(x):
    if is_pandas(x):  # a Series (of a Series y's posterior, or y) is one channel, as ks.filter reads it
        return columns(x)
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def _pick(x, index, channel, shape):
    """One series ``(T,)`` of ``x`` broadcast to the posterior's ``shape`` ``(..., T, C)``."""
    arr = np.broadcast_to(np.asarray(_np(x), dtype=np.float64), shape)
    index = tuple(np.atleast_1d(index)) if index != () else ()
    if len(index) != len(shape) - 2:
        raise ValueError(f"index must select one of the batch dimensions {shape[:-2]} (a tuple of "
                         f"{len(shape) - 2} integers), got {index!r}")
    if not -shape[-1] <= channel < shape[-1]:
        raise ValueError(f"channel must be in [0, {shape[-1]}), got {channel!r}")
    return arr[index + (slice(None), channel)]


def _times(post, times, index, channel, shape):
    """The x values: numbers (float64), or ``datetime64`` dates for a date axis."""
    if times is None:
        return _pick(post.params["times"], index, channel, shape)
    t = np.asarray(_np(times))
    if t.dtype.kind == "O":  # datetime.datetime or pandas Timestamps
        try:
            t = t.astype("datetime64[ns]")
        except (TypeError, ValueError):
            raise ValueError("times must be numbers or dates (datetime64), got objects of type "
                             f"{type(t.flat[0]).__name__ if t.size else 'object'}") from None
    if t.dtype.kind == "M":
        if np.isnat(t).any():
            raise ValueError("times must not contain NaT")
    elif t.dtype.kind in "biuf":
        t = t.astype(np.float64)
    else:
        raise ValueError(f"times must be numbers or dates (datetime64), got dtype {t.dtype}")
    if t.shape != (shape[-2],):
        raise ValueError(f"times must have shape ({shape[-2]},), got {t.shape}")
    return t


def _date_axis(ax, t):
    """Concise date labels when ``t`` holds dates (matplotlib's date converter is used for them)."""
    if np.asarray(t).dtype.kind == "M":
        import matplotlib.dates as mdates

        locator = mdates.AutoDateLocator()
        ax.xaxis.set_major_locator(locator)
        ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))


def _shade_missing(ax, t, missing, label="missing"):
    """Grey spans over runs of missing steps, reaching half way to the neighbouring observations."""
    idx = np.flatnonzero(missing)
    if idx.size == 0:
        return
    starts = idx[np.r_[True, np.diff(idx) > 1]]
    ends = idx[np.r_[np.diff(idx) > 1, True]]
    for i, (s, e) in enumerate(zip(starts, ends)):
        lo = t[s] - (t[s] - t[s - 1]) / 2 if s > 0 else t[s]
        hi = t[e] + (t[e + 1] - t[e]) / 2 if e + 1 < t.size else t[e]
        if hi == lo:
            half = np.timedelta64(12, "h") if t.dtype.kind == "M" else 0.5
            lo, hi = lo - half, hi + half
        ax.axvspan(lo, hi, **_MISSING, label=label if i == 0 else None)


def _label(ax, xlabel, ylabel, title, loc="best", ncol=1):
    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(loc=loc, fontsize="small", ncol=ncol)
    return ax


def _shape(post):
    return tuple(np.shape(_np(post.mean)))


def belief_band(post: Any, y: Any = None, times: Any = None, channel: int = 0, z: float = 1.96, ax: Any = None, *,
                index: tuple = (), truth: Any = None, title: str | None = None) -> Axes:
    """The belief ``mean ± z sqrt(var)`` over time, with observations and missing stretches.

    ``y`` (the observations, ``(..., T, C)``) are drawn as dots; steps where ``y`` is NaN (or,
    without ``y``, where the filter saw no observation) are shaded. ``truth`` adds the latent
    state as a dashed line. For a smoother's posterior the band is the smoothed one.
    """
    shape = _shape(post)
    ax = _axes(ax)
    t = _times(post, times, index, channel, shape)
    m = _pick(post.mean, index, channel, shape)
    s = np.sqrt(_pick(post.var, index, channel, shape))
    if y is not None:
        yy = _pick(y, index, channel, shape)
        missing = np.isnan(yy)
    else:
        missing = _pick(post.params["missing"], index, channel, shape) > 0
    _shade_missing(ax, t, missing)
    ax.fill_between(t, m - z * s, m + z * s, color="C0", alpha=0.25, lw=0, label=f"mean ± {z:.3g}σ")
    ax.plot(t, m, color="C0", lw=1.5, label="mean")
    if truth is not None:
        ax.plot(t, _pick(truth, index, channel, shape), color="k", lw=1, ls="--", label="truth")
    if y is not None:
        ax.plot(t, yy, ".", color="C3", ms=3.5, label="observations")
    _date_axis(ax, t)
    return _label(ax, "time", None, title or f"belief band, channel {channel}", "best", 2)


def pit_histogram(post: Posterior, y: ArrayLike, bins: int = 10, ax: Axes | None = None, *, channel: int | None = None,
                  index: tuple | None = None, level: float = 0.95, title: str | None = None) -> Axes:
    """Histogram of the PIT values (density, 1 = uniform) with the band a uniform sample stays in.

    Each bin's count is Binomial(n, 1/bins) under calibration; the grey band is its central
    ``level`` interval (scipy.stats.binom), so about ``level`` of the bars end inside it. Pools
    every series unless ``channel`` (and ``index`` for batch dimensions) picks one.
    """
    if not (isinstance(bins, (int, np.integer)) and bins >= 2):
        raise ValueError(f"bins must be an integer >= 2, got {bins!r}")
    u = diagnostics.pit(post, y)
    if channel is not None:
        u = _pick(u, () if index is None else index, channel, u.shape)
    u = u[np.isfinite(u)]
    if u.size == 0:
        raise ValueError("y has no observed values")
    ax = _axes(ax, (5.0, 3.6))
    n = u.size
    expected = n / bins
    lo, hi = stats.binom.interval(level, n, 1 / bins)
    ax.axhspan(lo / expected, hi / expected, color="0.6", alpha=0.3, lw=0,
               label=f"{level:.0%} band of a uniform sample")
    counts, edges = np.histogram(u, bins=bins, range=(0, 1))
    ax.bar(edges[:-1], counts / expected, width=1 / bins, align="edge", color="C0", alpha=0.8,
           edgecolor="white", label=f"PIT (n = {n})")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.3 * max(hi / expected, (counts / expected).max()))
    return _label(ax, "PIT value", "density (1 = uniform)", title or "PIT histogram", "upper center")


def reliability(post: Posterior, truth_or_y: ArrayLike, levels: ArrayLike | None = None, ax: Axes | None = None, *,
                target: str = "state", channel: int | None = None, index: tuple | None = None, level: float = 0.95,
                label: str | None = None, title: str | None = None) -> Axes:
    """Reliability diagram: observed coverage of central intervals against their nominal level.

    ``target="state"`` checks ``truth`` against the posterior ``mean ± z sqrt(var)``;
    ``target="obs"`` checks ``y`` against the one-step predictive interval. The grey band is the
    central ``level`` binomial range of a calibrated coverage (for the state, with the effective
    count of independent errors under the model, :func:`kalmanscan.diagnostics.effective_dof`'s,
    as state errors are correlated).
    Points below the diagonal: intervals too narrow (over-confident); above: too wide.
    """
    if target not in ("state", "obs"):
        raise ValueError(f"target must be 'state' or 'obs', got {target!r}")
    levels = np.linspace(0.05, 0.95, 19) if levels is None else np.asarray(levels, dtype=np.float64)
    post = diagnostics.numpy_post(post)
    shape = _shape(post)
    x = np.broadcast_to(_np(truth_or_y).astype(np.float64), shape)
    mean, var = (post.mean, post.var) if target == "state" else (post.pred_obs_mean, post.pred_obs_var)
    links = state_errors.links(post) if target == "state" else None
    if channel is not None:
        def sel(a):
            return _pick(a, () if index is None else index, channel, shape)[..., None]

        x, mean, var = sel(x), sel(mean), sel(var)
        links = None if links is None else sel(links)
    x = diagnostics.scored(x, var)
    observed = diagnostics.inside(mean, var, x, levels, None)
    scored = np.isfinite((x - mean) / np.sqrt(var))
    if links is None:  # innovations are independent: the plain count
        n = scored.sum()
    else:
        k = state_errors.cumulants(links, scored)
        n = state_errors.effective_count(k[0], k[1])
    n = max(int(round(n)), 1)
    ax = _axes(ax, (4.6, 4.4))
    lo, hi = (stats.binom.ppf(q, n, levels) / n for q in ((1 - level) / 2, (1 + level) / 2))
    if not ax.collections:
        ax.fill_between(levels, lo, hi, color="0.6", alpha=0.3, lw=0, label=f"{level:.0%} band")
        ax.plot([0, 1], [0, 1], color="k", lw=0.8)
    ax.plot(levels, observed, "o-", ms=4, label=label or ("state" if target == "state" else "observations"))
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    return _label(ax, "nominal coverage", "observed coverage", title or "reliability", "upper left")


def nis(post: Any, y: Any, channel: int = 0, ax: Any = None, *, index: tuple = (), times: Any = None,
        window: int | None = None, level: float = 0.95, title: str | None = None) -> Axes:
    """Normalised innovation squared over time, on a log scale, with its chi-square bands.

    Dots: each step's NIS, chi-square(1) under calibration; the dotted lines bound its central
    ``level`` range. Line: the running mean over ``window`` observed steps (default ``max(10,
    T // 40)``) with its ``chi2(window) / window`` band shaded. A running mean above the band:
    under-dispersed (innovations larger than predicted); below: over-dispersed.
    """
    shape = _shape(post)
    v = _pick(diagnostics.nis(post, y), index, channel, shape)
    t = _times(post, times, index, channel, shape)
    seen = np.isfinite(v)
    if not seen.any():
        raise ValueError("y has no observed values in this series")
    window = max(10, shape[-2] // 40) if window is None else int(window)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window!r}")
    ax = _axes(ax)
    _shade_missing(ax, t, ~seen)
    q = stats.chi2.ppf([(1 - level) / 2, (1 + level) / 2], 1)
    ax.plot(t[seen], v[seen], ".", color="C0", ms=3, alpha=0.6, label="NIS")
    for b in q:
        ax.axhline(b, color="C0", ls=":", lw=1)
    ts, vs = t[seen], v[seen]
    if vs.size >= window:
        run = np.convolve(vs, np.ones(window) / window, mode="valid")
        tr = ts[window - 1:]
        lo, hi = stats.chi2.ppf([(1 - level) / 2, (1 + level) / 2], window) / window
        ax.fill_between(tr, lo, hi, color="C1", alpha=0.25, lw=0,
                        label=f"{level:.0%} band of a {window}-step mean")
        ax.plot(tr, run, color="C1", lw=1.8, label=f"running mean ({window} steps)")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_yscale("log")
    _date_axis(ax, t)
    return _label(ax, "time", "NIS", title or f"normalised innovation squared, channel {channel}", "lower left", 2)


def gates(post: Any, channel: int = 0, ax: Any = None, *, index: tuple = (), times: Any = None,
          title: str | None = None) -> Axes:
    """Forget and write gate traces of the filter (:meth:`kalmanscan.Posterior.gates`).

    ``forget_t`` scales the previous information mean; ``write_t`` (the Kalman gain over ``h``)
    is how much of ``y_t`` enters the state: 0 at a missing value, large after a gap.
    """
    shape = _shape(post)
    forget, write = (_pick(g, index, channel, shape) for g in post.gates())
    t = _times(post, times, index, channel, shape)
    base = post.filtered if post.filtered is not None else post
    missing = _pick(base.params["missing"], index, channel, shape) > 0
    ax = _axes(ax)
    _shade_missing(ax, t, missing)
    ax.plot(t, forget, color="C2", lw=1.3, label="forget gate")
    ax.plot(t, write, color="C4", lw=1.3, label="write gate")
    _date_axis(ax, t)
    return _label(ax, "time", "gate", title or f"gates, channel {channel}")
