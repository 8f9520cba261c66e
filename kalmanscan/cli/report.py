"""What the command line prints and draws: aligned tables, the fit report, the plots."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import xarray as xr

    from kalmanscan.inference.posterior import Posterior

__all__ = ["table", "print_fit", "plot_bands", "plot_calibration", "MAX_PANELS", "MAX_ROWS"]

MAX_PANELS = 6  # channels drawn by plot_bands
MAX_ROWS = 20   # channels listed in a table


def table(header: list[str], rows: list[list[str]], gap: int = 3) -> list[str]:
    """Lines of a table indented by two spaces: the first column left-aligned, the others
    right-aligned, each as wide as its widest cell and ``gap`` spaces apart, so cells never touch."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    sep = " " * gap
    return ["  " + sep.join(str(cell).ljust(w) if i == 0 else str(cell).rjust(w)
                            for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
            for row in [header, *rows]]


def print_fit(ds: xr.Dataset, data: xr.DataArray, heading: str) -> None:
    """Print the fitted parameters of ``ds`` (a ``kalmanscan fit`` result) as an aligned table,
    one row per channel of ``data``, with convergence and any unfitted channel. An estimate is
    followed by its standard error, or by ``(on the boundary 0)`` where the optimum is there (it
    has none); the log-likelihood is the sum over the channels."""
    est = ds.attrs["estimate"].split(",")
    shared = bool(ds.attrs["shared"])
    fitted = np.ravel(ds["fitted"].values) if "fitted" in ds else np.ones(1, bool)
    status = "converged" if bool(ds["converged"].all()) else "NOT converged"
    n = int(np.size(ds["loglik"].values))
    summed = "of the channel" if n == 1 else f"summed over {n} channels"
    print(f"{heading}: {status}, log-likelihood {float(ds['loglik'].sum()):.6g} ({summed}; "
          f"{'one parameter set for all channels' if shared else 'parameters per channel'}; "
          f"time unit: {ds.attrs['time_unit']})")
    names = [k for k in ("theta", "sigma", "obs_var", "mean", "init_mean", "init_var") if k in ds]
    rows = []
    for c, lab in enumerate(data.labels[:MAX_ROWS] if not shared else ["all"]):
        cells = [lab]
        for k in names:
            cells.append(_estimate(ds, k, c, k in est and bool(fitted[min(c, fitted.size - 1)])))
        rows.append(cells)
    for line in table(["channel", *names], rows):
        print(line)
    if not shared and len(data.labels) > MAX_ROWS:
        print(f"  ... and {len(data.labels) - MAX_ROWS} more channels")
    n_obs = np.ravel(ds["n_obs"].values)
    if not fitted.all():
        which = ["all"] if shared else [lab for lab, ok in zip(data.labels, fitted) if not ok]
        counts = sorted({int(n) for n, ok in zip(n_obs, np.broadcast_to(fitted, n_obs.shape)) if not ok}) \
            if not shared else [int(n_obs.sum())]
        what = "no observations" if counts == [0] else \
            f"{'/'.join(map(str, counts))} observation(s), fewer than the {len(est)} estimated parameters"
        note = (f"not fitted ({what}): {', '.join(which[:MAX_ROWS])}" + (" ..." if len(which) > MAX_ROWS else "")
                + "; the values shown for it are the initial guess, not estimates")
        print(f"  {note}")
    elif status != "converged":
        print("kalmanscan: warning: the optimiser stopped before converging; raise --max-iter or check the model",
              file=sys.stderr)


def _estimate(ds, k, c, estimated):
    """The cell of parameter ``k`` for channel ``c``: its value, with its standard error when
    ``estimated``, or a note that the optimum is on the boundary 0 (no standard error there)."""
    at = c if ds[k].ndim else 0
    text = f"{np.ravel(ds[k].values)[at]:.5g}"
    if not estimated:
        return text
    if f"{k}_on_boundary" in ds and bool(np.ravel(ds[f"{k}_on_boundary"].values)[at]):
        return f"{text} (on the boundary 0)"
    return f"{text} +/- {np.ravel(ds[k + '_stderr'].values)[at]:.3g}"


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend (the CLI never opens a window)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_bands(post: Posterior, data: Any, z: float, level: float, path: str) -> None:
    """The belief band of each channel (at most :data:`MAX_PANELS`), written to ``path``."""
    import kalmanscan as ks

    n = min(data.y.shape[1], MAX_PANELS)
    plt = _pyplot()
    fig, axes = plt.subplots(n, 1, figsize=(10, 2.8 * n), layout="constrained", squeeze=False)
    axes = axes[:, 0]
    for c in range(n):
        ks.plot.belief_band(post, y=data.y, times=data.plot_times(), channel=c, z=z, ax=axes[c],
                            title=f"{data.labels[c]}: {'smoothed' if post.filtered is not None else 'filtered'} "
                                  f"state, {level:.0%} band")
        axes[c].set_xlabel(data.time_label())
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_calibration(post: Posterior, data: Any, path: str) -> None:
    """PIT histogram and reliability diagram (all channels pooled), then the NIS and belief band of
    the first channel with a scored observation (named in their titles), written to ``path``. A
    panel with nothing to draw (no channel has one) says so instead of failing."""
    import kalmanscan as ks

    scored = np.isfinite(ks.diagnostics.nis(post, data.y)).reshape(data.y.shape)
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), layout="constrained")
    if scored.any():
        c = int(np.flatnonzero(scored.any(0))[0])
        first = " (the first channel with observations)" if c else ""
        ks.plot.pit_histogram(post, data.y, ax=axes[0, 0])
        ks.plot.reliability(post, data.y, target="obs", ax=axes[0, 1])
        ks.plot.nis(post, data.y, channel=c, times=data.plot_times(), ax=axes[1, 0],
                    title=f"NIS, {data.labels[c]}{first}")
        ks.plot.belief_band(post, y=data.y, times=data.plot_times(), channel=c, ax=axes[1, 1],
                            title=f"{data.labels[c]}: filtered state")
    else:
        for ax in axes.flat:
            ax.text(0.5, 0.5, "no scored observations", ha="center", va="center", transform=ax.transAxes)
    for ax in axes[1]:
        ax.set_xlabel(data.time_label())
    fig.savefig(path, dpi=110)
    plt.close(fig)
