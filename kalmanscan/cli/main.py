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

This module builds the argument parser and runs the command it names: the commands that read a
series are in :mod:`kalmanscan.cli.commands`, their inputs and model in :mod:`kalmanscan.cli.inputs`,
the demo in :mod:`kalmanscan.cli.demo`.
"""

from __future__ import annotations

import argparse
import sys

from kalmanscan.cli.commands import run_calibrate, run_filter, run_fit
from kalmanscan.cli.demo import run_demo
from kalmanscan.cli.inputs import MODEL_FLAGS
from kalmanscan.cli.report import print_fit

__all__ = ["main", "build_parser", "print_fit"]

_HELP = {
    "theta": "mean-reversion rate >= 0 per time unit (0: random walk, needs --init-var)",
    "sigma": "diffusion scale >= 0",
    "obs_var": "observation noise variance > 0",
    "mean": "mean level (default 0)",
    "init_mean": "mean of the belief at the first time (default: --mean)",
    "init_var": "variance of the belief at the first time (default: stationary)",
}


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
    for name in MODEL_FLAGS:
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
        p.set_defaults(func=lambda a, s=smooth: run_filter(a, s))
    p = sub.add_parser("fit", parents=[data, model], help="maximum-likelihood parameters; write them with -o")
    p.add_argument("-o", "--output", help="output file, .nc or .csv (read back with --params)")
    p.add_argument("--shared", action="store_true", help="one parameter set for all channels")
    p.add_argument("--method", choices=("lbfgs", "adam"), default="lbfgs")
    p.add_argument("--max-iter", type=int)
    p.add_argument("--tol", type=float)
    p.set_defaults(func=run_fit)
    p = sub.add_parser("calibrate", parents=[data, model, source], help="print the calibration report of the filter")
    p.add_argument("--alpha", type=float, default=0.05, help="false-alarm rate of the verdict (default: %(default)s)")
    p.add_argument("--plot", help="PNG of the PIT histogram, reliability diagram, NIS and belief band")
    p.add_argument("--strict", action="store_true", help="exit with status 1 when not calibrated")
    p.set_defaults(func=run_calibrate)
    demo = sub.add_parser("demo", help="filter the bundled datasets, print a summary, write a PNG")
    demo.add_argument("--out", default="kalmanscan-demo.png", help="PNG to write (default: %(default)s)")
    demo.add_argument("--backend", default="auto", help="filter backend (default: %(default)s)")
    demo.set_defaults(func=run_demo)
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
