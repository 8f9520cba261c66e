"""The commands that read a series: ``filter``, ``smooth``, ``fit`` and ``calibrate``.

Each checks its outputs before any work (none onto the input or the ``--params`` file, a known
``-o`` suffix), then runs its stages (read, model or fit, filter, write, plot) under a progress
bar, and prints what it found and wrote. A Zarr input is filtered chunk by chunk into a Zarr
output, nothing but one block a task held in memory.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import numpy as np

from kalmanscan.cli.inputs import InputSeries, fit_dataset, flag_params, model, model_params
from kalmanscan.cli.report import MAX_ROWS, plot_bands, plot_calibration, print_fit, table

__all__ = ["run_filter", "run_fit", "run_calibrate"]

_LONG_BYTES = 20_000_000


def _read_and_run(args, step, op):
    """Read the input, build the model (from flags, a parameter file or a fit) and run ``op``
    (``ks.filter`` or ``ks.smooth``) on it: the first three stages of filter, smooth, calibrate."""
    step("read")
    data = InputSeries(args)
    step("fit" if args.fit else "model")
    params = model(args, data)
    step(op.__name__)
    return data, op(data.y, **params, **data.steps(), backend=args.backend)


def run_filter(args: argparse.Namespace, smooth: bool) -> int:
    """``kalmanscan filter`` (or ``smooth``): the series filtered (or smoothed) in memory, or a Zarr
    store chunk by chunk; the result written with ``-o``, the bands drawn with ``--plot``, and a
    per-channel summary printed. Returns the exit status."""
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
        data = InputSeries(args, lazy=True)
        step("model")
        params = model_params(args, data)
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


def run_fit(args: argparse.Namespace) -> int:
    """``kalmanscan fit``: maximum-likelihood parameters, printed and written with ``-o``."""
    from kalmanscan.cli import io

    _check_outputs(args)
    with _stages(args, 2) as step:
        step("read")
        data = InputSeries(args)
        step("fit")
        ds = fit_dataset(args, data, flag_params(args, data))
        if args.output:
            step("write")
            io.write_dataset(ds, args.output, data.dim)
    print_fit(ds, data, heading=f"fit of {args.input}")
    _wrote(args.output)
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    """``kalmanscan calibrate``: the filter's calibration report, printed (and drawn with ``--plot``);
    exit status 1 under ``--strict`` when it is not calibrated."""
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
