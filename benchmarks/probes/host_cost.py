"""The host work of the public calls outside their kernel launches, on any machine.

The Triton kernels of the filter and of the KLA scan are replaced by no-ops, so what is timed is
the Python and torch work around them: ``ks.filter`` (host parameters, a small float32 series)
and its stages (``prepare``, the triton backend, ``make_posterior``), and ``ks.nn.kla_scan``
against its kernels' wrapper ``kla_scan_triton`` and its value checks. On a GPU host each call
adds its Triton launches (three for the filter's walks, one or two for the scan) and the device's
allocations; on a CPU the shapes are kept small so that allocations stay cheap. Best of twenty
rounds of ``--calls`` calls each, microseconds per call.

    TRITON_INTERPRET=1 python -m benchmarks.probes.host_cost [--calls 300] [--out host_cost.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

import torch

import kalmanscan as ks
from kalmanscan.inference.filtering import make_posterior
from kalmanscan.problem.prepare import prepare
from kalmanscan.ops.filter.triton import backend as filter_triton
from kalmanscan.ops.kla import dispatch as kla_dispatch
from kalmanscan.ops.kla.triton.backend import kla_scan_triton



def launchers() -> list[tuple[object, str]]:
    """``(module, name)`` of each Triton kernel the filter's and the scan's triton backends launch:
    the names ending in ``_kernel`` in their loaded modules."""
    packages = ("kalmanscan.ops.filter.triton", "kalmanscan.ops.kla.triton")
    modules = [m for n, m in sorted(sys.modules.items()) if m is not None and n.startswith(packages)]
    return [(m, name) for m in modules for name in vars(m) if name.endswith("_kernel")]


_INPUTS: set[int] = set()
"""Storage addresses of the probe's own inputs, which a stand-in kernel leaves alone."""


class _NoLaunch:
    """Stands for a Triton kernel: ``kernel[grid](...)`` launches nothing; it zeroes its floating
    tensor arguments other than the probe's inputs (the buffers the kernel would have written), so
    that the call's check of its result (finite from finite inputs) passes."""

    def __getitem__(self, grid):
        return _zero_outputs


def _zero_outputs(*args, **kwargs):
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.untyped_storage().data_ptr() not in _INPUTS:
            x.zero_()


def _inputs(*tensors: torch.Tensor) -> None:
    _INPUTS.update(x.untyped_storage().data_ptr() for x in tensors)


def per_call_us(fn, calls: int) -> float:
    """Best of twenty rounds, microseconds per call (the least disturbed round)."""
    for _ in range(min(calls, 100)):
        fn()
    best = float("inf")
    for _ in range(20):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def filter_rows(calls: int) -> dict:
    y = torch.randn(64, 8)
    _inputs(y)
    kw = dict(theta=0.3, sigma=0.5, obs_var=0.2, backend="triton")
    p = prepare(y, **kw)
    out = filter_triton.filter(p)
    return {
        "ks.filter": per_call_us(lambda: ks.filter(y, **kw), calls),
        "ks.filter check_finite=False": per_call_us(lambda: ks.filter(y, check_finite=False, **kw), calls),
        "ks.filter mean,var check_finite=False": per_call_us(
            lambda: ks.filter(y, check_finite=False, outputs=("mean", "var"), **kw), calls),
        "prepare": per_call_us(lambda: prepare(y, check_y=False, **kw), calls),
        "triton backend": per_call_us(lambda: filter_triton.filter(p), calls),
        "make_posterior": per_call_us(lambda: make_posterior(p, dict(out)), calls),
    }


def kla_rows(calls: int) -> dict:
    g = torch.Generator().manual_seed(0)
    B, L, M, S = 2, 16, 8, 4
    v, lam_v = torch.randn(B, L, M, generator=g), torch.rand(B, L, M, generator=g) + 0.5
    k = torch.nn.functional.normalize(torch.randn(B, L, S, generator=g), dim=-1)
    decay, noise = torch.rand(M, S, generator=g) * 0.5 + 0.45, torch.rand(M, S, generator=g) * 0.1 + 0.01
    _inputs(v, lam_v, k, decay, noise)
    with torch.no_grad():
        return {
            "ks.nn.kla_scan": per_call_us(lambda: ks.nn.kla_scan(v, lam_v, k, k, decay, noise, backend="triton"),
                                          calls),
            "kla_scan_triton": per_call_us(lambda: kla_scan_triton(v, lam_v, k, k, decay, noise), calls),
            "value checks (queued and read)": per_call_us(lambda: kla_dispatch.decide_checks(
                kla_dispatch.queue_checks(lam_v, decay, noise, None), noise.dtype), calls),
            "shape checks": per_call_us(
                lambda: kla_dispatch.check_shapes(v, lam_v, k, k, decay, noise, None, "triton"), calls),
        }


@contextlib.contextmanager
def no_launches():
    """The filter's and the scan's kernels replaced by :class:`_NoLaunch` inside, restored after."""
    saved = [(module, name, getattr(module, name)) for module, name in launchers()]
    try:
        for module, name, _ in saved:
            setattr(module, name, _NoLaunch())
        yield
    finally:
        for module, name, kernel in saved:
            setattr(module, name, kernel)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--out", default=None, help="JSON file for the results")
    args = ap.parse_args(argv)
    with no_launches():
        rows = {"filter": filter_rows(args.calls), "kla": kla_rows(args.calls)}
    for group, row in rows.items():
        for name, us in row.items():
            print(f"{group:6s} {name:40s} {us:8.1f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(rows, torch=torch.__version__, calls=args.calls), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
