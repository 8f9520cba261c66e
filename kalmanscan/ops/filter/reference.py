"""The ``"reference"`` backend: a sequential float64 Kalman filter and RTS smoother in covariance form.

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

import torch

from kalmanscan.model import ou
from kalmanscan.problem.problem import Problem

__all__ = ["filter", "smooth"]


def filter(p: Problem) -> dict:
    """Filter the validated problem ``p`` sequentially in float64; returns NumPy arrays (the
    contract of every backend's ``filter``, :mod:`kalmanscan.ops.filter`)."""
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


def smooth(f: dict[str, torch.Tensor], mean_param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Smoothed ``(mean, var, precision)`` from the filter's tensors ``f`` by the RTS recursion as a
    sequential float64 NumPy loop: the oracle of every backend's ``smooth``.

    The variance is carried as the ratio ``rho_t = var_s_t / var_t`` in ``[0, 1]``, so that no step
    subtracts: with ``J_t = a_{t+1} var_t / pred_var_{t+1}``, the textbook ``var_s_t = var_t + J_t^2
    (var_s_{t+1} - pred_var_{t+1})`` is, exactly,

        rho_t = k_t + c_t g_{t+1} rho_{t+1},   rho_{T-1} = 1,   var_s_t = var_t rho_t
        k_t = q_{t+1} / pred_var_{t+1},   c_t = a_{t+1}^2 var_t / pred_var_{t+1} = 1 - k_t,
        g_{t+1} = var_{t+1} / pred_var_{t+1}

    (``g`` in ``[0, 1]`` is the share of the predicted variance left by the update; ``c`` formed as
    ``1 - k`` is exactly 1 without process noise, where a subnormal ``pred_var`` would round the
    quotient).
    Each term is a product of non-negative factors, so the relative error of ``var_s`` grows by a
    few ulps a step whatever the conditioning (the textbook difference loses up to all its digits),
    and nothing over- or underflows beyond ``var_t`` itself. A predicted variance of exactly 0 (no
    process noise, ``a^2 var_t`` 0 or below the range) is read as its limit: the next state is
    ``a x_t``, so ``c = 1`` where ``a > 0`` and ``c = 0`` where ``a = 0`` (the next state says
    nothing of this one), ``g = 1``, and ``J = 0``: the next step's update and correction are 0
    (its variance is 0), and the exact correction is of the order of ``a var_t h^2 / obs_var``.
    The mean is the textbook ``mean_s_t = mean_t + J_t (mean_s_{t+1} - pred_mean_{t+1})``."""
    g = {k: v.detach().cpu().double().numpy() for k, v in f.items()}
    mean_param = mean_param.detach().cpu().double().numpy()
    mu, var = g["mean"] - mean_param, g["var"]
    mu_s, var_s = mu.copy(), var.copy()
    rho = np.ones(var.shape[:-2] + var.shape[-1:])
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # the branches np.where drops
        for t in range(mu.shape[-2] - 2, -1, -1):
            a, q, v = g["decay"][..., t + 1, :], g["noise"][..., t + 1, :], var[..., t, :]
            pv, v_next = g["pred_var"][..., t + 1, :], var[..., t + 1, :]
            known = pv > 0
            J = np.where(known, a * v / pv, 0.0)
            moves = (a > 0).astype(np.float64)
            k = np.where(known, q / pv, 1.0 - moves)
            c = np.where(known, 1.0 - k, moves)
            rho = k + c * np.where(known, v_next / pv, 1.0) * rho
            var_s[..., t, :] = v * rho
            pred_next = g["pred_mean"][..., t + 1, :] - mean_param[..., t + 1, :]
            mu_s[..., t, :] = mu[..., t, :] + J * (mu_s[..., t + 1, :] - pred_next)
    dev, dtype = f["mean"].device, f["mean"].dtype
    mean_s, var_s = (torch.as_tensor(x, device=dev).to(dtype) for x in (mu_s + mean_param, var_s))
    return mean_s, var_s, 1.0 / var_s
