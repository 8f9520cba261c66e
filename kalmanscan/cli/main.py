"""The ``kalmanscan`` command line.

    kalmanscan filter    data.csv --theta 0.1 --sigma 1 --obs-var 0.5 -o out.nc --plot out.png
    kalmanscan smooth    data.nc --var temp --time-unit 1D --params fit.nc -o smoothed.csv
    kalmanscan fit       data.csv [--estimate theta,sigma,obs_var] [--shared] -o fit.nc
    kalmanscan calibrate data.csv --fit [--plot calibration.png] [--strict]
    kalmanscan demo      [--out kalmanscan-demo.png] [--backend auto]

Input is a CSV table (a time column, numeric or ISO 8601, and one column per channel) or a NetCDF
variable (:mod:`kalmanscan.cli.io`). Model parameters come from flags (one value, or one per channel
separated by commas), from a fit result (``--params``), or from a fit run first (``--fit``; flags
are then initial guesses for the estimated names and fixed values for the others). Output is
NetCDF or CSV by the suffix of ``-o``; the input is never overwritten. Bad input exits with
status 2 and a message naming the problem.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import numpy as np

from kalmanscan.cli.report import MAX_ROWS, plot_bands, plot_calibration, print_fit, table

__all__ = ["main", "build_parser", "print_fit"]

# Maximum-likelihood local-level variances of the Nile series (Durbin and Koopman, 2012, §2.10).
NILE_LEVEL_VAR = 1469.1
NILE_OBS_VAR = 15099.0

_MODEL_FLAGS = ("theta", "sigma", "obs_var", "mean", "init_mean", "init_var")
_HELP = {
    "theta": "mean-reversion rate >= 0 per time unit (0: random walk, needs --init-var)",
    "sigma": "diffusion scale >= 0",
    "obs_var": "observation noise variance > 0",
    "mean": "mean level (default 0)",
    "init_mean": "mean of the belief at the first time (default: --mean)",
    "init_var": "variance of the belief at the first time (default: stationary)",
}
_LONG_BYTES = 20_000_000


def _demo(args) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import kalmanscan as ks

    nile = ks.datasets.load_nile()
    for _ in range(2):  # the first call pays one-off start-up costs; time the second
        t0 = time.perf_counter()
        post = ks.filter(nile.y, theta=0.0, sigma=np.sqrt(NILE_LEVEL_VAR), obs_var=NILE_OBS_VAR,
                         init_var=float("inf"), backend=args.backend)
        elapsed = time.perf_counter() - t0
    sd = np.sqrt(post.var[-1, 0])
    print("kalmanscan demo")
    print("===============")
    print(f"Nile flow 1871-1970 (T={nile.y.shape[0]}), local level: sigma^2={NILE_LEVEL_VAR}, obs_var={NILE_OBS_VAR}")
    print(f"  log-likelihood (exact diffuse prior, first step left out): {post.loglik[0]:.4f}")
    print(f"  level in 1970: {post.mean[-1, 0]:.1f} +/- {1.96 * sd:.1f} (95%)")
    print(f"  filtered in {elapsed * 1e3:.1f} ms")

    sens = ks.datasets.sensors()
    p = sens.params
    spost = ks.filter(sens.y, times=sens.times, theta=p["theta"], sigma=p["sigma"],
                      obs_var=p["obs_var"], mean=p["mean"], backend=args.backend)
    missing = np.isnan(sens.y).mean(0)
    err = spost.mean - sens.truth
    inside = np.abs(err) <= 1.96 * np.sqrt(spost.var)
    print(f"\nSynthetic sensors (T={sens.y.shape[0]}, irregular times, gaps), filtered with the true model:")
    print(f"  {'channel':<12}{'missing':>9}{'RMSE':>9}{'mean sd':>9}{'95% cover':>11}")
    for c, name in enumerate(sens.channels):
        print(f"  {name:<12}{missing[c]:>9.1%}{np.sqrt(np.mean(err[:, c] ** 2)):>9.3f}"
              f"{np.mean(np.sqrt(spost.var[:, c])):>9.3f}{inside[:, c].mean():>11.1%}")

    fig, axes = plt.subplots(2, 1, figsize=(10, 7), constrained_layout=True)
    ks.plot.belief_band(post, y=nile.y, times=nile.times, ax=axes[0])
    axes[0].set_title("Nile flow: filtered level, 95% band")
    ks.plot.belief_band(spost, y=sens.y, times=sens.times, ax=axes[1])
    axes[1].plot(sens.times, sens.truth[:, 0], color="k", lw=0.8, ls="--", label="truth")
    axes[1].legend(loc="best")
    axes[1].set_title(f"Sensor '{sens.channels[0]}': filtered state, 95% band, gaps shaded")
    fig.savefig(args.out, dpi=110)
    plt.close(fig)
    print(f"\nwrote {args.out}")
    return 0


class _Data:
    """The input series as a DataArray plus its NumPy view ``y (T, C)`` and model ``times``."""

    def __init__(self, args, lazy: bool = False):
        import kalmanscan as ks
        from kalmanscan.cli import io

        columns = None if args.columns is None else [c.strip() for c in args.columns.split(",")]
        self.da = io.read_series(args.input, time_col=args.time_col, columns=columns, var=args.var, dim=args.dim)
        self.dim = args.dim
        coord = self.da[self.dim].values if self.dim in self.da.coords else None
        if coord is not None and coord.dtype.kind in "mM" and args.time_unit is None and args.dt is None:
            raise ValueError(f"the times in '{args.input}' are dates; give --time-unit (for example 1D, 1h or 30s): "
                             "theta is then per that unit")
        self.time_unit = None if args.dt is not None else args.time_unit
        self.dt = args.dt
        self.y, self.times = (None, None) if lazy else ks.xr.to_numpy(self.source(), self.dim,
                                                                       time_unit=self.time_unit)
        self.labels = io.channel_labels(self.da, self.dim)
        self.datetime = coord is not None and coord.dtype.kind in "mM" and args.dt is None

    def source(self):
        """The DataArray the model sees: without its time coordinate under ``--dt`` (regular steps)."""
        return self.da.drop_vars(self.dim) if self.dt is not None and self.dim in self.da.coords else self.da

    def steps(self) -> dict:
        """``times=`` or ``dt=`` keywords for the NumPy API."""
        return {"times": self.times} if self.times is not None else {"dt": self.dt if self.dt is not None else 1.0}

    def plot_times(self):
        """The x values of the plots: the dates themselves for a date coordinate (a date axis)."""
        if self._dates():
            return self.da[self.dim].values
        if self.times is not None:
            return self.times
        return np.arange(self.y.shape[0]) * (self.dt if self.dt is not None else 1.0)

    def _dates(self) -> bool:
        return self.datetime and self.da[self.dim].dtype.kind == "M"

    def time_label(self) -> str:
        if self._dates():
            return "date"
        return f"time ({self.time_unit})" if self.datetime else "time"

    def flat(self, name, value):
        """A parameter (scalar or DataArray over the non-time dims) as a scalar or ``(C,)`` array."""
        import xarray as xr

        if not isinstance(value, xr.DataArray):
            return value
        template = self.da.isel({self.dim: 0}, drop=True)
        extra = [d for d in value.dims if d not in template.dims]
        if extra and value.ndim == 1 and template.ndim <= 1:
            return self._by_label(name, value)
        if extra:
            raise ValueError(f"parameter '{name}' has dimensions {extra} that the input does not have")
        try:
            value = value.sel({d: template[d].values for d in value.dims if d in template.coords})
        except KeyError:
            raise ValueError(f"parameter '{name}' is not given for every channel of the input "
                             f"({', '.join(self.labels[:MAX_ROWS])})") from None
        return value.broadcast_like(template).transpose(*template.dims).values.reshape(-1)

    def _by_label(self, name, value):
        """A parameter over one dimension matched to the input's channels by label (for a 1-D input,
        or channels under another dimension name)."""
        d = value.dims[0]
        given = [str(v) for v in (value[d].values if d in value.coords else range(value.sizes[d]))]
        absent = [lab for lab in self.labels if lab not in given]
        if absent:
            raise ValueError(f"parameter '{name}' is given for {d} {', '.join(given[:MAX_ROWS])}, not for "
                             f"{', '.join(absent[:MAX_ROWS])} of the input")
        return value.values[[given.index(lab) for lab in self.labels]]


def _flag_params(args, data) -> dict:
    """Model parameters given as flags: one value, or one per channel in the order of ``data.labels``
    (the non-time dims flattened in order, the last fastest), as a DataArray over those dims."""
    import xarray as xr

    other = [d for d in data.da.dims if d != data.dim]
    shape = [data.da.sizes[d] for d in other]
    coords = {d: data.da[d].values for d in other if d in data.da.coords}
    out = {}
    for name in _MODEL_FLAGS:
        values = getattr(args, name)
        if values is None:
            continue
        if len(values) == 1:
            out[name] = values[0]
        elif other and len(values) == len(data.labels):
            out[name] = xr.DataArray(np.reshape(values, shape), dims=other, coords=coords)
        else:
            raise ValueError(f"--{name.replace('_', '-')} has {len(values)} values; give one, or one per channel "
                             f"({len(data.labels)}: {', '.join(data.labels[:MAX_ROWS])})")
    return out


def _estimate(args):
    return tuple(s.strip() for s in args.estimate.split(",") if s.strip())


def _fit_dataset(args, data, flags):
    import kalmanscan as ks
    from kalmanscan.cli import io

    kw = dict(estimate=_estimate(args), backend=args.backend, progress=getattr(args, "progress", None))
    for name in ("shared", "method", "max_iter", "tol"):
        if getattr(args, name, None) is not None:
            kw[name] = getattr(args, name)
    if data.dt is not None:
        kw["dt"] = data.dt
    if "obs_var" in kw["estimate"]:
        _check_constant(data, len(kw["estimate"]), bool(kw.get("shared")))
    ds = ks.xr.fit(data.source(), data.dim, time_unit=data.time_unit, **flags, **kw)
    ds.attrs[io.CHANNELS_ATTR] = json.dumps(data.labels)
    return ds


def _check_constant(data, n_params, shared):
    """Name a constant channel (its obs_var has no maximum-likelihood estimate) before ks.fit does."""
    seen = ~np.isnan(data.y)
    lo = np.where(seen, data.y, np.inf).min(0)
    hi = np.where(seen, data.y, -np.inf).max(0)
    const = (lo == hi) & (seen.sum(0) >= n_params)
    if shared and not np.all(const | ~seen.any(0)):
        return
    for c in np.flatnonzero(const):
        every = ", as is every channel" if shared else ""
        raise ValueError(f"channel '{data.labels[c]}' is constant (every observed value is {lo[c]:g}){every}: "
                         "obs_var has no maximum-likelihood estimate (it goes to 0); leave the channel out "
                         "(--columns) or give --obs-var and leave obs_var out of --estimate")


def _model(args, data) -> dict:
    """NumPy keywords of the model (``theta, sigma, obs_var, ...``) from flags, --params or --fit."""
    return {k: data.flat(k, v) for k, v in _model_params(args, data).items()}


def _model_params(args, data) -> dict:
    """The model's keywords for ``ks.xr`` (scalars or DataArrays over the non-time dims) from
    flags, --params or --fit."""
    import kalmanscan as ks
    from kalmanscan.cli import io

    flags = _flag_params(args, data)
    if args.fit:
        if args.params:
            raise ValueError("--fit and --params exclude each other")
        ds = _fit_dataset(args, data, flags)
        print_fit(ds, data, heading="fitted model")
        params = ks.xr.params(ds)
    elif args.params:
        params = {**io.read_params(args.params, data.da, data.dim), **flags}
    else:
        params = flags
    unit = params.pop("time_unit", None)
    if unit is not None and data.time_unit is not None and \
            ks.xr.parse_time_unit(unit) != ks.xr.parse_time_unit(data.time_unit):
        raise ValueError(f"the parameters were fitted with time unit {unit} (theta and sigma are per {unit}), "
                         f"but --time-unit is {data.time_unit}; give --time-unit {unit}")
    missing = [f"--{k.replace('_', '-')}" for k in ("theta", "sigma", "obs_var") if k not in params]
    if missing:
        raise ValueError(f"the model needs {', '.join(missing)} (or --params FILE from 'kalmanscan fit', or --fit)")
    return params


def _read_and_run(args, step, op):
    """Read the input, build the model (from flags, a parameter file or a fit) and run ``op``
    (``ks.filter`` or ``ks.smooth``) on it: the first three stages of filter, smooth, calibrate."""
    step("read")
    data = _Data(args)
    step("fit" if args.fit else "model")
    model = _model(args, data)
    step(op.__name__)
    return data, op(data.y, **model, **data.steps(), backend=args.backend)


def _run_filter(args, smooth: bool) -> int:
    import kalmanscan as ks
    from kalmanscan.cli import io

    _check_outputs(args)
    if io.file_format(args.input) == "zarr":
        return _run_chunked(args, smooth)
    with _stages(args, 3) as step:
        data, post = _read_and_run(args, step, ks.smooth if smooth else ks.filter)
        ds = ks.xr.to_dataset(post, data.source(), data.dim, time_unit=data.time_unit, level=args.level)
        if data.dt is not None:
            if data.dim in data.da.coords:  # the file's times (dates too) label the rows; the model used dt
                ds = ds.assign_coords({data.dim: data.da[data.dim]})
            ds.attrs["time_unit"] = f"steps of dt = {data.dt:g}"
        if args.output:
            step("write")
            io.write_dataset(ds, args.output, data.dim, data.da.attrs.get("time_column"))
        if args.plot:
            step("plot")
            plot_bands(post, data, ds.attrs["z"], args.level, args.plot)
    print(f"{'smoothed' if smooth else 'filtered'} {args.input}: T = {data.y.shape[0]}, "
          f"{data.y.shape[1]} channel(s), {ds.attrs['time_unit']}")
    _summary(args, data.labels, np.isnan(data.y).sum(0), post.loglik, post.mean[-1],
             ds.attrs["z"] * np.sqrt(post.var[-1]))
    return 0


def _summary(args, labels, missing, loglik, mean, band) -> None:
    """The per-channel table a filter or smoother prints (at most :data:`MAX_ROWS` rows), then
    what was written."""
    rows = [[lab, str(int(missing[c])), f"{loglik[c]:.6g}", f"{mean[c]:.6g}", f"+/- {band[c]:.4g}"]
            for c, lab in enumerate(labels)]
    for line in table(["channel", "missing", "loglik", "last mean", f"{args.level:.0%} band"], rows[:MAX_ROWS]):
        print(line)
    if len(rows) > MAX_ROWS:
        print(f"  ... and {len(rows) - MAX_ROWS} more channels")
    _wrote(args.output, args.plot)


def _run_chunked(args, smooth: bool) -> int:
    """``filter``/``smooth`` of a Zarr store chunk by chunk (``ks.xr`` on its dask chunks, along
    time too): nothing but one block a task is held in memory; the result goes to a Zarr output
    with the same chunks, and the summary is read back from it."""
    import xarray as xr

    import kalmanscan as ks
    from kalmanscan.cli import io

    if args.fit or args.plot:
        raise ValueError("--fit and --plot need the record in memory; a Zarr input is filtered chunk by chunk "
                         "(give the model as flags or --params, and plot from the output)")
    if not args.output or io.file_format(args.output, "output") != "zarr":
        raise ValueError("a Zarr input is filtered chunk by chunk into a Zarr output: give -o OUT.zarr")
    with _stages(args, 3) as step:
        step("read")
        data = _Data(args, lazy=True)
        step("model")
        params = _model_params(args, data)
        steps = {} if data.dt is None else {"dt": data.dt}
        op = ks.xr.smooth if smooth else ks.xr.filter
        step("write")
        ds = op(data.source(), data.dim, time_unit=data.time_unit, level=args.level, backend=args.backend,
                **params, **steps)
        io.write_dataset(ds, args.output, data.dim)
    with xr.open_zarr(args.output) as out:
        last = out.isel({data.dim: -1})
        loglik, mean, var = (np.ravel(last[k].values) for k in ("loglik", "mean", "var"))
        z = out.attrs["z"]
        unit = out.attrs["time_unit"]
    missing = np.ravel(data.da.isnull().sum(data.dim).values)
    print(f"{'smoothed' if smooth else 'filtered'} {args.input}: T = {data.da.sizes[data.dim]}, "
          f"{len(data.labels)} channel(s), {unit}, chunk by chunk")
    _summary(args, data.labels, missing, loglik, mean, z * np.sqrt(var))
    return 0


@contextlib.contextmanager
def _stages(args, base):
    """``step(name)``: advance a tqdm bar over the stages of a command (read, fit, filter, write,
    plot): ``base`` stages plus one per output file. Shown with ``--progress``, or by default on a
    terminal for inputs of ``_LONG_BYTES``."""
    from tqdm.auto import tqdm

    show = args.progress
    if show is None:
        show = sys.stderr.isatty() and os.path.isfile(args.input) and os.path.getsize(args.input) >= _LONG_BYTES
    total = base + sum(bool(getattr(args, k, None)) for k in ("output", "plot"))
    with tqdm(total=total, desc=f"kalmanscan {args.command}", unit="stage", disable=not show, leave=False) as bar:
        started = []

        def step(name):
            if started:
                bar.update(1)
            started.append(name)
            bar.set_postfix_str(name)

        yield step
        bar.update(1)
        bar.refresh()  # show the final count even when the last update fell inside tqdm's mininterval


def _wrote(*paths):
    for path in paths:
        if path:
            print(f"wrote {path}")


def _run_fit(args) -> int:
    from kalmanscan.cli import io

    _check_outputs(args)
    with _stages(args, 2) as step:
        step("read")
        data = _Data(args)
        step("fit")
        ds = _fit_dataset(args, data, _flag_params(args, data))
        if args.output:
            step("write")
            io.write_dataset(ds, args.output, data.dim)
    print_fit(ds, data, heading=f"fit of {args.input}")
    _wrote(args.output)
    return 0


def _run_calibrate(args) -> int:
    import kalmanscan as ks

    _check_outputs(args)
    with _stages(args, 3) as step:
        data, post = _read_and_run(args, step, ks.filter)
        report = ks.diagnostics.report(post, data.y, alpha=args.alpha)
        if args.plot:
            step("plot")
            plot_calibration(post, data, args.plot)
    print(f"calibration of the filter on {args.input} ({data.y.shape[1]} channel(s) pooled)")
    print(report)
    _wrote(args.plot)
    return 1 if args.strict and not report.calibrated else 0


def _check_outputs(args):
    """Before any work: no output onto the input or the --params file, a known -o suffix, and
    -o and --plot naming different files."""
    from kalmanscan.cli import io

    outputs = [p for p in (getattr(args, "output", None), getattr(args, "plot", None)) if p]
    for path in outputs:
        io.check_output(path, [args.input])
        io.check_output(path, [getattr(args, "params", None)], role="parameter")
    if getattr(args, "output", None):
        io.file_format(args.output, "output")
    if len(outputs) == 2 and io.same_file(*outputs):
        raise ValueError(f"-o and --plot both name the file '{outputs[1]}'; give the two outputs different names")


def _values(text):
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or comma-separated numbers, got {text!r}") from None


def _parents():
    data = argparse.ArgumentParser(add_help=False)
    g = data.add_argument_group("input")
    g.add_argument("input", help="CSV (time column + channel columns) or NetCDF file")
    g.add_argument("--time-col", help="CSV: the time column (default: the first column)")
    g.add_argument("--columns", help="CSV: comma-separated channel columns (default: all but the time column)")
    g.add_argument("--var", help="NetCDF: the data variable (default: the only one with the time dimension)")
    g.add_argument("--dim", default="time", help="the time dimension (default: %(default)s)")
    g.add_argument("--time-unit", help="unit of date times, e.g. 1D, 1h, 30s (required for dates)")
    g.add_argument("--dt", type=float, help="regular step, ignoring the times in the file")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show progress bars (default: on a terminal, for long work)")
    model = argparse.ArgumentParser(add_help=False)
    g = model.add_argument_group("model (one value, or one per channel separated by commas)")
    for name in _MODEL_FLAGS:
        g.add_argument(f"--{name.replace('_', '-')}", dest=name, type=_values, metavar="X[,X...]", help=_HELP[name])
    g.add_argument("--estimate", default="theta,sigma,obs_var",
                   help="names to estimate (fit, --fit; default: %(default)s)")
    g.add_argument("--backend", default="auto", help="filter backend (default: %(default)s)")
    source = argparse.ArgumentParser(add_help=False)
    g = source.add_argument_group("parameters from a fit")
    g.add_argument("--params", help="fit result written by 'kalmanscan fit -o' (NetCDF or CSV)")
    g.add_argument("--fit", action="store_true", help="fit the model first (flags are initial guesses)")
    return data, model, source


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kalmanscan",
                                     description="Parallel Kalman filtering with honest uncertainty.")
    sub = parser.add_subparsers(dest="command", required=True)
    data, model, source = _parents()
    for name, smooth in (("filter", False), ("smooth", True)):
        p = sub.add_parser(name, parents=[data, model, source],
                           help=f"{name} a series; write NetCDF/CSV (-o) and a PNG (--plot)")
        p.add_argument("-o", "--output", help="output file, .nc or .csv")
        p.add_argument("--plot", help="PNG of the belief bands")
        p.add_argument("--level", type=float, default=0.95, help="credible band level (default: %(default)s)")
        p.set_defaults(func=lambda a, s=smooth: _run_filter(a, s))
    p = sub.add_parser("fit", parents=[data, model], help="maximum-likelihood parameters; write them with -o")
    p.add_argument("-o", "--output", help="output file, .nc or .csv (read back with --params)")
    p.add_argument("--shared", action="store_true", help="one parameter set for all channels")
    p.add_argument("--method", choices=("lbfgs", "adam"), default="lbfgs")
    p.add_argument("--max-iter", type=int)
    p.add_argument("--tol", type=float)
    p.set_defaults(func=_run_fit)
    p = sub.add_parser("calibrate", parents=[data, model, source], help="print the calibration report of the filter")
    p.add_argument("--alpha", type=float, default=0.05, help="false-alarm rate of the verdict (default: %(default)s)")
    p.add_argument("--plot", help="PNG of the PIT histogram, reliability diagram, NIS and belief band")
    p.add_argument("--strict", action="store_true", help="exit with status 1 when not calibrated")
    p.set_defaults(func=_run_calibrate)
    demo = sub.add_parser("demo", help="filter the bundled datasets, print a summary, write a PNG")
    demo.add_argument("--out", default="kalmanscan-demo.png", help="PNG to write (default: %(default)s)")
    demo.add_argument("--backend", default="auto", help="filter backend (default: %(default)s)")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line on ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as err:
        print(f"kalmanscan {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
