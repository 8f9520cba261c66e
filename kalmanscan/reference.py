"""The ``"reference"`` backend: a sequential float64 Kalman filter in covariance form.

It is an independent formulation of the model, the oracle every fast path is tested against: it
never uses precisions, Möbius maps or scans, only the textbook predict/update recursion on the
mean and variance, with the Joseph-form variance update and scipy.stats for the log-density. Like
every backend it tracks the state relative to the OU mean (``x - mean``) and forms the innovation
as ``(y - h mean) - h (x - mean)``: with data offset far from zero (1e4, say) the uncentred
``y - h x`` loses ``log10(offset / innovation)`` digits to cancellation even in float64. It runs
on the CPU in NumPy, one time step at a time (vectorised over ``(..., C)``).

Model per channel: ``x_t - mean_t = a_t (x_{t-1} - mean_{t-1}) + N(0, q_t)`` for ``t >= 1`` (a
per-step ``mean`` is a known trend; the deviation from it is the OU process), ``x_0 ~
N(init_mean, init_var)``, ``y_t = h_t x_t + N(0, obs_var_t)``, NaN ``y_t`` missing.
"""

from __future__ import annotations

import numpy as np
from scipy import stats

from . import ou
from .inputs import Problem

__all__ = ["filter_reference"]


def filter_reference(p: Problem) -> dict:
    """Filter the validated problem ``p`` sequentially in float64; returns NumPy arrays."""
    shape = p.shape
    arr = {k: np.broadcast_to(getattr(p, k).detach().cpu().double().numpy(), shape)
           for k in ("y", "theta", "sigma", "obs_var", "mean", "h", "dt")}
    decay, noise = ou.discretize(arr["theta"], arr["sigma"], arr["dt"])
    cshape = shape[:-2] + (shape[-1],)
    init_mean = np.broadcast_to(p.init_mean.detach().cpu().double().numpy()[..., 0, :], cshape)
    z = init_mean - arr["mean"][..., 0, :]
    P = np.broadcast_to(p.init_var.detach().cpu().double().numpy()[..., 0, :], cshape).copy()
    out = {k: np.empty(shape) for k in ("mean", "var", "pred_mean", "pred_var",
                                        "pred_obs_mean", "pred_obs_var", "logliks")}
    for t in range(shape[-2]):
        mean_t, h, R, y = (arr[k][..., t, :] for k in ("mean", "h", "obs_var", "y"))
        if t > 0:
            a = decay[..., t, :]
            z = a * z
            P = a * a * P + noise[..., t, :]
        out["pred_mean"][..., t, :] = z + mean_t
        out["pred_var"][..., t, :] = P
        S = h * h * P + R
        out["pred_obs_mean"][..., t, :] = h * (z + mean_t)
        out["pred_obs_var"][..., t, :] = S
        seen = ~np.isnan(y)
        innovation = np.where(seen, (y - h * mean_t) - h * z, 0.0)
        K = np.where(seen, P * h / S, 0.0)
        z = z + K * innovation
        P = (1 - K * h) ** 2 * P + K * K * R
        out["mean"][..., t, :] = z + mean_t
        out["var"][..., t, :] = P
        out["logliks"][..., t, :] = np.where(seen, stats.norm.logpdf(innovation, 0.0, np.sqrt(S)), 0.0)
    with np.errstate(divide="ignore", over="ignore"):  # var 0 (no process noise): precision inf
        out["precision"] = 1.0 / out["var"]
        out["pred_precision"] = 1.0 / out["pred_var"]
    out["decay"], out["noise"] = decay, noise
    out["missing"] = np.isnan(arr["y"]).astype(np.float64)
    return out
