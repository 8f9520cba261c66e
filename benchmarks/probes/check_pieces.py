"""Host cost of the pieces of ``y``'s inf check on a small GPU call, beside the public call checked
and not: host wall of one call followed by a synchronisation (``benchmarks.common.alone_ms``), medians,
microseconds.

    python -m benchmarks.probes.check_pieces [--T 2048] [--C 64]
"""

from __future__ import annotations

import argparse
import math

import torch

import kalmanscan as ks
from benchmarks.common import alone_ms
from kalmanscan.problem import checks

KW = dict(theta=0.2, sigma=0.5, obs_var=0.3)


def rows(y: torch.Tensor) -> dict:
    """``{name: call}``: the check's pieces, then the public call."""
    pinned, event = torch.empty((), pin_memory=True), torch.cuda.Event()
    loglik = ks.filter(y, backend="triton", **KW).loglik

    def preallocated():
        pinned.copy_(torch.nansum(y), non_blocking=True)
        event.record()
        event.synchronize()
        return math.isfinite(float(pinned))

    return {
        "empty (sync only)": lambda: None,
        "nansum launch": lambda: torch.nansum(y),
        "nansum + float": lambda: math.isfinite(float(torch.nansum(y))),
        "nansum + .to(cpu,nb) + Event": lambda: checks.Ahead(torch.nansum(y)),
        "nansum ahead + decide_y": lambda: checks.decide_y(y, checks.queue_y_sum(y), loglik),
        "decide_y by result": lambda: checks.decide_y(y, None, loglik),
        "nansum + preallocated pinned + event": preallocated,
        "witness sum + float (by-result)": lambda: checks.finite_sum(loglik),
        "Event() + record": lambda: torch.cuda.Event().record(),
        "filter checked": lambda: ks.filter(y, backend="triton", **KW),
        "filter unchecked": lambda: ks.filter(y, backend="triton", check_finite=False, **KW),
        "filter mean,var checked": lambda: ks.filter(y, backend="triton", outputs=("mean", "var"), **KW),
        "filter mean,var unchecked": lambda: ks.filter(y, backend="triton", check_finite=False,
                                                       outputs=("mean", "var"), **KW),
    }


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.probes.check_pieces``."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--C", type=int, default=64)
    return ap


def main(argv: list[str] | None = None):
    args = parser().parse_args(argv)
    calls = rows(torch.randn(args.T, args.C, device="cuda"))
    for _ in range(2):
        for name, fn in calls.items():
            print(f"{name:40s} {alone_ms(fn, reps=300) * 1e3:8.1f}", flush=True)
        print()


if __name__ == "__main__":
    main()
