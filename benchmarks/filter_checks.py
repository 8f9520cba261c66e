"""GPU checks of the triton filter backend against float64 (part 1 of :mod:`benchmarks.bench_filter`).

The sequential reference on random problems (static and per-step parameters, irregular times,
missing values, one and many stretches, tiles), the float64 torch backend at the benchmark's
regimes, gradients against float64 torch autograd (walks, the tile backward, the chained forward),
and the float32 error over the extreme-parameter matrix. Each ``check_*`` returns rows of errors
and restores every ``kalmanscan.fused`` switch it sets.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

from .bench_filter import layout, static_problem


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


def _filter_gradients(y, kw, backend, dtype, names):
    """Gradients of ``loglik + sum(mean) + sum(var)`` of ``ks.filter`` on the GPU with respect to
    ``y`` and the parameters ``names`` (inputs in ``dtype``; times in float64)."""
    import kalmanscan as ks
    t = {k: torch.tensor(v, device="cuda", dtype=torch.float64 if k == "times" else dtype,
                         requires_grad=k in names) for k, v in kw.items()}
    y_t = torch.tensor(y, device="cuda", dtype=dtype, requires_grad=True)
    post = ks.filter(y_t, backend=backend, **t)
    loss = post.loglik.sum() + post.mean.sum() + post.var.sum()
    return torch.autograd.grad(loss, [y_t] + [t[k] for k in names])


def check_gradients():
    """Float32 triton gradients against float64 torch autograd (relative norm error per input)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from helpers import random_problem

    from kalmanscan import fused
    names = ("theta", "sigma", "obs_var", "mean", "h", "init_mean", "init_var")
    rng = np.random.default_rng(5)
    rows = []
    saved = fused.MIN_STRETCH, fused.TARGET_LANES
    fused.MIN_STRETCH, fused.TARGET_LANES = 16, 1 << 30
    for per_step, times in ((False, False), (True, True)):
        y, kw = random_problem(rng, 1000, C=8, batch=(2,), per_step=per_step, times=times, missing=0.1)
        grads = {backend: _filter_gradients(y, kw, backend, dtype, names)
                 for backend, dtype in (("torch", torch.float64), ("triton", torch.float32))}
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
            grads[label] = _filter_gradients(y, kw, backend, dtype, names)
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
