"""GPU checks of the triton filter backend against float64 (part 1 of :mod:`benchmarks.bench_filter`).

The sequential reference on random problems (static and per-step parameters, irregular times,
missing values, one and many stretches, tiles), the float64 torch backend at the benchmark's
regimes, gradients against float64 torch autograd (walks, the tile backward), and the float32
error over the extreme-parameter matrix. A check that needs another launch configuration than
``DEFAULT_CONFIG`` runs the public ``ks.filter`` on a backend registered for it
(:func:`triton_with`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types

import numpy as np
import torch

from kalmanscan.ops.filter import register_backend
from kalmanscan.ops.filter.triton import backend as triton_backend
from kalmanscan.ops.filter.triton.config import DEFAULT_CONFIG, FilterConfig

_REGISTERED: dict[FilterConfig, str] = {}


def layout(T, C, config: FilterConfig = DEFAULT_CONFIG):
    """The forward's layout at ``(T, C)`` under ``config``: time-parallel tiles or walks, and its
    stretches."""
    if triton_backend.uses_tiles(T, C, config):
        ns, r = triton_backend.tile_plan(T, config)
        return dict(layout="tiles", stretches=ns, stretch=r * config.tile)
    ns, L = triton_backend.plan(1, T, C, config)
    return dict(layout="walks", stretches=ns, stretch=L)


def triton_with(config: FilterConfig) -> str:
    """The name of a filter backend that is the triton backend launched with ``config`` (registered
    on first use with :func:`kalmanscan.ops.filter.register_backend`), for ``ks.filter(...,
    backend=name)``: the public call, with that launch configuration."""
    if config == DEFAULT_CONFIG:
        return "triton"
    if config not in _REGISTERED:
        name = f"triton_config{len(_REGISTERED)}"
        module = types.ModuleType(name, f"the triton filter backend launched with {config}")
        module.filter = lambda p: triton_backend.filter(p, config)
        module.smooth = lambda f, mean_param: triton_backend.smooth(f, mean_param, config)
        module.summary = lambda p: triton_backend.summary(p, config)
        register_backend(name, module)
        _REGISTERED[config] = name
    return _REGISTERED[config]


def _tests_helpers():
    """``tests/helpers.py`` (random problems, posterior errors), importable as ``helpers``."""
    tests = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import helpers
    return helpers


def check_reference(T=3001, device="cuda"):
    """Float32 and float64 kernels on the GPU against the sequential float64 reference: walks over
    one and many stretches (C = 8), time-parallel tiles at the default and at small tiles (C = 1)."""
    rng = np.random.default_rng(0)
    rows = []
    for config, C, batch in (
            (DEFAULT_CONFIG, 8, (2,)),
            (dataclasses.replace(DEFAULT_CONFIG, min_stretch=8, target_lanes=1 << 30), 8, (2,)),
            (DEFAULT_CONFIG, 1, (3,)),
            (dataclasses.replace(DEFAULT_CONFIG, tile=64, tile_stretches=8), 1, (3,))):
        for per_step, times in ((False, False), (True, True), (True, False)):
            rows += _reference_rows(rng, C, batch, per_step, times, config, T, device)
    return rows


def _reference_rows(rng, C, batch, per_step, times, config, T, device="cuda"):
    helpers = _tests_helpers()
    import kalmanscan as ks
    y, kw = helpers.random_problem(rng, T, C=C, batch=batch, per_step=per_step, times=times, missing=0.1,
                                   offset=50.0)
    ref = ks.filter(y, backend="reference", **kw)
    rows = []
    for dtype in (torch.float32, torch.float64):
        t = {k: torch.tensor(v, device=device, dtype=torch.float64 if k == "times" else dtype)
             for k, v in kw.items()}
        out = ks.filter(torch.tensor(y, device=device, dtype=dtype), backend=triton_with(config), **t)
        err, errs = helpers.posterior_error(out, ref)
        rows.append(dict(C=C, per_step=per_step, times=times, **layout(T, C, config), dtype=str(dtype),
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
        out = ks.filter(y.float(), backend="triton",
                        **{k: (v.float() if torch.is_tensor(v) else v) for k, v in kw.items()})
        errs = {k: float(((getattr(out, k).double() - getattr(ref, k)).abs()
                          / getattr(ref, k).abs().clamp_min(1e-30)).max())
                for k in ("precision", "pred_var")}
        errs["mean"] = float((out.mean.double() - ref.mean).abs().max() / ref.mean.abs().max())
        rows.append(dict(C=C, T=T, **errs))
    return rows


def _filter_gradients(y, kw, backend, dtype, names, device="cuda"):
    """Gradients of ``loglik + sum(mean) + sum(var)`` of ``ks.filter`` on the GPU with respect to
    ``y`` and the parameters ``names`` (inputs in ``dtype``; times in float64)."""
    import kalmanscan as ks
    t = {k: torch.tensor(v, device=device, dtype=torch.float64 if k == "times" else dtype,
                         requires_grad=k in names) for k, v in kw.items()}
    y_t = torch.tensor(y, device=device, dtype=dtype, requires_grad=True)
    post = ks.filter(y_t, backend=backend, **t)
    loss = post.loglik.sum() + post.mean.sum() + post.var.sum()
    return torch.autograd.grad(loss, [y_t] + [t[k] for k in names])


def check_gradients(T=1000, device="cuda"):
    """Float32 triton gradients against float64 torch autograd (relative norm error per input), over
    stretches of 16 steps."""
    helpers = _tests_helpers()
    names = ("theta", "sigma", "obs_var", "mean", "h", "init_mean", "init_var")
    rng = np.random.default_rng(5)
    config = dataclasses.replace(DEFAULT_CONFIG, min_stretch=16, target_lanes=1 << 30)
    rows = []
    for per_step, times in ((False, False), (True, True)):
        y, kw = helpers.random_problem(rng, T, C=8, batch=(2,), per_step=per_step, times=times, missing=0.1)
        grads = {backend: _filter_gradients(y, kw, backend, dtype, names, device)
                 for backend, dtype in (("torch", torch.float64), (triton_with(config), torch.float32))}
        for name, a, b in zip(("y",) + names, grads["torch"], grads[triton_with(config)]):
            rows.append(dict(per_step=per_step, input=name,
                             rel_err=float((a - b.double()).norm() / a.norm())))
    return rows


def check_tile_backward(lengths=(4097, 20011, 1 << 20), device="cuda"):
    """The time-parallel tile backward (``FilterConfig.tile_bwd``, the default) on one long series,
    float32, against the walk backward (float32) and float64 torch autograd: relative norm error
    per input."""
    helpers = _tests_helpers()
    names = ("theta", "sigma", "obs_var", "mean", "h", "init_mean", "init_var")
    rng = np.random.default_rng(6)
    rows = []
    walks = triton_with(dataclasses.replace(DEFAULT_CONFIG, tile_bwd=False))
    tiles = triton_with(dataclasses.replace(DEFAULT_CONFIG, tile_bwd=True))
    for T, per_step, times in zip(lengths, (False, True, False), (False, True, False)):
        y, kw = helpers.random_problem(rng, T, C=1, batch=(), per_step=per_step, times=times, missing=0.1)
        grads = {}
        for label, backend, dtype in (("float64", "torch", torch.float64), ("walks", walks, torch.float32),
                                      ("tiles", tiles, torch.float32)):
            grads[label] = _filter_gradients(y, kw, backend, dtype, names, device)
        for i, name in enumerate(("y",) + names):
            ref = grads["float64"][i]
            rows.append(dict(T=T, per_step=per_step, input=name,
                             tiles_vs_float64=float((grads["tiles"][i].double() - ref).norm() / ref.norm()),
                             walks_vs_float64=float((grads["walks"][i].double() - ref).norm() / ref.norm()),
                             tiles_vs_walks=float((grads["tiles"][i] - grads["walks"][i]).double().norm()
                                                  / grads["walks"][i].double().norm())))
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
