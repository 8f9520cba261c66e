"""``ks.fit``: maximum-likelihood estimation of the model's parameters by autograd through the filter.

The objective is the exact Gaussian log-likelihood of :func:`kalmanscan.filter` (missing values and
irregular times included), maximised over unconstrained coordinates: ``log`` of each positive
parameter (``theta, sigma, obs_var, init_var``) relative to its initial guess, and ``(value -
guess) / scale`` for ``mean`` and ``init_mean`` (``scale`` the data's standard deviation), so every
coordinate starts at 0 and is of order 1. The minimised objective is the sum over independent
series of ``-loglik / n_obs`` (per observation), so tolerances do not depend on ``T`` or on the
number of channels.

The objective is lean (:class:`kalmanscan.estimation.likelihood.Likelihood`): the inputs are validated once,
and each evaluation is one call of the backend's filter for the log-likelihoods and its exact
first-order backward, on whatever device ``y`` is (the compiled loops on the CPU, the fused
kernels on CUDA), read back by the optimiser with the gradient in one transfer; on a GPU the
evaluation (forward, backward and both copies) is replayed from one CUDA graph
(:mod:`kalmanscan.estimation.graphed`). On the ``"cpu"`` backend in float64, L-BFGS gets the objective and
its gradient from NumPy directly (:attr:`kalmanscan.estimation.likelihood.Likelihood.numpy`: no torch
operation per evaluation).

Standard errors come from the observed information: the Hessian of ``-loglik`` with respect to the
natural parameters at the optimum, by central differences of the exact gradient in float64
(:func:`kalmanscan.estimation.likelihood.gradient_and_hessian`). Independent series (channels when
``shared=False``, batch elements always) have a block-diagonal Hessian, so moving one name in
every series at once gives a column of every ``P x P`` block (``P`` the number of estimated
names): ``2 P`` gradient evaluations in all. A positive parameter whose optimum is on its boundary (such
as ``theta -> 0``: the likelihood still rises towards 0 and a Newton step from the estimate would
cross it) has no standard error (NaN, flagged in ``on_boundary``); the others come from the Hessian
of the free parameters alone. A block that is still not positive definite gets NaN throughout.

Series that cannot be estimated are not fitted: a series with fewer observations than the
parameters it estimates (none at all, or a series of length 1 or 2) keeps the initial guess, gets
NaN standard errors and makes ``converged`` False, with ``reason`` naming it. A constant series with
``obs_var`` estimated has no maximum-likelihood estimate (``obs_var -> 0``) and raises a
``ValueError`` naming the channel. The model and the likelihood are in ``docs/math.md``.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np
import torch

from kalmanscan import tuning
from kalmanscan.estimation import chunked
from kalmanscan.estimation.result import METHOD_NAMES, FitResult, as_numpy
from kalmanscan.inference.frames import pandas_in
from kalmanscan.problem.prepare import prepare
from kalmanscan.estimation.likelihood import POSITIVE as _POSITIVE
from kalmanscan.estimation.likelihood import Likelihood, gradient_and_hessian, spd_inverse, valid
from kalmanscan.estimation.optimize import adam, lbfgs, lbfgs_numpy


__all__ = ["fit", "FitResult", "ESTIMABLE"]

ESTIMABLE = ("theta", "sigma", "obs_var", "mean", "init_mean", "init_var")
_MODEL = ("theta", "sigma", "obs_var", "mean")
_PLACEHOLDERS = dict(theta=1.0, sigma=1.0, obs_var=1.0, mean=0.0)
"""Values an estimated model parameter holds in the prepared problem until its guess replaces it."""




@pandas_in
def fit(y: Any, *, theta: Any = None, sigma: Any = None, obs_var: Any = None, mean: Any = 0.0, h: Any = 1.0,
        dt: Any = 1.0, times: Any = None, init_mean: Any = None, init_var: Any = None,
        estimate: str | tuple | list = ("theta", "sigma", "obs_var"), shared: bool = False,
        method: str = "lbfgs", max_iter: int | None = None, tol: float = 1e-6, progress: bool | None = None,
        backend: str = "auto") -> FitResult:
    """Maximum-likelihood estimates of the filter's parameters for ``y`` of shape ``(..., T, C)``.

    Args:
        y: observations ``(..., T, C)``; NaN = missing. NumPy in gives NumPy params; a tensor gives
            detached tensors of its dtype on its device. A pandas ``DataFrame`` or ``Series`` is read
            as :func:`kalmanscan.filter` reads it (its index the times, ``time_unit=`` for dates).
            A dask array chunked along time (or a DataArray of one, read positionally) is fitted
            one time chunk at a time, holding one chunk and the beliefs at the chunk boundaries
            (:mod:`kalmanscan.estimation.chunked`; float64, on the CPU; fixed per-step values and
            ``times`` may be dask arrays too).
        theta, sigma, obs_var, mean, init_mean, init_var: for a name in ``estimate``, the initial
            guess (``None``: a guess from the data; scalars or ``(C,)``, or ``B + (1, C)``, for the
            model parameters, ``B + (C,)`` for ``init_*``); for any other name, the fixed value
            passed to :func:`kalmanscan.filter` as is (static or per step). Positive names that are
            estimated need a guess ``> 0``. ``mean=None`` with ``"mean"`` estimated starts from the
            data's mean.
        h, dt, times, backend: as :func:`kalmanscan.filter` (fixed). Irregular ``times`` and NaN
            gaps enter the likelihood exactly.
        estimate: names to estimate, a subset of ``("theta", "sigma", "obs_var", "mean",
            "init_mean", "init_var")``. E.g. the local level model: ``theta=0.0, init_var=float("inf"),
            estimate=("sigma", "obs_var")``.
        shared: one set of parameters for all channels (per batch element) instead of one per
            channel.
        method: ``"lbfgs"`` (scipy's L-BFGS-B with torch gradients; the default) or ``"adam"``
            (learning rate 0.05 in the unconstrained coordinates).
        max_iter: iteration limit; default 200 for L-BFGS, 2000 for Adam.
        tol: converged when every gradient component of the per-observation objective (in the
            unconstrained coordinates) is at most ``tol``, or (L-BFGS) when an iteration no longer
            reduces the objective beyond float64 rounding.
        progress: show a tqdm bar; ``None`` shows it when stderr is a terminal and the fit is long.
            It ends at 100% and says ``converged`` when the fit stops before ``max_iter``.

    Returns:
        :class:`FitResult` (parameters, log-likelihood, convergence, standard errors, covariance).
        A series (a channel, or with ``shared=True`` a batch element) with fewer observed values
        than estimated names (for example one that is all NaN) is not fitted: its parameters stay
        at the initial guess, its standard errors are NaN, and ``converged`` is False with
        ``reason`` naming it. The other series are fitted as usual.

    Raises:
        ValueError: naming the argument, for boolean or non-numeric ``y``, an unknown name in
            ``estimate``, a bad ``method``, a missing fixed value, an estimated guess that is not
            positive or not static, a constant channel of ``y`` when ``obs_var`` is estimated, or
            any input :func:`kalmanscan.filter` rejects.
    """
    estimate = _check_estimate(estimate)
    if method not in METHOD_NAMES:
        raise ValueError(f"method must be 'lbfgs' or 'adam', got {method!r}")
    if backend == "reference":
        raise ValueError("backend='reference' is not differentiable; use 'torch', 'triton' or 'auto'")
    if max_iter is None:
        max_iter = 200 if method == "lbfgs" else 2000
    if isinstance(max_iter, (bool, np.bool_)) or not (isinstance(max_iter, (int, np.integer)) and max_iter >= 1):
        raise ValueError(f"max_iter must be an integer >= 1, got {max_iter!r}")
    if isinstance(tol, (bool, np.bool_)) or not (isinstance(tol, (int, float, np.number)) and tol > 0):
        raise ValueError(f"tol must be a number > 0, got {tol!r}")
    if not isinstance(shared, (bool, np.bool_)):
        raise ValueError(f"shared must be True or False, got {shared!r}")

    numpy_in = not isinstance(y, torch.Tensor)
    data = chunked.as_record(y)
    record = data is not None  # a dask array: one time chunk at a time (kalmanscan.estimation.chunked)
    y = data if record else y
    y_t = None if record else _as_y(y)
    shape = tuple(y.shape if record else y_t.shape)
    batch, C = shape[:-2], shape[-1]
    like = dict(dtype=torch.float64, device=torch.device("cpu")) if record else dict(dtype=y_t.dtype,
                                                                                      device=y_t.device)
    Cp = 1 if shared else C
    values = dict(theta=theta, sigma=sigma, obs_var=obs_var, mean=mean, init_mean=init_mean, init_var=init_var)
    for k in _MODEL:
        if k not in estimate and values[k] is None:
            raise ValueError(f"{k} is required when it is not estimated")
    fixed = {k: v for k, v in values.items() if k not in estimate and v is not None}
    # y, the steps and the fixed values checked once, as ks.filter checks them, before the guesses;
    # the estimated names hold placeholders until the guesses replace them (Likelihood.of_problem)
    placeholders = {**_PLACEHOLDERS, **({"init_var": 1.0} if "init_var" in estimate else {})}
    p = None if record else prepare(y_t, **{**placeholders, **fixed}, h=h, dt=dt, times=times, backend=backend)
    settings = dict(h=h, dt=dt, times=times, backend=backend)
    stats = chunked.statistics(y, torch.float64) if record else _statistics(y_t)
    observed = stats["observed"]
    n_group = observed.sum(-1, keepdim=True) if shared else observed
    identified = n_group >= len(estimate)
    if "obs_var" in estimate:
        _check_constant(stats, identified, shared)
    guess = _guesses(stats, values, estimate, batch, Cp, h, dt, times, like)
    scale = _data_scale(stats["var"], batch, Cp)

    def natural(u):
        out = {}
        for k in estimate:
            out[k] = guess[k] * torch.exp(u[k]) if k in _POSITIVE else guess[k] + scale * u[k]
        return out

    if record:
        lik = chunked.ChunkedLikelihood(y, fixed, guess, h=h, dt=dt, times=times, backend=backend)
    else:
        lik = Likelihood.of_problem(p, tuple(fixed), guess)
    weight = 1.0 / torch.clamp(n_group, min=1.0)
    infinite = torch.tensor(math.inf, **like)

    def objective(u, graphed=False):
        nat = natural(u)
        ll = lik(nat, graphed=graphed)
        if shared:
            ll = ll.sum(-1, keepdim=True)
        loss = -torch.where(identified, ll * weight, torch.zeros_like(ll)).sum()
        return torch.where(valid(nat), loss, infinite)  # a step so long that a parameter under- or overflowed

    u = {k: torch.zeros(batch + (Cp,), **like, requires_grad=True) for k in estimate}
    if progress is None:
        progress = sys.stderr.isatty() and math.prod(shape) * max_iter >= 5e6
    if method == "lbfgs" and lik.numpy is not None:  # the compiled loops fed from NumPy: no torch per evaluation
        fun = _numpy_objective(lik, guess, scale, weight, identified, shared)
        converged, n_iter, message, x = lbfgs_numpy(fun, sum(v.numel() for v in u.values()), max_iter, tol, progress)
        with torch.no_grad():
            for v, chunk in zip(u.values(), torch.split(torch.from_numpy(x), [v.numel() for v in u.values()])):
                v.copy_(chunk.reshape(v.shape))
    elif method == "lbfgs":
        graphed = (not record and tuning.current().fit_graphs and p.backend == "triton" and y_t.is_cuda
                   and not lik.p.diffuse)
        captured = (lambda: objective(u, graphed=True)) if graphed else None
        converged, n_iter, message = lbfgs(objective, u, max_iter, tol, progress, captured=captured)
    else:
        converged, n_iter, message = adam(objective, u, max_iter, tol, progress)
    reason = "" if converged else message
    if not bool(identified.all()):
        converged = False
        reason = _unfitted_reason(n_group, identified, len(estimate), batch, shared) + ("; " + reason if reason else "")

    with torch.no_grad():
        nat = {k: v.detach() for k, v in natural(u).items()}
        loglik = lik(nat)
    cov, bound = _covariance(lik, nat, estimate, scale)
    nan = torch.tensor(math.nan, dtype=cov.dtype, device=cov.device)
    cov = torch.where(identified[..., None, None], cov, nan)
    bound = bound & identified[..., None]
    se = torch.sqrt(torch.diagonal(cov, dim1=-2, dim2=-1))

    def out(x, name):
        x = x.detach()
        if name in _MODEL and batch:
            x = x.unsqueeze(-2)
        return x.cpu().numpy() if numpy_in else x

    params = {k: v for k, v in values.items() if v is not None and k not in estimate}
    params.update({k: out(nat[k], k) for k in estimate})
    params = {k: params[k] for k in ESTIMABLE if k in params}
    stderr = {k: out(se[..., i], k) for i, k in enumerate(estimate)}
    on_boundary = {k: out(bound[..., i], k) for i, k in enumerate(estimate)}
    conv = (lambda x: x.detach().cpu().numpy()) if numpy_in else (lambda x: x.detach())
    return FitResult(params=params, loglik=conv(loglik), converged=converged, n_iter=n_iter,
                     message=message, stderr=stderr, cov=conv(cov), names=estimate,
                     n_obs=conv(observed), method=method, settings=settings, reason=reason,
                     on_boundary=on_boundary, fitted=conv(identified))


def _numpy_objective(lik, guess, scale, weight, identified, shared):
    """``fun(x) -> (f, gradient)`` in float64 NumPy: the objective of :func:`fit` on the flattened
    unconstrained coordinates ``x`` (in ``guess``'s order) by :attr:`Likelihood.numpy`."""
    names = tuple(guess)
    g0 = {k: v.numpy() for k, v in guess.items()}
    s0, w, ok = scale.numpy(), weight.numpy(), identified.numpy()
    shape = next(iter(g0.values())).shape
    cot = np.broadcast_to(-np.where(ok, w, 0.0), lik.batch + (lik.p.shape[-1],))
    size = math.prod(shape)

    def fun(x):
        u = dict(zip(names, (x[i * size:(i + 1) * size].reshape(shape) for i in range(len(names)))))
        e = {k: np.exp(u[k]) for k in names if k in _POSITIVE}
        nat = {k: g0[k] * e[k] if k in e else g0[k] + s0 * u[k] for k in names}
        if not all(np.all(np.isfinite(v) & (v > 0)) if k in e else np.all(np.isfinite(v)) for k, v in nat.items()):
            return math.inf, np.zeros_like(x)
        ll, g = lik.numpy.evaluate(nat, cot)
        if shared:
            ll = ll.sum(-1, keepdims=True)
        f = -float(np.where(ok, ll * w, 0.0).sum())
        du = [g[k] * g0[k] * e[k] if k in e else g[k] * s0 for k in names]
        return f, np.concatenate([d.reshape(-1) for d in du])

    return fun


def _check_estimate(estimate):
    if isinstance(estimate, str):
        estimate = (estimate,)
    estimate = tuple(estimate)
    bad = [k for k in estimate if k not in ESTIMABLE]
    if bad or len(set(estimate)) != len(estimate):
        raise ValueError(f"estimate must be distinct names from {ESTIMABLE}, got {estimate}")
    if not estimate:
        raise ValueError("estimate must name at least one parameter")
    return estimate


def _as_y(y):
    if isinstance(y, torch.Tensor):
        if y.dtype == torch.bool:
            raise ValueError("y must be numeric observations, got a boolean tensor (convert it with "
                             "y.double() if 0/1 values are really meant)")
        return y.detach().to(y.dtype if y.dtype in (torch.float32, torch.float64) else torch.float64)
    arr = np.asarray(y)
    if arr.dtype.kind == "b":
        raise ValueError("y must be numeric observations, got a boolean array (convert it with "
                         "y.astype(float) if 0/1 values are really meant)")
    if arr.dtype.kind not in "iuf":
        raise ValueError(f"y must be numeric, got dtype {arr.dtype}")
    return torch.as_tensor(arr.astype(np.float64))


def _series_name(index, batch, shared) -> str:
    """``"channel 2"``, ``"batch element (1,), channel 2"`` or ``"batch element (1,)"`` (shared)."""
    *b, c = index
    where = f"batch element {tuple(b)}" if batch else ""
    if shared:
        return where or "the series"
    return f"{where}, channel {c}" if where else f"channel {c}"


def _names(indices, batch, shared, limit=5):
    names = [_series_name(tuple(int(i) for i in ix), batch, shared) for ix in indices[:limit]]
    return ", ".join(names) + (f" and {len(indices) - limit} more" if len(indices) > limit else "")


def _unfitted_reason(n_group, identified, P, batch, shared) -> str:
    """Why series were not fitted: ``"channel 1 has no observations; ..."``."""
    n = n_group.detach().cpu().numpy()
    bad = np.argwhere(~identified.detach().cpu().numpy())
    none = np.array([ix for ix in bad if n[tuple(ix)] == 0])
    few = np.array([ix for ix in bad if n[tuple(ix)] > 0])
    parts = []
    if none.size:
        parts.append(f"{_names(none, batch, shared)}: no observations")
    if few.size:
        counts = sorted({int(n[tuple(ix)]) for ix in few})
        parts.append(f"{_names(few, batch, shared)}: {'/'.join(map(str, counts))} observation(s), fewer than the "
                     f"{P} estimated parameters")
    return ("not fitted (" + "; ".join(parts) + "); their parameters are the initial guess and their "
            "standard errors NaN")


def _check_constant(stats, identified, shared) -> None:
    """``ValueError`` naming the first fitted series whose observed values are all equal (``stats``:
    :func:`_statistics`)."""
    lo, hi = stats["lo"], stats["hi"]
    const = lo == hi  # False for a channel without observations
    if shared:
        const = ((const | torch.isinf(lo)).all(-1, keepdim=True) & identified).expand_as(const) & const
    else:
        const = const & identified
    bad = np.argwhere(const.cpu().numpy())
    if bad.size == 0:
        return
    ix = tuple(int(i) for i in bad[0])
    what = _series_name(ix, tuple(lo.shape[:-1]), False)
    every = ", as is every channel" if shared else ""
    raise ValueError(f"y: {what} is constant (every observed value is {float(lo[ix]):g}){every}: "
                     "the likelihood grows without bound as obs_var -> 0, so obs_var has no maximum-likelihood "
                     "estimate; leave the channel out, or pass obs_var and leave it out of estimate")


def _statistics(y):
    """Per series ``B + (C,)`` over time: ``observed`` (non-NaN count), ``lo`` and ``hi`` (smallest
    and largest observed value, ``inf`` and ``-inf`` without one), NaN-aware ``mean`` and ``var``
    and ``dvar`` (the variance of consecutive differences; ``var`` for ``T = 1``), as
    :func:`kalmanscan.estimation.chunked.statistics` gives them for a dask array."""
    with torch.no_grad():
        missing = torch.isnan(y)
        var = _nanvar(y)
        return dict(observed=(~missing).to(y.dtype).sum(-2),
                    lo=torch.where(missing, torch.full_like(y, math.inf), y).amin(-2),
                    hi=torch.where(missing, torch.full_like(y, -math.inf), y).amax(-2),
                    mean=torch.nanmean(y, -2), var=var,
                    dvar=_nanvar(y[..., 1:, :] - y[..., :-1, :]) if y.shape[-2] > 1 else var)


def _pool(x, batch, Cp):
    """Reduce a ``B + (C,)`` statistic to ``B + (Cp,)`` by a NaN-aware mean over channels."""
    x = torch.broadcast_to(x, batch + (x.shape[-1],))
    return torch.nanmean(x, -1, keepdim=True) if Cp == 1 else x


def _data_scale(var, batch, Cp):
    """The data's standard deviation per series (1 where its variance ``var`` is undefined or zero)."""
    var = torch.where(torch.isfinite(var) & (var > 0), var, torch.ones_like(var))
    return torch.sqrt(_pool(var, batch, Cp))


def _nanvar(x, dim=-2):
    m = torch.nanmean(x, dim, keepdim=True)
    return torch.nanmean((x - m) ** 2, dim)


def _guesses(stats, values, estimate, batch, Cp, h, dt, times, like):
    """Initial values ``B + (Cp,)`` for the estimated names (given ones checked and broadcast), from
    the data's ``stats`` (:func:`_statistics`)."""
    var = torch.where(torch.isfinite(stats["var"]) & (stats["var"] > 0), stats["var"], torch.ones_like(stats["var"]))
    dvar = torch.where(torch.isfinite(stats["dvar"]) & (stats["dvar"] > 0), stats["dvar"], var)
    step = _typical_step(dt, times)
    h_bar = float(np.mean(np.abs(as_numpy(h)))) or 1.0
    level = stats["mean"] / h_bar
    level = torch.where(torch.isfinite(level), level, torch.zeros_like(level))
    defaults = dict(theta=torch.full_like(var, 0.1 / step), sigma=torch.sqrt(dvar / (2 * step)) / h_bar,
                    obs_var=dvar / 4, mean=level, init_mean=level, init_var=var / h_bar**2)
    out = {}
    for k in estimate:
        v = values[k]
        if v is None:
            out[k] = _pool(defaults[k], batch, Cp)
            continue
        t = torch.as_tensor(v.detach() if isinstance(v, torch.Tensor) else np.array(v, dtype=np.float64), **like)
        if k in _MODEL and t.ndim >= 2:
            if t.shape[-2] != 1:
                raise ValueError(f"{k}: an estimated parameter must be static (scalar, (C,) or (..., 1, C)), "
                                 f"got shape {tuple(t.shape)}")
            t = t.squeeze(-2)
        try:
            t = torch.broadcast_to(t, batch + (Cp,)).clone()
        except RuntimeError:
            raise ValueError(f"{k}: initial guess of shape {tuple(t.shape)} does not broadcast to {batch + (Cp,)}"
                             + (" (shared=True takes one value per batch element)" if Cp == 1 else "")) from None
        ok = torch.isfinite(t) & (t > 0) if k in _POSITIVE else torch.isfinite(t)
        if not bool(ok.all()):
            raise ValueError(f"{k}: the initial guess must be finite"
                             + (" and > 0 (its logarithm is optimised)" if k in _POSITIVE else ""))
        out[k] = t
    return out


def _typical_step(dt, times):
    if times is not None:
        steps = np.diff(as_numpy(times).astype(np.float64), axis=-2 if as_numpy(times).ndim >= 2 else -1)
        return float(np.median(steps)) if steps.size else 1.0
    d = as_numpy(dt).astype(np.float64)
    return float(np.median(d)) if d.size else 1.0


def _covariance(lik, nat, names, scale):
    """Inverse Hessian of ``-loglik`` per independent series, ``B + (Cp, P, P)``, and the boundary
    mask ``B + (Cp, P)``, in ``nat``'s dtype.

    The Hessian is :func:`kalmanscan.estimation.likelihood.gradient_and_hessian` of the likelihood in float64
    (central differences of the exact gradient). A positive parameter ``p`` is on its boundary
    when ``-loglik`` still decreases towards 0 there (gradient ``g > 0``) and a Newton step
    ``g / H_pp`` would cross 0 (or ``H_pp <= 0``). Its row and column are NaN; the covariance of
    the others is the inverse of the Hessian of the free parameters alone. A block whose free
    part is not positive definite is NaN throughout.
    """
    dtype = next(iter(nat.values())).dtype
    nat = {k: v.double() for k, v in nat.items()}
    g, H = gradient_and_hessian(lik.in_float64(), nat, names, scale.double())
    p = torch.stack([nat[k] for k in names], -1)
    positive = torch.tensor([k in _POSITIVE for k in names], device=H.device)
    h_pp = torch.diagonal(H, dim1=-2, dim2=-1)
    bound = positive & (g > 0) & ((h_pp <= 0) | (g >= p * h_pp))
    free = ~bound
    pair = free[..., :, None] & free[..., None, :]
    eye = torch.eye(H.shape[-1], dtype=H.dtype, device=H.device)
    cov, bad = spd_inverse(torch.where(pair, H, eye))
    nan = torch.full_like(cov, math.nan)
    return torch.where(bad[..., None, None] | ~pair, nan, cov).to(dtype), bound
