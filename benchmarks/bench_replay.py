"""Small ``ks.filter`` calls replayed from CUDA graphs against the same calls launched eagerly, in
one process on the GPU (:mod:`kalmanscan.ops.filter.triton.replay`).

For each case (a shape, checked or not, every field or the mean and variance) and each variant
(``kalmanscan.tuning.tuned(replay=...)`` on or off), interleaved over ``--rounds`` rounds, the
two timings of :mod:`benchmarks.bench_api`: the host wall time of one synchronised call (*alone*,
``alone_ms``) and the time per call back to back (*queued*, ``median_ms``); the median over the
rounds, microseconds. The kernels' eager wrapper is timed the same way in both
columns: it never replays, so its two columns show the host's noise between them. A case past the
replay's size (all fields at C = 512, T = 2048) runs eagerly in both columns too.

``--compare check`` sets the variants to ``y``'s inf check instead: by result (the default
threshold ``kalmanscan.tuning.Tuning.y_by_result``) against a reduction queued ahead of the kernels for
every ``y`` (threshold 0), replay on in both; only the checked cases differ.

    python -m benchmarks run replay [--rounds 5] [--compare replay|check] [--out replay.json]
    python -m benchmarks run replay --shapes 4194304x1,16777216x1 --out long.json   # few long series
"""

from __future__ import annotations

import argparse
import statistics

import torch

import kalmanscan as ks
from kalmanscan import tuning
from benchmarks.common import alone_ms, commit, initial_state, median_ms, save, shape_list
from kalmanscan.problem.prepare import prepare
from kalmanscan.ops.filter.triton import backend as filter_triton

SHAPES = [(2048, 64), (256, 64), (2048, 512)]   # (T, C)
KW = dict(theta=0.2, sigma=0.5, obs_var=0.3)


def cases(shapes=SHAPES) -> dict:
    """``{name: call}`` of every case at each ``(T, C)`` of ``shapes``."""
    out = {}
    for shape in shapes:
        y = torch.randn(shape, device="cuda")
        out[f"ks.filter C={shape[1]} T={shape[0]} checked"] = lambda y=y: ks.filter(y, backend="triton", **KW)
        out[f"ks.filter C={shape[1]} T={shape[0]} unchecked"] = (
            lambda y=y: ks.filter(y, backend="triton", check_finite=False, **KW))
        out[f"ks.filter C={shape[1]} T={shape[0]} mean,var unchecked"] = (
            lambda y=y: ks.filter(y, backend="triton", check_finite=False, outputs=("mean", "var"), **KW))
        out[f"ks.filter C={shape[1]} T={shape[0]} mean,var checked"] = (
            lambda y=y: ks.filter(y, backend="triton", outputs=("mean", "var"), **KW))
    y = torch.randn(shapes[0], device="cuda")
    p = prepare(y, backend="triton", **KW)
    views, init = filter_triton.kernel_views(p), initial_state(p)
    out[f"filter_forward (eager kernels) C={shapes[0][1]} T={shapes[0][0]}"] = (
        lambda: filter_triton.filter_forward(views, init, posterior=True))
    return out


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks run replay``."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--compare", choices=("replay", "check"), default="replay")
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default=None, help="TxC,... (default: SHAPES)")
    return ap


def main(argv: list[str] | None = None):
    args = parser().parse_args(argv)
    shapes = SHAPES if args.shapes is None else shape_list(args.shapes)
    calls = cases(shapes)
    variants = (dict(replay=dict(replay=True), eager=dict(replay=False)) if args.compare == "replay" else
                dict(by_result=dict(y_by_result=tuning.DEFAULT.y_by_result), ahead=dict(y_by_result=0)))
    res = {(c, v): {"alone": [], "queued": []} for c in calls for v in variants}
    with torch.no_grad():
        for knobs in variants.values():
            with tuning.tuned(**knobs):
                for fn in calls.values():
                    for _ in range(tuning.current().replay_after + 2):
                        fn()
        for _ in range(args.rounds):
            for v, knobs in variants.items():
                with tuning.tuned(**knobs):
                    for c, fn in calls.items():
                        res[(c, v)]["alone"].append(alone_ms(fn) * 1e3)
                        res[(c, v)]["queued"].append(median_ms(fn) * 1e3)
    rows = []
    print(f"{torch.cuda.get_device_name()}: wall of one synchronised call alone / per call queued, medians, us")
    for c in calls:
        medians = {f"{v}_{k}": statistics.median(res[(c, v)][k]) for v in variants for k in ("alone", "queued")}
        row = {"case": c, **medians}
        rows.append(row)
        print(f"{c:<48}", "  ".join(f"{v}: {row[v + '_alone']:7.1f} / {row[v + '_queued']:7.1f}" for v in variants))
    save(args.out, {"device": torch.cuda.get_device_name(), "commit": commit(), "compare": args.compare, "rows": rows})


if __name__ == "__main__":
    main()
