"""The filter's forward beside a plain first-order linear recurrence. A script, not a test.

    python -m benchmarks run recurrence --out recurrence.json            # on the GPU
    python -m benchmarks run recurrence --out quick.json --quick         # CPU smoke test (interpreter)

In one process, at (C, T) = (4096, 32768) and (1, 2^22), with no value and with 10% of values
missing at random: the triton backend's forward writing the filtered mean and variance (12 bytes
per element: ``y`` in, two fields out) and its forward (four saved fields) plus backward given the
cotangents of the mean and precision (the walks, or the tiles for the one long series; complete
stretches take their aggregate in closed form), the same again with every stretch composed
(``walk_closed`` and ``tile_closed`` off), and the public ``ks.filter`` writing the mean and
variance (checked, calls queued);
accelerated-scan's Triton first-order recurrence ``x_t = a_t x_{t-1} + b_t``
(``accelerated_scan.scalar.scan``, layout ``(B, C, T)``: forward 12 bytes per element, and
forward+backward) when it is installed; the device-to-device copy bandwidth. Times are CUDA-graph
medians (the GPU's time); each row prints its fraction of copy and its ratio to accelerated-scan.
Before timing, the float32 forward is checked on the device against the float64 walks.
``--quick`` runs every step on the CPU under ``TRITON_INTERPRET=1`` at tiny sizes (wall-clock
times, meaningless as speeds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

QUICK = "--quick" in sys.argv
if QUICK:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import kalmanscan as ks  # noqa: E402
from benchmarks.common import commit, copy_bandwidth, graph_ms, initial_state, median_ms, save  # noqa: E402
from kalmanscan.problem.prepare import prepare  # noqa: E402
from kalmanscan.ops.filter.triton import backend as triton_backend  # noqa: E402
from kalmanscan.ops.filter.triton.config import DEFAULT_CONFIG  # noqa: E402

SHAPES = [(4096, 32768), (1, 1 << 22)]
QUICK_SHAPES = [(8, 64), (1, 256)]
MISSING = (0.0, 0.1)
FWD_BYTES = 12


def problem(T, C, missing, device, dtype=torch.float32, seed=0):
    """``(views, init, y, kw)`` of a static-parameter problem of one ``(T, C)`` series with a fraction
    ``missing`` of NaN values at random."""
    g = torch.Generator(device=device).manual_seed(seed)
    y = torch.randn(T, C, device=device, dtype=dtype, generator=g)
    y[torch.rand(T, C, device=device, generator=g) < missing] = float("nan")
    theta = torch.rand(C, device=device, generator=g, dtype=dtype) + 0.05
    sigma = torch.rand(C, device=device, generator=g, dtype=dtype) + 0.1
    obs_var = torch.rand(C, device=device, generator=g, dtype=dtype) + 0.1
    kw = dict(theta=theta, sigma=sigma, obs_var=obs_var, init_var=sigma**2 / (2 * theta))
    p = prepare(y, **kw, backend="triton")
    return triton_backend.kernel_views(p), initial_state(p), y, kw


def timer(fn):
    """Milliseconds of ``fn``: CUDA-graph median on the GPU, one wall-clock call under ``--quick``."""
    if not QUICK:
        return graph_ms(fn)
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def check(views, init, config):
    """Worst relative error of the float32 mean and variance under ``config`` against the float64
    walks on the same inputs."""
    views64 = {k: v.double() for k, v in views.items()}
    want = triton_backend.filter_forward(views64, init.double(), posterior=("mean", "var"), config=DEFAULT_CONFIG)
    got = triton_backend.filter_forward(views, init, posterior=("mean", "var"), config=config)
    scale = want["mean"].abs().max()
    return max(float((got["mean"].double() - want["mean"]).abs().max() / scale),
               float(((got["var"].double() - want["var"]).abs() / want["var"]).max()))


def ours(views, init, config):
    """Forward (mean and variance) and forward+backward milliseconds of the triton backend."""
    T, C = views["y"].shape[1:]
    cot = (torch.randn(1, T, C, device=views["y"].device), torch.randn(1, T, C, device=views["y"].device), None, None)

    def fwd_bwd():
        o = triton_backend.filter_forward(views, init, config=config)
        triton_backend.filter_backward(views, init, o["mu"], o["lam"], cot, config)

    fwd = timer(lambda: triton_backend.filter_forward(views, init, posterior=("mean", "var"), config=config))
    return fwd, timer(fwd_bwd)


def accelerated_scan(T, C):
    """Forward and forward+backward milliseconds of accelerated-scan's Triton recurrence at
    ``(1, C, T)``, or ``None`` when it is not installed (or under ``--quick``)."""
    if QUICK:
        return None
    try:
        from accelerated_scan.scalar import scan
    except ImportError:
        return None
    forget = torch.rand(1, C, T, device="cuda")
    inputs = torch.randn(1, C, T, device="cuda")
    fwd = timer(lambda: scan(forget, inputs))
    f, x = forget.clone().requires_grad_(), inputs.clone().requires_grad_()
    grad = torch.randn(1, C, T, device="cuda")
    return fwd, timer(lambda: scan(f, x).backward(grad))


def public(y, kw):
    """Milliseconds of the public ``ks.filter(y, outputs=("mean", "var"))``, checked, calls queued
    back to back (the median of ``triton.testing.do_bench``, as ``benchmarks.bench_api``'s; one
    wall-clock call under ``--quick``)."""
    def call():
        return ks.filter(y, backend="triton", outputs=("mean", "var"), **kw)

    if QUICK:
        start = time.perf_counter()
        call()
        return 1e3 * (time.perf_counter() - start)
    return median_ms(call)


def row(T, C, missing, copy, config):
    views, init, y, kw = problem(T, C, missing, "cpu" if QUICK else "cuda")
    n = T * C
    out = dict(C=C, T=T, missing=missing)
    out["walks_err"] = check(views, init, config)
    out["walks_fwd_ms"], out["walks_fwd_bwd_ms"] = ours(views, init, config)
    out["walks_fwd_pct_copy"] = 100 * FWD_BYTES * n / out["walks_fwd_ms"] / 1e6 / copy
    out["public_fwd_ms"] = public(y, kw)
    # the composed branch: every stretch composes its steps (no closed form in the walks or the tiles)
    composed = dataclasses.replace(config, tile_closed=False, walk_closed=False)
    out["composed_err"] = check(views, init, composed)
    out["composed_fwd_ms"], out["composed_fwd_bwd_ms"] = ours(views, init, composed)
    out["composed_fwd_pct_copy"] = 100 * FWD_BYTES * n / out["composed_fwd_ms"] / 1e6 / copy
    scan_ms = accelerated_scan(T, C) if missing == 0.0 else None
    if scan_ms is not None:
        out["ascan_fwd_ms"], out["ascan_fwd_bwd_ms"] = scan_ms
        out["ascan_fwd_pct_copy"] = 100 * FWD_BYTES * n / scan_ms[0] / 1e6 / copy
    return out


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks run recurrence``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON file for the results")
    ap.add_argument("--quick", action="store_true", help="CPU smoke test under TRITON_INTERPRET=1, tiny sizes")
    return ap


def main(argv: list[str] | None = None):
    args = parser().parse_args(argv)
    copy = 2 * (1 << 20) * 4 / timer(lambda: torch.empty(1 << 20).copy_(torch.randn(1 << 20))) / 1e6 if QUICK \
        else copy_bandwidth()
    res = dict(commit=commit(), device="cpu (interpreter)" if QUICK else torch.cuda.get_device_name(),
               copy_GBps=copy, rows=[])
    for C, T in QUICK_SHAPES if QUICK else SHAPES:
        for missing in MISSING:
            res["rows"].append(row(T, C, missing, copy, DEFAULT_CONFIG))
            print(json.dumps(res["rows"][-1]), flush=True)
            save(args.out, res)
    print_table(res)


def print_table(res):
    print(f"copy {res['copy_GBps']:.0f} GB/s, commit {res['commit']}")
    print("| C | T | missing | ours fwd ms (% copy) | composed fwd ms (% copy) | public ks.filter ms | "
          "accelerated-scan fwd ms (% copy) | ours fwd+bwd ms | accelerated-scan fwd+bwd ms | "
          "ours / ascan fwd, fwd+bwd |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = {(r["C"], r["T"]): r for r in res["rows"] if "ascan_fwd_ms" in r}
    for r in res["rows"]:
        a = base.get((r["C"], r["T"]))
        ascan = f"{a['ascan_fwd_ms']:.3f} ({a['ascan_fwd_pct_copy']:.0f}%)" if a else ""
        ascan_both = f"{a['ascan_fwd_bwd_ms']:.3f}" if a else ""
        ratio = (f"{r['walks_fwd_ms'] / a['ascan_fwd_ms']:.2f}, {r['walks_fwd_bwd_ms'] / a['ascan_fwd_bwd_ms']:.2f}"
                 if a else "")
        composed = f"{r['composed_fwd_ms']:.3f} ({r['composed_fwd_pct_copy']:.0f}%)"
        print(f"| {r['C']} | {r['T']} | {r['missing']:.0%} | {r['walks_fwd_ms']:.3f} ({r['walks_fwd_pct_copy']:.0f}%) "
              f"| {composed} | {r['public_fwd_ms']:.3f} | {ascan} | {r['walks_fwd_bwd_ms']:.3f} | {ascan_both} "
              f"| {ratio} |")

if __name__ == "__main__":
    main()
