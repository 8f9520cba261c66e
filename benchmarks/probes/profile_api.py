"""Where the host time of a public ``ks.filter`` call goes on the GPU (a small shape, where the
fixed cost dominates): Python functions by their own time (cProfile) and torch operations by
their CPU and CUDA time (torch.profiler), over many synchronised calls.

    python -m benchmarks.probes.profile_api [--C 64] [--T 2048] [--calls 200]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import kalmanscan as ks


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.probes.profile_api``."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--C", type=int, default=64)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--outputs", default=None, help="comma-separated fields, e.g. mean,var")
    return ap


def main(argv: list[str] | None = None):
    args = parser().parse_args(argv)
    y = torch.randn(args.T, args.C, device="cuda")
    outputs = None if args.outputs is None else tuple(args.outputs.split(","))

    def call():
        ks.filter(y, theta=0.2, sigma=0.5, obs_var=0.3, backend="triton", outputs=outputs)
        torch.cuda.synchronize()

    for _ in range(10):
        call()
    t0 = time.perf_counter()
    for _ in range(args.calls):
        call()
    wall = (time.perf_counter() - t0) / args.calls * 1e3
    print(f"ks.filter C={args.C} T={args.T} outputs={outputs}: {wall:.3f} ms per synchronised call")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        call()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as tp:
        for _ in range(20):
            call()
    print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
