"""Validation, broadcasting and conversion of the filter's inputs (shared by every backend).

Shapes. ``y`` is ``(..., T, C)``. A parameter with ``ndim <= 1`` (a scalar or ``(C,)``) is static;
one with ``ndim >= 2`` is aligned with ``y`` as ``(..., T, C)`` (per step) or ``(..., 1, C)``
(static with batch dimensions). ``times`` is ``(T,)`` or broadcasts to ``(..., T, 1)``.
``init_mean`` and ``init_var`` are ``(..., C)``. Everything broadcasts to one shape ``(..., T, C)``
whose ``T`` is ``y``'s.

Dtypes. Torch in: computed in ``y``'s floating dtype (half precision computes in float32 and
returns the input dtype). NumPy in: computed in float64 (float32 stays float32), returned as NumPy.
Nothing the caller passed is modified: the tensors made here are new or read-only views.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from kalmanscan.model import mobius, ou
from kalmanscan.ops.filter.dispatch import resolve_backend
from kalmanscan.ops.filter.torch import compact
from kalmanscan.ops.filter.triton.param_rows import prepare_static, static_on_device
from kalmanscan.problem.bounds import (BOUNDS, NEEDS_INIT_VAR_SIGMA, NEEDS_INIT_VAR_THETA, NOISE_OVERFLOW, PARAMS,
                                       STATIONARY_OVERFLOW, narrowing_message, overflow_message, requirement, within)
from kalmanscan.problem.checks import Checks, queue_y_check, queued_with_kernels
from kalmanscan.problem.convert import broadcast_init, broadcast_param, host_array, on_host, to_device
from kalmanscan.problem.problem import Problem, wanted_outputs
from kalmanscan.problem.remembered import Remembered, value_key
from kalmanscan.types import ArrayLike


__all__ = ["prepare", "host_parameters", "GUESSED"]

GUESSED = dict(diffuse=False, no_noise=False)
"""The facts a deferred :func:`prepare` assumes until its checks are read (:attr:`Problem.pending`):
no diffuse prior, process noise present."""



def _compute_dtype(y):
    if isinstance(y, torch.Tensor):
        if y.dtype in (torch.float16, torch.bfloat16):
            return torch.float32, y.dtype
        if y.dtype.is_floating_point:
            return y.dtype, y.dtype
        return torch.float64, torch.float64
    arr = np.asarray(y)
    if arr.dtype == np.float32:
        return torch.float32, np.float32
    if arr.dtype == np.float16:
        return torch.float32, np.float16
    return torch.float64, np.float64


def _to_tensor(name, x, dtype, device):
    if isinstance(x, torch.Tensor):
        out = x.to(device=device, dtype=dtype)
        if x.dtype.itemsize > dtype.itemsize and x.dtype.is_floating_point and bool(
                (torch.isinf(out) & torch.isfinite(x.detach().to(device))).any()):  # (one read; a rare call)
            raise ValueError(narrowing_message(name, dtype))
        return out
    arr = np.asarray(x)
    if arr.dtype.kind not in "biuf":
        raise ValueError(f"{name} must be numeric, got dtype {arr.dtype}")
    if dtype == torch.float32 and arr.dtype == np.float64:
        host_array(name, arr, np.float32)  # a finite value past float32's range is refused, not made inf
    if arr.dtype != np.float64 and not (arr.dtype == np.float32 and dtype == torch.float32):
        arr = arr.astype(np.float64)
    elif any(s < 0 for s in arr.strides):  # torch takes no negative strides: copy reversed views
        arr = arr.copy()
    with warnings.catch_warnings():  # read-only arrays are shared, never written (nothing is)
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.as_tensor(arr, dtype=dtype, device=device)


def prepare(y: ArrayLike, *, theta: ArrayLike, sigma: ArrayLike, obs_var: ArrayLike, mean: ArrayLike = 0.0,
            h: ArrayLike = 1.0, dt: ArrayLike = 1.0, times: ArrayLike | None = None,
            init_mean: ArrayLike | None = None, init_var: ArrayLike | None = None, backend: str = "auto",
            outputs: Sequence[str] | None = None, check_y: bool = True, late_y: bool = False,
            defer: bool = False) -> Problem:
    """Validate and broadcast the filter's inputs and resolve the call's plan; see the module
    docstring for the rules. Every name, value, shape and bound is checked here, once: the
    returned :class:`Problem` is what every backend trusts.

    The plan: :attr:`Problem.backend`, the registered backend ``backend`` stands for on ``y``'s
    device (``ValueError`` naming ``backend`` for an unknown one); :attr:`Problem.outputs`, the
    fields ``outputs`` asks for (:func:`~kalmanscan.problem.problem.wanted_outputs`); where the
    parameters were checked (:attr:`Problem.derived` from the host, :attr:`Problem.y_late`) and the
    path's facts (``diffuse``, ``no_noise``).

    When every parameter is a scalar or ``(C,)`` on the host (Python numbers, NumPy, CPU tensors
    without gradient) and ``times`` is not given, they are checked with NumPy and reach ``y``'s
    device in one copy with their derived values (:attr:`Problem.derived`). Otherwise parameters
    given as NumPy, Python numbers or CPU tensors are checked on the CPU before they move to
    ``y``'s device, and checks on device tensors are decided together in one synchronisation. The
    inf check on ``y`` is one reduction (one synchronisation on a device). ``check_y=False`` skips
    it; the caller must then call :func:`check_no_inf` itself, e.g. only when the log-likelihood
    comes out non-finite (an ``inf`` in ``y`` always makes it so). With ``late_y``, when the
    parameters are checked on the host (or are static device tensors whose checks are deferred,
    below), ``y``'s check is left to the caller (:attr:`Problem.y_late`:
    :func:`kalmanscan.problem.checks.decide_y` once the kernels are queued, from the kernels' own
    pass where they take it). With ``defer`` on the triton backend, the checks on device tensors are not read here:
    they are queued (:attr:`Problem.pending`, facts assumed as :data:`GUESSED`) for the caller to
    decide once its kernels are queued, and to run the call again if the facts read differ.
    """
    if (y.dtype == torch.bool) if isinstance(y, torch.Tensor) else (np.asarray(y).dtype.kind == "b"):
        raise ValueError("y must be numeric observations, got booleans (convert them to float first "
                         "if 0/1 values are really meant)")
    device = y.device if isinstance(y, torch.Tensor) else torch.device("cpu")
    plan = dict(backend=resolve_backend(backend, device), outputs=wanted_outputs(outputs))
    dtype, out_dtype = _compute_dtype(y)
    numpy_out = not isinstance(y, torch.Tensor)
    y_t = _to_tensor("y", y, dtype, device)
    if y_t.ndim < 2:
        raise ValueError(f"y must have shape (..., T, C) with T >= 1 and C >= 1, got {tuple(y_t.shape)}")
    if y_t.shape[-2] < 1 or y_t.shape[-1] < 1:
        raise ValueError(f"y must have T >= 1 and C >= 1, got shape {tuple(y_t.shape)}")

    vals = dict(theta=theta, sigma=sigma, obs_var=obs_var, mean=mean, h=h, dt=dt)
    for name in PARAMS:
        if vals[name] is None:
            raise ValueError(f"{name} is required")
    if host_parameters(vals, times, init_mean, init_var):
        p = _prepare_host(y_t, vals, init_mean, init_var, numpy_out, out_dtype, plan)
        if check_y and late_y:
            p.y_late = True
        elif check_y:
            checks = Checks()
            queue_y_check(checks, y_t)
            checks.decide()
        return p
    checks = Checks()
    triton = plan["backend"] == "triton"
    given = dict(vals, init_mean=init_mean, init_var=init_var)
    static = static_on_device(y_t, given, times)
    # static parameters, checks deferred: a large y's check from the kernels' own pass, as on the host path
    late = static and check_y and late_y and defer and triton and queued_with_kernels(y_t)
    if check_y and not late:
        queue_y_check(checks, y_t)
    if static:
        p, facts = prepare_static(y_t, given, checks, numpy_out, out_dtype, plan)
        checks.fact("diffuse", facts["diffuse"])
        if triton:
            checks.fact("no_noise", facts["no_noise"])
        p.pending, facts = (checks.queue(), GUESSED) if defer and triton else (None, checks.decide())
        p.diffuse, p.no_noise, p.y_late = facts["diffuse"], facts.get("no_noise"), late
        return p
    params = {name: _as_2d(_to_tensor(name, vals[name], dtype, _home(vals[name]))) for name in PARAMS}
    times_t = None
    if times is not None:
        params["dt"], times_t = _dt_from_times(times, y_t.shape[-2], dtype, _home(times), checks)

    for name, bound in BOUNDS.items():
        checks.add(name, params[name], lambda v, b=bound: within(v, b), requirement(bound))

    shape = tuple(y_t.shape)
    for name, p in params.items():
        shape = broadcast_param(name, shape, tuple(p.shape), y_t.shape[-2])

    theta0 = params["theta"][..., :1, :]
    sigma0 = params["sigma"][..., :1, :]
    if theta0.device != sigma0.device:
        theta0, sigma0 = to_device(theta0, device), to_device(sigma0, device)
    if init_var is None:
        checks.require(NEEDS_INIT_VAR_THETA, torch.all(theta0.detach() != 0))
        checks.require(NEEDS_INIT_VAR_SIGMA, torch.all((sigma0.detach() != 0) | (theta0.detach() == 0)))
        init_v = ou.stationary_var(theta0, sigma0)
        # (inf where theta = 0, which the check before refuses first)
        checks.require(overflow_message(STATIONARY_OVERFLOW, dtype), torch.all(torch.isfinite(init_v.detach())))
    else:
        init_v = _init_param("init_var", init_var, dtype, _home(init_var))
        checks.add("init_var", init_v, lambda v: v > 0, "> 0 (or inf: a diffuse prior)")
    if init_mean is None:
        init_m = params["mean"][..., :1, :]
    else:
        init_m = _init_param("init_mean", init_mean, dtype, _home(init_mean))
        checks.add("init_mean", init_m, torch.isfinite, "finite")
    for name, p in (("init_mean", init_m), ("init_var", init_v)):
        shape = broadcast_init(name, shape, tuple(p.shape))
    with torch.no_grad():
        checks.fact("diffuse", torch.isinf(init_v.detach()).any())
        trans = [params[k].detach() for k in ("theta", "sigma", "dt")]
        home = trans[0].device if len({x.device for x in trans}) == 1 else device
        theta_h, sigma_h, dt_h = (to_device(x, home) for x in trans)
        # the noise sigma^2 dt phi(2 theta dt), phi in (0, 1], is formed from sigma^2 dt: finite with it
        checks.require(overflow_message(NOISE_OVERFLOW, dtype), torch.all(torch.isfinite(sigma_h * sigma_h * dt_h)))
        if triton:  # it picks its path by this fact
            checks.fact("no_noise", mobius.lacks_noise(*ou.discretize(theta_h, sigma_h, dt_h)))
    if defer and triton:  # read once the kernels are queued; until then the common facts are assumed
        pending, facts = checks.queue(), GUESSED
    else:
        pending, facts = None, checks.decide()
    moved = {k: to_device(v, device) for k, v in params.items()}
    p = Problem(y=y_t, init_mean=to_device(init_m, device), init_var=to_device(init_v, device), shape=shape,
                numpy_out=numpy_out, out_dtype=out_dtype, diffuse=facts["diffuse"], no_noise=facts.get("no_noise"),
                times=None if times_t is None else to_device(times_t, device), pending=pending, **plan, **moved)
    return _compacted(p)


def _compacted(p: Problem) -> Problem:
    """``p`` with each parameter that needs a gradient and is a broadcast view (an expanded
    per-step ``theta``) cut to size 1 along its broadcast dimensions
    (:func:`kalmanscan.ops.filter.torch.compact`): the backends' backward passes then sum its
    adjoint once, and autograd takes it to the view's base."""
    cut = {k: compact(x) for k in (*PARAMS, "init_mean", "init_var", "times")
           if isinstance(x := getattr(p, k), torch.Tensor) and x.requires_grad}
    cut = {k: x for k, x in cut.items() if x is not getattr(p, k)}
    return dataclasses.replace(p, **cut) if cut else p


_DERIVED = ("decay", "noise", "lam0", "eta0")


def host_parameters(values: dict, times: ArrayLike | None, init_mean: ArrayLike | None,
                    init_var: ArrayLike | None) -> bool:
    """Whether :func:`prepare` checks these parameters on the host (no synchronisation): every one
    of ``values`` (the six model parameters), ``init_mean`` and ``init_var`` a scalar or ``(C,)`` on
    the host, and no ``times``."""
    return times is None and all(on_host(x) for x in (*values.values(), init_mean, init_var))


def _prepare_host(y_t, vals, init_mean, init_var, numpy_out, out_dtype, plan) -> Problem:
    """:func:`prepare` for parameters that are scalars or ``(C,)`` on the host (the common call):
    checked with NumPy (no torch operation, no synchronisation), the derived ``decay, noise,
    lam0, eta0`` computed in float64, and everything moved to ``y``'s device in one copy of one
    ``(12, C)`` tensor whose rows become the problem's fields (``(1, C)`` views).

    The checked rows are remembered by the values they came from (:mod:`kalmanscan.problem.remembered`): a call with
    the parameters of a recent one skips the checks and the arithmetic, and pays the copy alone
    (a new tensor each call, so nothing returned shares memory with the remembered rows)."""
    values = (*(vals[k] for k in PARAMS), init_mean, init_var)
    keys = [value_key(x) for x in values]
    key = None if None in keys else (tuple(y_t.shape), y_t.dtype, y_t.device.type == "cuda", *keys)
    found = _HOST_ROWS.get(key, lambda: _host_rows(y_t, vals, init_mean, init_var))
    shape, rows, diffuse, no_noise = found
    C = shape[-1]
    packed = to_device(rows, y_t.device, copy=True).view(12, 1, C).unbind(0)
    fields = dict(zip(PARAMS + ("init_mean", "init_var") + _DERIVED, packed))
    derived = {k: fields.pop(k) for k in _DERIVED}
    p = Problem(y=y_t, shape=shape, numpy_out=numpy_out, out_dtype=out_dtype, diffuse=diffuse,
                no_noise=no_noise, **plan, **fields)
    p.derived = dict(derived, **{"from": {k: getattr(p, k) for k in PARAMS + ("init_mean", "init_var")}})
    return p


_HOST_ROWS = Remembered(64)
"""Checked rows by the values and ``y``'s layout they came from (:func:`_prepare_host`); ``y`` on
a GPU or not is part of the key (rows page-locked for a GPU)."""


def _host_rows(y_t, vals, init_mean, init_var) -> tuple:
    """The checks and arithmetic of :func:`_prepare_host`: ``(shape, rows, diffuse, no_noise)``,
    ``rows`` the ``(12, C)`` CPU tensor in the compute dtype (parameters, initial belief,
    ``decay, noise, lam0, eta0``), page-locked when ``y`` is on a GPU."""
    dtype, shape = y_t.dtype, tuple(y_t.shape)
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    arrs = {name: host_array(name, vals[name], np_dtype) for name in PARAMS}
    for name, a in arrs.items():
        shape = broadcast_param(name, shape, (1,) * (2 - a.ndim) + a.shape, shape[-2])
    inits = {name: None if x is None else host_array(name, x, np_dtype)
             for name, x in (("init_mean", init_mean), ("init_var", init_var))}
    for name, a in inits.items():
        if a is not None:
            shape = broadcast_init(name, shape, (1,) * (2 - a.ndim) + a.shape)
    C = shape[-1]
    rows = np.empty((12, C))
    for i, name in enumerate(PARAMS):
        rows[i] = arrs[name]
    for i, name in enumerate(PARAMS):
        if not within(rows[i], BOUNDS[name]).all():
            raise ValueError(f"{name} must be {requirement(BOUNDS[name])}")
    theta, sigma, obs_var, mean, h, dt = rows[:6]
    if inits["init_var"] is None:
        if not (theta != 0).all():
            raise ValueError(NEEDS_INIT_VAR_THETA)
        if not ((sigma != 0) | (theta == 0)).all():
            raise ValueError(NEEDS_INIT_VAR_SIGMA)
        with np.errstate(divide="ignore", over="ignore"):
            rows[7] = (sigma * sigma / (2.0 * theta)).astype(np_dtype)
        if not np.isfinite(rows[7]).all():  # (inf where theta = 0 is refused above)
            raise ValueError(overflow_message(STATIONARY_OVERFLOW, np_dtype))
    else:
        rows[7] = inits["init_var"]
        if not (rows[7] > 0).all():
            raise ValueError("init_var must be > 0 (or inf: a diffuse prior)")
    rows[6] = mean if inits["init_mean"] is None else inits["init_mean"]
    if not np.isfinite(rows[6]).all():
        raise ValueError("init_mean must be finite")
    with np.errstate(over="ignore"):
        rows[8], rows[9] = ou.discretize(theta, sigma, dt)
        if not np.isfinite(rows[9].astype(np_dtype)).all():
            raise ValueError(overflow_message(NOISE_OVERFLOW, np_dtype))
    with np.errstate(divide="ignore"):
        rows[10] = 1.0 / rows[7]
    rows[11] = rows[10] * (rows[6] - mean)
    smallest = np.where(rows[8] < 1, rows[9], 1.0).min()
    no_noise = bool(smallest < mobius.noise_bound(dtype))
    packed = torch.from_numpy(rows.astype(np_dtype))
    if y_t.device.type == "cuda":
        packed = packed.pin_memory()
    return shape, packed, bool(np.isinf(rows[7]).any()), no_noise


def _home(x) -> torch.device:
    """Where a value given by the caller is checked: a tensor's own device, else the CPU."""
    return x.device if isinstance(x, torch.Tensor) else torch.device("cpu")


def _as_2d(p):
    """Scalars become (1, 1) and (C,) becomes (1, C): static parameters get a unit time axis."""
    return p.reshape(1, 1) if p.ndim == 0 else (p.unsqueeze(-2) if p.ndim == 1 else p)


def _init_param(name, x, dtype, device):
    p = _to_tensor(name, x, dtype, device)
    return p.reshape(1, 1) if p.ndim == 0 else p.unsqueeze(-2)


def _dt_from_times(times, T, dtype, device, checks):
    if isinstance(times, np.ndarray) and times.dtype.kind in "mM":
        raise ValueError("times must be numeric; convert datetime64 with kalmanscan.xr or to float units")
    tt = _to_tensor("times", times, torch.float64, device)
    if tt.ndim == 1:
        tt = tt.unsqueeze(-1)
    if tt.ndim < 2 or tt.shape[-1] != 1 or tt.shape[-2] != T:
        raise ValueError(f"times must have shape (T,) or (..., T, 1) with T = {T}, got {tuple(tt.shape)}")
    checks.add("times", tt, torch.isfinite, "finite")
    diff = tt[..., 1:, :] - tt[..., :-1, :]
    checks.add("times", diff, lambda v: v > 0, "strictly increasing")
    dt = torch.cat([torch.ones_like(tt[..., :1, :]), diff], -2)
    return dt.to(dtype), tt
