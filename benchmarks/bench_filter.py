"""GPU check and benchmark of the triton filter backend. A script, not a test.

    python -m benchmarks run filter --out filter.json     # check on the GPU, then time
    python -m benchmarks run filter --jax --out jax.json  # the JAX two-scan baseline alone

Part 1 (:mod:`benchmarks.filter_checks`) checks the kernels on the GPU against float64: the
sequential reference on random problems
(static and per-step parameters, irregular times, missing values, one and many stretches), the
float64 torch backend at the benchmark's regimes (many stretches: the carry scan on the GPU), the
gradients against float64 torch autograd, and the float32 error over the extreme-parameter matrix.
Part 2 times, with ``triton.testing.do_bench`` medians (eager: the host's launches included) and
``do_bench_cudagraph`` medians (CUDA-graph replay: the GPU's time, from which GB/s and % of copy
are computed), at (C, T) = (4096, 32768), (64, 2^20),
(1, 2^22), (1, 2^24): the fused forward writing mean and precision (12 bytes per element moved at
the least: y in, two outputs), the forward writing all four saved outputs plus the backward
kernels given the cotangents of mean and precision only (those of the predicted moments absent,
so never read): 36 bytes per element at the least, forward 12 and backward 24 (reads y, the two
present cotangents and the saved mean and precision, writes grad y); the device-to-device copy
bandwidth measured in the same run, the torch backend, a time-stepped torch loop at a small T (per
element) and, from a separate process, the same algebra as two ``jax.lax.associative_scan`` passes.
``--sweep`` also times launch variants (:data:`SWEEP`: fields of
:class:`~kalmanscan.ops.filter.triton.config.FilterConfig` changed from ``DEFAULT_CONFIG``, each passed to
the launch wrappers of :mod:`kalmanscan.ops.filter.triton`); with ``--sweep-lanes``, the walks'
time split (:data:`LANES`) at each of ``--sweep-shapes``, with ``--sweep-split`` the split and the
lanes per program together (:data:`SPLITS`):

    python -m benchmarks run filter --out lanes.json --sweep-only --sweep-lanes \
        --sweep-shapes 4096x32768,16384x8192,65536x2048,1024x131072,256x524288,64x1048576
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from benchmarks import filter_checks as fc
from benchmarks.common import commit, copy_bandwidth, graph_ms, initial_state, median_ms, save, shape_list

from kalmanscan.problem.prepare import prepare
from kalmanscan.ops.filter import torch as torch_backend
from kalmanscan.ops.filter.triton import backend as triton_backend
from kalmanscan.ops.filter.triton.config import DEFAULT_CONFIG, FilterConfig

SHAPES = [(4096, 32768), (64, 1 << 20), (1, 1 << 22), (1, 1 << 24)]
FWD_BYTES = 12
FWD_BWD_BYTES = 36


def static_problem(T, C, dtype=torch.float32, seed=0, device="cuda"):
    """``(views, init, p)``: a static-parameter problem ``p`` (a validated
    :class:`~kalmanscan.problem.prepare.Problem` of one ``(T, C)`` series, stationary initial belief), its
    ``(1, T, C)`` views in kernel order and initial state ``(1, 2, C)``: precision and
    information mean."""
    g = torch.Generator(device=device).manual_seed(seed)
    y = torch.randn(T, C, device=device, dtype=dtype, generator=g)
    theta = torch.rand(C, device=device, generator=g, dtype=dtype) + 0.05
    sigma = torch.rand(C, device=device, generator=g, dtype=dtype) + 0.1
    obs_var = torch.rand(C, device=device, generator=g, dtype=dtype) + 0.1
    p = prepare(y, theta=theta, sigma=sigma, obs_var=obs_var, init_mean=0.0, init_var=sigma**2 / (2 * theta),
                backend="triton")
    return triton_backend.kernel_views(p), initial_state(p), p


def bench_triton(T, C, gbps_copy, config: FilterConfig = DEFAULT_CONFIG):
    views, init, _ = static_problem(T, C)
    n = T * C
    fwd = median_ms(lambda: triton_backend.filter_forward(views, init, outputs=("mu", "lam"), config=config))
    out = triton_backend.filter_forward(views, init, config=config)
    cot = (torch.randn(1, T, C, device="cuda"), torch.randn(1, T, C, device="cuda"), None, None)
    finite = all(bool(torch.isfinite(v).all()) for v in out.values())
    del out

    def fwd_bwd():
        o = triton_backend.filter_forward(views, init, config=config)
        triton_backend.filter_backward(views, init, o["mu"], o["lam"], cot, config)

    both = median_ms(fwd_bwd)
    fwd_graph = graph_ms(lambda: triton_backend.filter_forward(views, init, outputs=("mu", "lam"), config=config))
    both_graph = graph_ms(fwd_bwd)
    row = dict(C=C, T=T, **fc.layout(T, C, config), fwd_ms=fwd, fwd_bwd_ms=both, fwd_graph_ms=fwd_graph,
               fwd_bwd_graph_ms=both_graph, outputs_finite=finite,
               fwd_GBps=FWD_BYTES * n / fwd_graph / 1e6, fwd_bwd_GBps=FWD_BWD_BYTES * n / both_graph / 1e6)
    row["fwd_pct_copy"] = 100 * row["fwd_GBps"] / gbps_copy
    row["fwd_bwd_pct_copy"] = 100 * row["fwd_bwd_GBps"] / gbps_copy
    row["bwd_over_fwd"] = both_graph / fwd_graph
    return row


def bench_torch_backend(T, C):
    """The torch backend's forward (:func:`kalmanscan.ops.filter.torch.filter`) in float32; a
    smaller T if memory runs out."""
    while T >= 1024:
        try:
            g = torch.Generator(device="cuda").manual_seed(1)
            y = torch.randn(T, C, device="cuda", generator=g)
            p = prepare(y, theta=torch.full((C,), 0.5, device="cuda"), sigma=1.0, obs_var=0.5)
            with torch.no_grad():
                ms = median_ms(lambda: torch_backend.filter(p))
            return dict(C=C, T=T, torch_fwd_ms=ms, torch_ns_per_elem=ms * 1e6 / (T * C))
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            T //= 4
    return dict(C=C, T=T, torch_fwd_ms=None)


def bench_loop(C=4096, T=256):
    """A time-stepped torch loop (covariance form, one kernel launch per op per step)."""
    y = torch.randn(T, C, device="cuda")
    a = torch.full((C,), math.exp(-0.5), device="cuda")
    q = torch.full((C,), (1 - math.exp(-1.0)) / 1.0, device="cuda")
    r = torch.full((C,), 0.5, device="cuda")

    def loop():
        m = torch.zeros(C, device="cuda")
        P = torch.ones(C, device="cuda")
        out = torch.empty(T, C, device="cuda")
        for t in range(T):
            m, P = a * m, a * a * P + q
            k = P / (P + r)
            m = m + k * (y[t] - m)
            P = (1 - k) * P
            out[t] = m
        return out

    ms = median_ms(loop)
    return dict(C=C, T=T, loop_ms=ms, loop_ns_per_elem=ms * 1e6 / (T * C))


WALKS = dict(tile=1 << 40)  # no series is a tile long: the forward (and backward) walk

SWEEP = {  # (C, T): FilterConfig fields changed from DEFAULT_CONFIG, one launch variant each
    (4096, 32768): [dict()],
    (64, 1 << 20): [dict()],
    (1, 1 << 22): [WALKS, dict(tile_bwd=False), dict(), dict(tile_row=4), dict(tile_stretches=4096),
                   dict(tile_stretches=512), dict(tile_stretches=2048), dict(tile=512), dict(tile=2048),
                   dict(tile_warps=2), dict(tile_warps=8)],
    (4, 1 << 20): [dict(), dict(tile_max_c=4, tile_bwd=False), dict(tile_max_c=4)],
    (1, 1 << 24): [dict(tile_bwd=False), dict(), dict(tile_stretches=4096)],
}


LANES = [dict(target_lanes=1 << k) for k in range(15, 21)]  # --sweep-lanes: the walks' time split
SPLITS = [dict(target_lanes=1 << k, block=b) for k in (18, 19, 20) for b in (128, 64)]  # --sweep-split


def sweep(shapes=None, variants=None):
    """Forward and forward+backward times of launch variants (``FilterConfig`` fields, passed to the
    launch wrappers), at the ``(C, T)`` of ``SWEEP`` (those in ``shapes`` only, when given); with
    ``variants``, those at each of ``shapes`` instead."""
    if variants is not None:
        return [row for C, T in shapes for row in sweep_shape(C, T, variants)]
    rows = []
    for (C, T), variants in SWEEP.items():
        if not shapes or (C, T) in shapes:
            rows += sweep_shape(C, T, variants)
    return rows


def sweep_shape(C, T, variants):
    """The rows of :func:`sweep` at one shape."""
    views, init, _ = static_problem(T, C)
    cot = (torch.randn(1, T, C, device="cuda"), torch.randn(1, T, C, device="cuda"), None, None)
    rows = []
    for variant in variants:
        try:
            config = dataclasses.replace(DEFAULT_CONFIG, **variant)

            def fwd_bwd():
                o = triton_backend.filter_forward(views, init, config=config)
                triton_backend.filter_backward(views, init, o["mu"], o["lam"], cot, config)

            def fwd():
                return triton_backend.filter_forward(views, init, outputs=("mu", "lam"), config=config)

            def post():
                return triton_backend.filter_forward(views, init, config=config, posterior=True)

            rows.append(dict(C=C, T=T, **variant, **fc.layout(T, C, config), fwd_ms=median_ms(fwd),
                             posterior_ms=median_ms(post), fwd_bwd_ms=median_ms(fwd_bwd),
                             fwd_graph_ms=graph_ms(fwd), posterior_graph_ms=graph_ms(post),
                             fwd_bwd_graph_ms=graph_ms(fwd_bwd)))
        except Exception as exc:  # noqa: BLE001 - a variant that fails to compile is reported
            rows.append(dict(C=C, T=T, **variant, error=repr(exc)[:300]))
    return rows


def jax_two_scans(shapes):
    """The filter as two ``jax.lax.associative_scan`` passes (Möbius, then affine), float32."""
    import jax
    import jax.numpy as jnp

    def mobius(e, f):
        A = f[0] * e[0] + f[1] * e[2]
        B = f[0] * e[1] + f[1] * e[3]
        Cc = f[2] * e[0] + f[3] * e[2]
        D = f[2] * e[1] + f[3] * e[3]
        s = 1.0 / (A + D)
        return A * s, B * s, Cc * s, D * s

    def affine(e, f):
        return f[0] * e[0], f[0] * e[1] + f[1]

    @jax.jit
    def filt(y, a, q, phi, hr, lam0):
        T = y.shape[0]
        first = (jnp.arange(T) == 0)[:, None]
        a = jnp.where(first, 1.0, a)
        q = jnp.where(first, 0.0, q)
        a2 = a * a
        P = jax.lax.associative_scan(mobius, (1.0 + q * phi, a2 * phi + 0 * y, q + 0 * y, a2 + 0 * y))
        lam = (P[0] * lam0 + P[1]) / (P[2] * lam0 + P[3])
        lam_prev = jnp.concatenate([jnp.broadcast_to(lam0, (1, y.shape[1])), lam[:-1]], 0)
        f = a / (a2 + q * lam_prev)
        _, eta = jax.lax.associative_scan(affine, (f, hr * y))
        return eta / lam, lam

    rows = []
    for C, T in shapes:
        key = jax.random.PRNGKey(0)
        y = jax.random.normal(key, (T, C), jnp.float32)
        a = jnp.full((C,), math.exp(-0.5), jnp.float32)
        q = jnp.full((C,), 1.0, jnp.float32)
        phi = jnp.full((C,), 2.0, jnp.float32)
        try:
            jax.block_until_ready(filt(y, a, q, phi, phi, 1.0))
            times = []
            for _ in range(10):
                t0 = time.perf_counter()
                jax.block_until_ready(filt(y, a, q, phi, phi, 1.0))
                times.append(time.perf_counter() - t0)
            rows.append(dict(C=C, T=T, jax_fwd_ms=1e3 * float(np.median(times)), device=str(y.devices())))
        except Exception as exc:  # noqa: BLE001 - out of memory is reported, not fatal
            rows.append(dict(C=C, T=T, jax_fwd_ms=None, error=type(exc).__name__))
    return rows


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks run filter``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON file for the results")
    ap.add_argument("--jax", action="store_true", help="only the JAX baseline (run in its own process)")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time launch variants of the forward")
    ap.add_argument("--sweep-only", action="store_true", help="only the launch variants (no checks, no table)")
    ap.add_argument("--sweep-shapes", help="only these SWEEP shapes, e.g. 4096x32768,64x1048576")
    ap.add_argument("--sweep-lanes", action="store_true",
                    help="with --sweep-shapes (any shapes): time the walks' time split (LANES: target_lanes)")
    ap.add_argument("--sweep-split", action="store_true",
                    help="with --sweep-shapes: the walks' time split and lanes per program (SPLITS)")
    ap.add_argument("--sweep-variants", help="with --sweep-shapes: these FilterConfig variants, a JSON list of "
                    "dicts, e.g. '[{\"agg_warps\": 2, \"closed_chunk\": 16}]'")
    ap.add_argument("--checks", help="comma-separated checks to run (default: all, none with --sweep-only; "
                    "those named run with --sweep-only too)")
    return ap


def main(argv: list[str] | None = None):
    args = parser().parse_args(argv)
    if args.jax:
        save(args.out, jax_two_scans(SHAPES))
        return
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, commit=commit())
    import triton
    res["triton"] = triton.__version__
    checks = dict(reference=fc.check_reference, regimes=fc.check_regimes, gradients=fc.check_gradients,
                  tile_backward=fc.check_tile_backward, extremes=fc.check_extremes)
    names = args.checks.split(",") if args.checks else [] if args.sweep_only else list(checks)
    if not args.skip_checks:
        for name in names:
            fn = checks[name]
            t0 = time.time()
            res["check_" + name] = fn()
            print(name, f"{time.time() - t0:.1f}s", json.dumps(res["check_" + name])[:1500], flush=True)
    res["copy_GBps"] = copy_bandwidth()
    print("copy GB/s", res["copy_GBps"], flush=True)
    if args.sweep or args.sweep_only:
        shapes = shape_list(args.sweep_shapes) if args.sweep_shapes else None
        variants = (LANES if args.sweep_lanes else SPLITS if args.sweep_split
                    else json.loads(args.sweep_variants) if args.sweep_variants else None)
        res["sweep"] = sweep(shapes, variants)
        for row in res["sweep"]:
            print(json.dumps(row), flush=True)
        if args.sweep_only:
            save(args.out, res)
            return
    res["triton"] = [bench_triton(T, C, res["copy_GBps"]) for C, T in SHAPES]
    for row in res["triton"]:
        print(json.dumps(row), flush=True)
    res["torch_backend"] = [bench_torch_backend(T, C) for C, T in SHAPES]
    print(json.dumps(res["torch_backend"]), flush=True)
    res["torch_loop"] = bench_loop()
    print(json.dumps(res["torch_loop"]), flush=True)
    torch.cuda.empty_cache()
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    with tempfile.TemporaryDirectory() as tmp:
        jax_out = os.path.join(tmp, "jax.json")
        proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_filter", "--jax", "--out", jax_out],
                              env=env, capture_output=True, text=True)
        res["jax_two_scans"] = json.load(open(jax_out)) if proc.returncode == 0 else proc.stderr[-2000:]
    res["dynamax"] = "not installed on the device machine: not run"
    save(args.out, res)
    print_table(res)


def print_table(res):
    scans = res["jax_two_scans"]
    jax = {(r["C"], r["T"]): r.get("jax_fwd_ms") for r in scans} if isinstance(scans, list) else {}
    torch_b = dict(enumerate(res["torch_backend"]))
    print(f"copy bandwidth {res['copy_GBps']:.0f} GB/s on {res['device']}")
    print("GPU times from CUDA-graph replay (eager, with the host's launches, in brackets)")
    print("| C | T | fwd ms | GB/s | % copy | fwd+bwd ms | x fwd | torch ms (T) | jax ms | loop ns/elem |")
    for i, r in enumerate(res["triton"]):
        tb = torch_b[i]
        print(f"| {r['C']} | {r['T']} | {r['fwd_graph_ms']:.3f} ({r['fwd_ms']:.3f}) | {r['fwd_GBps']:.0f} | "
              f"{r['fwd_pct_copy']:.0f} | {r['fwd_bwd_graph_ms']:.3f} ({r['fwd_bwd_ms']:.3f}) | "
              f"{r['bwd_over_fwd']:.2f} | {tb['torch_fwd_ms']} ({tb['T']}) | "
              f"{jax.get((r['C'], r['T']))} | {res['torch_loop']['loop_ns_per_elem']:.2f} |")


if __name__ == "__main__":
    main()
