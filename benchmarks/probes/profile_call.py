"""The public ``ks.filter`` call under a profiler, as a user calls it. A script, not a test.

    python -m benchmarks.probes.profile_call --C 64 --T 2048 --device-theta
    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section SchedulerStats \\
        python -m benchmarks.probes.profile_call --C 1 --T 4194304 --outputs mean,var --ncu

``y`` is a CUDA float32 ``(T, C)``; ``theta = 0.2`` (a ``(C,)`` CUDA tensor with
``--device-theta``), ``sigma = 0.5``, ``obs_var = 0.3``, triton backend, checked. Five calls warm
up. Without ``--ncu``: twenty calls timed back to back (host wall time per call, with how many ran
again because the deferred checks refuted an assumed fact), then ten under ``torch.profiler``,
whose table by host time is printed. With ``--ncu``: one call between ``cudaProfilerStart`` and
``cudaProfilerStop``, so ``--profile-from-start off`` reports exactly its kernels.
"""

import argparse
import importlib
import time

import torch
from torch.profiler import ProfilerActivity, profile

import kalmanscan as ks

filtering = importlib.import_module("kalmanscan.inference.filtering")


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.probes.profile_call``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--C", type=int, default=64)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--device-theta", action="store_true")
    ap.add_argument("--outputs", default=None, help="comma-separated fields (default: none given, the default call)")
    ap.add_argument("--ncu", action="store_true")
    return ap


def main(argv: list[str] | None = None):
    args = parser().parse_args(argv)
    y = torch.randn(args.T, args.C, device="cuda")
    theta = torch.full((args.C,), 0.2, device="cuda") if args.device_theta else 0.2
    kw = dict(theta=theta, sigma=0.5, obs_var=0.3, backend="triton")
    if args.outputs:
        kw["outputs"] = tuple(args.outputs.split(","))
    for _ in range(5):
        ks.filter(y, **kw)
    torch.cuda.synchronize()
    if args.ncu:
        torch.cuda.profiler.start()
        ks.filter(y, **kw)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return
    reruns = [0]
    confirmed = filtering.confirmed

    def counted(*a, **k):
        ok = confirmed(*a, **k)
        reruns[0] += not ok
        return ok

    filtering.confirmed = counted
    t0 = time.perf_counter()
    for _ in range(20):
        ks.filter(y, **kw)
    torch.cuda.synchronize()
    print(f"C={args.C} T={args.T} device theta={args.device_theta}: "
          f"{(time.perf_counter() - t0) / 20 * 1e3:.3f} ms a call, {reruns[0]} of 20 ran again")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            ks.filter(y, **kw)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
