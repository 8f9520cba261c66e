"""Host timestamps of one synchronised public call on the GPU, by stage: when ``ks.filter`` leaves
``prepare``, the backend, ``make_posterior`` and ``y``'s check, when it returns and when the
device is done, beside its kernels' wrapper alone; and when ``kla_scan`` and its kernels' wrapper
return (host) against their span on the device. Medians over many calls, microseconds. A call
whose host path is longer than its kernels' device time is bound by the host when calls queue.

    python -m benchmarks.probes.host_stages [--C 64] [--T 2048] [--calls 300]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import kalmanscan as ks
from benchmarks.common import initial_state, make_inputs
from kalmanscan.inference import filtering
from kalmanscan.problem.prepare import prepare
from kalmanscan.ops.filter.triton import backend as filter_triton
from kalmanscan.ops.kla.triton.backend import kla_scan_triton

STAGES = ("prepare", "finite_problem", "run_backend", "make_posterior", "decide_y")


def _stamped(stamps):
    """Wrap the stages of ``ks.filter`` so each appends ``(name, time)`` to ``stamps`` on return."""
    def wrap(owner, name):
        f = getattr(owner, name)

        def g(*a, **k):
            out = f(*a, **k)
            stamps.append((name, time.perf_counter()))
            return out
        setattr(owner, name, g)
    for name in STAGES:
        wrap(filtering, name)


def timeline(fn, stamps, calls):
    """Median microseconds from the call's start to each stage, its return, the device's end
    (``synced``) and the span between events recorded before and after it (``device``)."""
    rows = []
    for _ in range(calls):
        torch.cuda.synchronize()
        stamps.clear()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        e0.record()
        fn()
        e1.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        rows.append({**{n: (t - t0) * 1e6 for n, t in stamps}, "return": (t1 - t0) * 1e6,
                     "synced": (t2 - t0) * 1e6, "device": e0.elapsed_time(e1) * 1e3})
    rows = rows[calls // 5:]
    return {k: statistics.median(r[k] for r in rows) for k in rows[-1]}


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.probes.host_stages``."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--C", type=int, default=64)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--calls", type=int, default=300)
    return ap


def main(argv: list[str] | None = None):
    args = parser().parse_args(argv)
    stamps = []
    _stamped(stamps)
    y = torch.randn(args.T, args.C, device="cuda")
    kw = dict(theta=0.2, sigma=0.5, obs_var=0.3)
    p = prepare(y, backend="triton", **kw)
    views, init = filter_triton.kernel_views(p), initial_state(p)
    xs = make_inputs(8, 2048, 1024, 16)
    cases = {"ks.filter": lambda: ks.filter(y, backend="triton", **kw),
             "ks.filter mean,var": lambda: ks.filter(y, backend="triton", outputs=("mean", "var"), **kw),
             "ks.filter check_finite=False": lambda: ks.filter(y, backend="triton", check_finite=False, **kw),
             "filter_forward (kernels)": lambda: filter_triton.filter_forward(views, init, posterior=True),
             "kla_scan B=8 L=2048 M=1024 S=16": lambda: ks.nn.kla_scan(*xs, backend="triton"),
             "kla_scan_triton (kernels)": lambda: kla_scan_triton(*xs)}
    with torch.no_grad():
        for name, fn in cases.items():
            t = timeline(fn, stamps, args.calls)
            print(f"{name:<34}", "  ".join(f"{k} {v:7.1f}" for k, v in t.items()), "us", flush=True)


if __name__ == "__main__":
    main()
