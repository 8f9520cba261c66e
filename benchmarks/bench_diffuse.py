"""The exact diffuse prior (``init_var=inf``) beside the same call with a finite prior, in one
process, on the CPU. A script, not a test.

    python -m benchmarks run diffuse [--out diffuse.json] [--repeat 7]

For each shape ``(T, C)`` of float64 NumPy data: ``ks.filter`` and ``ks.smooth`` returning every
field with ``init_var=1.0`` and with ``init_var=inf``, then with ``init_var=inf`` where every third
channel is missing its first five steps (the leading gaps take per-step identity transitions).
Median of ``--repeat`` wall times after one warm-up call, ms.
"""

from __future__ import annotations

import math

import numpy as np

import kalmanscan as ks
from benchmarks.common import shapes_parser, wall_times, write_shape_rows

SHAPES = [(1000, 1000), (100, 10000), (10000, 100)]
PARAMS = dict(theta=0.3, sigma=1.0, obs_var=0.5)


def median_ms(fn, repeat):
    return 1e3 * float(np.median(wall_times(fn, repeat)))


def row(T, C, repeat):
    y = np.random.default_rng(0).normal(size=(T, C))
    gaps = y.copy()
    gaps[:5, ::3] = np.nan
    out = dict(T=T, C=C)
    for name, public in (("filter", ks.filter), ("smooth", ks.smooth)):
        out[f"{name}_finite_ms"] = median_ms(lambda: public(y, init_var=1.0, **PARAMS), repeat)
        out[f"{name}_diffuse_ms"] = median_ms(lambda: public(y, init_var=math.inf, **PARAMS), repeat)
        out[f"{name}_diffuse_gaps_ms"] = median_ms(lambda: public(gaps, init_var=math.inf, **PARAMS), repeat)
    return out


def parser():
    """The command line: ``--out`` (JSON file) and ``--repeat``."""
    return shapes_parser(__doc__.splitlines()[0])


def main(argv: list[str] | None = None) -> dict:
    return write_shape_rows(parser().parse_args(argv), SHAPES, row)


if __name__ == "__main__":
    main()
