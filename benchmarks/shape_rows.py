"""A CPU benchmark over shapes: wall times of a call, and the script around a ``row(T, C, repeat)``
function (``--out``, ``--repeat``; one JSON row per shape, printed as it comes and saved with the
commit)."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence

from benchmarks.records import commit

__all__ = ["wall_times", "run_shapes", "shape_list"]


def shape_list(text: str) -> list[tuple[int, ...]]:
    """``"2x8192,8x2048"`` -> ``[(2, 8192), (8, 2048)]``: a command line's list of shapes."""
    return [tuple(int(x) for x in shape.split("x")) for shape in text.split(",")]


def wall_times(fn: Callable[[], object], repeat: int, warmup: bool = True) -> list[float]:
    """``repeat`` wall times of ``fn()`` in seconds, after one untimed call when ``warmup``."""
    if warmup:
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def run_shapes(description: str, shapes: Sequence[tuple[int, int]], row: Callable[[int, int, int], dict],
               repeat: int = 7) -> None:
    """Parse ``--out`` and ``--repeat``, run ``row(T, C, repeat)`` for each shape, print each row as
    JSON and write ``{"commit", "rows"}`` to ``--out``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", default=None)
    ap.add_argument("--repeat", type=int, default=repeat)
    args = ap.parse_args()
    res = dict(commit=commit(), rows=[])
    for T, C in shapes:
        res["rows"].append(row(T, C, args.repeat))
        print(json.dumps(res["rows"][-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
