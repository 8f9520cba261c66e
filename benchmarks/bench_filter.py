"""GPU check and benchmark of the triton filter backend (issue 3). A script, not a test.

    python -m benchmarks.bench_filter --out filter.json     # check on the GPU, then time
    python -m benchmarks.bench_filter --jax --out jax.json  # the JAX two-scan baseline alone

Part 1 checks the kernels on the GPU against float64: the sequential reference on random problems
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
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import torch

SHAPES = [(4096, 32768), (64, 1 << 20), (1, 1 << 22), (1, 1 << 24)]
FWD_BYTES = 12
FWD_BWD_BYTES = 36


def median_ms(fn):
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def graph_ms(fn):
    """Median milliseconds of ``fn`` replayed from a CUDA graph: the GPU's time without the host's
    launch overhead (which dominates the few-series shapes, whose kernels take tens of microseconds)."""
    import triton.testing
    return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))


def copy_bandwidth():
    """Device-to-device copy of 1 GiB: bytes read plus written over the median time (GB/s)."""
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / ms / 1e6


def static_problem(T, C, dtype=torch.float32, seed=0):
    """``(views, init, params)``: a static-parameter problem as the kernels' (1, T, C) views."""
    from kalmanscan import fused
    g = torch.Generator(device="cuda").manual_seed(seed)
    y = torch.randn(1, T, C, device="cuda", dtype=dtype, generator=g)
    par = dict(theta=torch.rand(1, 1, C, device="cuda", generator=g, dtype=dtype) + 0.05,
               sigma=torch.rand(1, 1, C, device="cuda", generator=g, dtype=dtype) + 0.1,
               dt=torch.ones(1, 1, 1, device="cuda", dtype=dtype),
               obs_var=torch.rand(1, 1, C, device="cuda", generator=g, dtype=dtype) + 0.1,
               mean=torch.zeros(1, 1, C, device="cuda", dtype=dtype),
               h=torch.ones(1, 1, C, device="cuda", dtype=dtype))
    views = {"y": y, **{k: v.expand(1, T, C) for k, v in par.items()}}
    lam0 = 2 * par["theta"][:, 0] / par["sigma"][:, 0] ** 2
    init = torch.stack([lam0, torch.zeros_like(lam0)], 1).contiguous()
    assert set(views) == set(fused._ORDER)
    return views, init, par


def bench_triton(T, C, gbps_copy):
    from kalmanscan import fused
    views, init, _ = static_problem(T, C)
    n = T * C
    fwd = median_ms(lambda: fused.filter_forward(views, init, outputs=("mu", "lam")))
    out = fused.filter_forward(views, init)
    cot = (torch.randn(1, T, C, device="cuda"), torch.randn(1, T, C, device="cuda"), None, None)
    finite = all(bool(torch.isfinite(v).all()) for v in out.values())
    del out

    def fwd_bwd():
        o = fused.filter_forward(views, init)
        fused.filter_backward(views, init, o["mu"], o["lam"], cot)

    both = median_ms(fwd_bwd)
    fwd_graph = graph_ms(lambda: fused.filter_forward(views, init, outputs=("mu", "lam")))
    both_graph = graph_ms(fwd_bwd)
    row = dict(C=C, T=T, **layout(T, C), fwd_ms=fwd, fwd_bwd_ms=both, fwd_graph_ms=fwd_graph,
               fwd_bwd_graph_ms=both_graph, outputs_finite=finite,
               fwd_GBps=FWD_BYTES * n / fwd_graph / 1e6, fwd_bwd_GBps=FWD_BWD_BYTES * n / both_graph / 1e6)
    row["fwd_pct_copy"] = 100 * row["fwd_GBps"] / gbps_copy
    row["fwd_bwd_pct_copy"] = 100 * row["fwd_bwd_GBps"] / gbps_copy
    row["bwd_over_fwd"] = both_graph / fwd_graph
    return row


def layout(T, C):
    """The forward's layout at ``(T, C)``: time-parallel tiles or walks, and its stretches."""
    from kalmanscan import fused
    if fused.uses_tiles(T, C):
        ns, r = fused.tile_plan(T)
        return dict(layout="tiles", stretches=ns, stretch=r * fused.TILE)
    ns, L = fused.plan(1, T, C)
    return dict(layout="walks", stretches=ns, stretch=L)


def bench_torch_backend(T, C):
    """The torch backend's forward (``filter_torch``) in float32; a smaller T if memory runs out."""
    from kalmanscan.inputs import prepare
    from kalmanscan.parallel import filter_torch
    while T >= 1024:
        try:
            g = torch.Generator(device="cuda").manual_seed(1)
            y = torch.randn(T, C, device="cuda", generator=g)
            p = prepare(y, theta=torch.full((C,), 0.5, device="cuda"), sigma=1.0, obs_var=0.5)
            with torch.no_grad():
                ms = median_ms(lambda: filter_torch(p))
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


def check_reference():
    """Float32 and float64 kernels on the GPU against the sequential float64 reference: walks over
    one and many stretches (C = 8), time-parallel tiles at the default and at small tiles (C = 1)."""
    from kalmanscan import fused
    rng = np.random.default_rng(0)
    rows = []
    for settings, C, batch in (
            (dict(MIN_STRETCH=64, TARGET_LANES=fused.TARGET_LANES), 8, (2,)),
            (dict(MIN_STRETCH=8, TARGET_LANES=1 << 30), 8, (2,)),
            (dict(TILE=fused.TILE, TILE_STRETCHES=fused.TILE_STRETCHES), 1, (3,)),
            (dict(TILE=64, TILE_STRETCHES=8), 1, (3,))):
        saved = {k: getattr(fused, k) for k in settings}
        for k, v in settings.items():
            setattr(fused, k, v)
        for per_step, times in ((False, False), (True, True), (True, False)):
            rows += _reference_rows(rng, C, batch, per_step, times)
        for k, v in saved.items():
            setattr(fused, k, v)
    return rows


def _reference_rows(rng, C, batch, per_step, times, T=3001):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from helpers import posterior_error, random_problem

    import kalmanscan as ks
    y, kw = random_problem(rng, T, C=C, batch=batch, per_step=per_step, times=times, missing=0.1, offset=50.0)
    ref = ks.filter(y, backend="reference", **kw)
    rows = []
    for dtype in (torch.float32, torch.float64):
        t = {k: torch.tensor(v, device="cuda", dtype=torch.float64 if k == "times" else dtype)
             for k, v in kw.items()}
        out = ks.filter(torch.tensor(y, device="cuda", dtype=dtype), backend="triton", **t)
        err, errs = posterior_error(out, ref)
        rows.append(dict(C=C, per_step=per_step, times=times, **layout(T, C), dtype=str(dtype),
                         max_rel_err=err, worst_field=max(errs, key=errs.get)))
    return rows


def check_regimes():
    """Float32 kernels against the float64 torch backend at the benchmark's regimes (many stretches)."""
    import kalmanscan as ks
    rows = []
    for C, T in ((4096, 4096), (64, 1 << 16), (1, 1 << 20), (1, 1 << 22)):
        g = torch.Generator(device="cuda").manual_seed(C)
        y = torch.randn(T, C, device="cuda", dtype=torch.float64, generator=g)
        kw = dict(theta=torch.rand(C, device="cuda", dtype=torch.float64, generator=g) + 0.05,
                  sigma=1.0, obs_var=0.5)
        ref = ks.filter(y, backend="torch", **kw)
        out = ks.filter(y.float(), backend="triton", **{k: (v.float() if torch.is_tensor(v) else v) for k, v in kw.items()})
        errs = {k: float(((getattr(out, k).double() - getattr(ref, k)).abs() / getattr(ref, k).abs().clamp_min(1e-30)).max())
                for k in ("precision", "pred_var")}
        errs["mean"] = float((out.mean.double() - ref.mean).abs().max() / ref.mean.abs().max())
        rows.append(dict(C=C, T=T, **errs))
    return rows


def check_gradients():
    """Float32 triton gradients against float64 torch autograd (relative norm error per input)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from helpers import random_problem

    import kalmanscan as ks
    from kalmanscan import fused
    names = ("theta", "sigma", "obs_var", "mean", "h", "init_mean", "init_var")
    rng = np.random.default_rng(5)
    rows = []
    saved = fused.MIN_STRETCH, fused.TARGET_LANES
    fused.MIN_STRETCH, fused.TARGET_LANES = 16, 1 << 30
    for per_step, times in ((False, False), (True, True)):
        y, kw = random_problem(rng, 1000, C=8, batch=(2,), per_step=per_step, times=times, missing=0.1)
        grads = {}
        for backend, dtype in (("torch", torch.float64), ("triton", torch.float32)):
            t = {k: torch.tensor(v, device="cuda", dtype=torch.float64 if k == "times" else dtype,
                                 requires_grad=k in names) for k, v in kw.items()}
            y_t = torch.tensor(y, device="cuda", dtype=dtype, requires_grad=True)
            post = ks.filter(y_t, backend=backend, **t)
            loss = post.loglik.sum() + post.mean.sum() + post.var.sum()
            grads[backend] = torch.autograd.grad(loss, [y_t] + [t[k] for k in names])
        for name, a, b in zip(("y",) + names, grads["torch"], grads["triton"]):
            rows.append(dict(per_step=per_step, input=name,
                             rel_err=float((a - b.double()).norm() / a.norm())))
    fused.MIN_STRETCH, fused.TARGET_LANES = saved
    return rows


def check_tile_backward():
    """The time-parallel tile backward (``fused.TILE_BWD``) on one long series, float32, against the
    walk backward (float32) and float64 torch autograd: relative norm error per input."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from helpers import random_problem

    import kalmanscan as ks
    from kalmanscan import fused
    names = ("theta", "sigma", "obs_var", "mean", "h", "init_mean", "init_var")
    rng = np.random.default_rng(6)
    rows = []
    saved = fused.TILE_BWD
    for T, per_step, times in ((4097, False, False), (20011, True, True), (1 << 20, False, False)):
        y, kw = random_problem(rng, T, C=1, batch=(), per_step=per_step, times=times, missing=0.1)
        grads = {}
        for label, backend, dtype, tile_bwd in (("float64", "torch", torch.float64, False),
                                                ("walks", "triton", torch.float32, False),
                                                ("tiles", "triton", torch.float32, True)):
            fused.TILE_BWD = tile_bwd
            t = {k: torch.tensor(v, device="cuda", dtype=torch.float64 if k == "times" else dtype,
                                 requires_grad=k in names) for k, v in kw.items()}
            y_t = torch.tensor(y, device="cuda", dtype=dtype, requires_grad=True)
            post = ks.filter(y_t, backend=backend, **t)
            loss = post.loglik.sum() + post.mean.sum() + post.var.sum()
            grads[label] = torch.autograd.grad(loss, [y_t] + [t[k] for k in names])
        fused.TILE_BWD = saved
        for i, name in enumerate(("y",) + names):
            ref = grads["float64"][i]
            rows.append(dict(T=T, per_step=per_step, input=name,
                             tiles_vs_float64=float((grads["tiles"][i].double() - ref).norm() / ref.norm()),
                             walks_vs_float64=float((grads["walks"][i].double() - ref).norm() / ref.norm()),
                             tiles_vs_walks=float((grads["tiles"][i] - grads["walks"][i]).double().norm()
                                                  / grads["walks"][i].double().norm())))
    return rows


def check_chain():
    """The single-pass chained forward (``fused.CHAIN``) on the GPU: float32 and float64 against the
    float64 reference (C = 256, per-step and static parameters, missing values; every stretch's
    state published and every third), and float32 against the three-kernel forward at (4096, 4096)
    (mean: max difference over max magnitude; precision: max relative difference)."""
    from kalmanscan import fused
    rng = np.random.default_rng(8)
    rows = []
    saved = fused.CHAIN, fused.CHAIN_STRETCH, fused.CHAIN_PUBLISH
    for stretch, publish in ((32, 1), (16, 3)):
        fused.CHAIN, fused.CHAIN_STRETCH, fused.CHAIN_PUBLISH = True, stretch, publish
        for per_step, times in ((False, False), (True, True)):
            rows += [dict(r, stretch=stretch, publish=publish)
                     for r in _reference_rows(rng, 256, (2,), per_step, times)]
    fused.CHAIN_PUBLISH = 1
    views, init, _ = static_problem(4096, 4096)
    fused.CHAIN = False
    want = fused.filter_forward(views, init, outputs=("mu", "lam"))
    for stretch in (16, 32, 128):
        fused.CHAIN, fused.CHAIN_STRETCH = True, stretch
        got = fused.filter_forward(views, init, outputs=("mu", "lam"))
        rows.append(dict(C=4096, T=4096, stretch=stretch,
                         mu=float((got["mu"] - want["mu"]).abs().max() / want["mu"].abs().max()),
                         lam=float(((got["lam"] - want["lam"]).abs() / want["lam"]).max())))
    fused.CHAIN, fused.CHAIN_STRETCH, fused.CHAIN_PUBLISH = saved
    return rows


def check_extremes(T=4096):
    """Float32 error against the float64 reference over obs_var x theta dt (one channel each) x offset.

    Per channel: the worst elementwise relative error of the positive fields (variances,
    precisions) and the max-norm relative error of the centred means (``mean - offset``).
    """
    import kalmanscan as ks
    obs_vars = [1e-8, 1e-4, 1.0, 1e4, 1e8]
    theta_dts = [1e-8, 1e-4, 1e-1, 10.0, 1e3]
    grid = [(ov, td) for ov in obs_vars for td in theta_dts]
    ov = np.array([g[0] for g in grid])
    td = np.array([g[1] for g in grid])
    rng = np.random.default_rng(9)
    a, q = np.exp(-td), -np.expm1(-2 * td) / (2 * td)
    x = np.zeros((T, len(grid)))
    x[0] = rng.normal(size=len(grid)) * np.sqrt(1 / (2 * td))
    for t in range(1, T):
        x[t] = a * x[t - 1] + np.sqrt(q) * rng.normal(size=len(grid))
    noise = np.sqrt(ov) * rng.normal(size=x.shape)
    rows = []
    for offset in (0.0, 1e4):
        y = offset + x + noise
        kw = dict(theta=td, sigma=1.0, obs_var=ov, mean=offset, dt=1.0)
        ref = ks.filter(y, backend="reference", **kw)
        out = ks.filter(torch.tensor(y, device="cuda", dtype=torch.float32), backend="triton", **kw)
        for c, (o, d) in enumerate(grid):
            errs = {}
            for k in ("var", "precision", "pred_var", "pred_obs_var"):
                r, v = getattr(ref, k)[:, c], getattr(out, k)[:, c].double().cpu().numpy()
                errs[k] = float(np.max(np.abs(v - r) / np.abs(r)))
            for k in ("mean", "pred_mean"):
                r = getattr(ref, k)[:, c] - offset
                v = getattr(out, k)[:, c].double().cpu().numpy() - offset
                errs[k] = float(np.max(np.abs(v - r)) / max(np.max(np.abs(r)), 1e-300))
            r, v = ref.loglik[c], float(out.loglik[c])
            errs["loglik"] = abs(v - r) / abs(r)
            finite = bool(torch.isfinite(out.mean[:, c]).all() and torch.isfinite(out.var[:, c]).all())
            rows.append(dict(offset=offset, obs_var=o, theta_dt=d, finite=finite, **errs))
    return rows


SWEEP = {
    (4096, 32768): [dict()] + [dict(CHAIN=True, CHAIN_STRETCH=n) for n in (16, 32, 64, 128)],
    (64, 1 << 20): [dict(), dict(CHAIN=True, CHAIN_STRETCH=32), dict(CHAIN=True, CHAIN_STRETCH=128)],
    (1, 1 << 22): [dict(TILE_MAX_C=0), dict(), dict(TILE_BWD=True), dict(TILE_BWD=True, TILE_ROW=4),
                   dict(TILE_BWD=True, TILE_STRETCHES=4096)],
    (4, 1 << 20): [dict(TILE_MAX_C=0), dict(TILE_MAX_C=4), dict(TILE_MAX_C=4, TILE_BWD=True)],
    (1, 1 << 24): [dict(), dict(TILE_BWD=True), dict(TILE_BWD=True, TILE_STRETCHES=4096)],
}


def sweep(shapes=None):
    """Forward and forward+backward times of launch variants (attributes of kalmanscan.fused), at
    the ``(C, T)`` of ``SWEEP`` (those in ``shapes`` only, when given)."""
    from kalmanscan import fused
    rows = []
    for (C, T), variants in SWEEP.items():
        if shapes and (C, T) not in shapes:
            continue
        views, init, _ = static_problem(T, C)
        cot = (torch.randn(1, T, C, device="cuda"), torch.randn(1, T, C, device="cuda"), None, None)
        for variant in variants:
            saved = {k: getattr(fused, k) for k in variant}
            for k, v in variant.items():
                setattr(fused, k, v)

            def fwd_bwd():
                o = fused.filter_forward(views, init)
                fused.filter_backward(views, init, o["mu"], o["lam"], cot)

            try:
                fwd = median_ms(lambda: fused.filter_forward(views, init, outputs=("mu", "lam")))
                post = median_ms(lambda: fused.filter_forward(views, init, posterior=True))
                both = median_ms(fwd_bwd)
                fwd_graph = graph_ms(lambda: fused.filter_forward(views, init, outputs=("mu", "lam")))
                post_graph = graph_ms(lambda: fused.filter_forward(views, init, posterior=True))
                both_graph = graph_ms(fwd_bwd)
                rows.append(dict(C=C, T=T, **variant, **layout(T, C), fwd_ms=fwd, posterior_ms=post,
                                 fwd_bwd_ms=both, fwd_graph_ms=fwd_graph, posterior_graph_ms=post_graph,
                                 fwd_bwd_graph_ms=both_graph))
            except Exception as exc:  # noqa: BLE001 - a variant that fails to compile is reported
                rows.append(dict(C=C, T=T, **variant, error=repr(exc)[:300]))
            for k, v in saved.items():
                setattr(fused, k, v)
        del views, cot
    return rows


def jax_two_scans(shapes):
    """The filter as two ``jax.lax.associative_scan`` passes (Möbius, then affine), float32."""
    import jax
    import jax.numpy as jnp

    def mobius(e, l):
        A = l[0] * e[0] + l[1] * e[2]
        B = l[0] * e[1] + l[1] * e[3]
        Cc = l[2] * e[0] + l[3] * e[2]
        D = l[2] * e[1] + l[3] * e[3]
        s = 1.0 / (A + D)
        return A * s, B * s, Cc * s, D * s

    def affine(e, l):
        return l[0] * e[0], l[0] * e[1] + l[1]

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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--jax", action="store_true", help="only the JAX baseline (run in its own process)")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time launch variants of the forward")
    ap.add_argument("--sweep-only", action="store_true", help="only the launch variants (no checks, no table)")
    ap.add_argument("--sweep-shapes", help="only these SWEEP shapes, e.g. 4096x32768,64x1048576")
    ap.add_argument("--checks", help="comma-separated checks to run (default: all, none with --sweep-only; "
                    "those named run with --sweep-only too)")
    args = ap.parse_args()
    if args.jax:
        json.dump(jax_two_scans(SHAPES), open(args.out, "w"), indent=1)
        return
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
    import triton
    res["triton"] = triton.__version__
    checks = dict(reference=check_reference, regimes=check_regimes, gradients=check_gradients,
                  tile_backward=check_tile_backward, chain=check_chain, extremes=check_extremes)
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
        shapes = [tuple(int(v) for v in x.split("x")) for x in args.sweep_shapes.split(",")] if args.sweep_shapes else None
        res["sweep"] = sweep(shapes)
        for row in res["sweep"]:
            print(json.dumps(row), flush=True)
        if args.sweep_only:
            json.dump(res, open(args.out, "w"), indent=1)
            return
    res["triton"] = [bench_triton(T, C, res["copy_GBps"]) for C, T in SHAPES]
    for row in res["triton"]:
        print(json.dumps(row), flush=True)
    res["torch_backend"] = [bench_torch_backend(T, C) for C, T in SHAPES]
    print(json.dumps(res["torch_backend"]), flush=True)
    res["torch_loop"] = bench_loop()
    print(json.dumps(res["torch_loop"]), flush=True)
    torch.cuda.empty_cache()
    jax_out = args.out + ".jax.json"
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_filter", "--jax", "--out", jax_out],
                          env=env, capture_output=True, text=True)
    res["jax_two_scans"] = json.load(open(jax_out)) if proc.returncode == 0 else proc.stderr[-2000:]
    res["dynamax"] = "not installed on the device machine: not run"
    json.dump(res, open(args.out, "w"), indent=1)
    print_table(res)


def print_table(res):
    jax = {(r["C"], r["T"]): r.get("jax_fwd_ms") for r in res["jax_two_scans"]} if isinstance(res["jax_two_scans"], list) else {}
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
