"""``ks.smooth``: Rauch–Tung–Striebel smoothing as two reverse affine scans over the filter's output.

Given the filtered centred mean ``mu_t`` and variance ``var_t`` and the one-step predictions of the
next step, with ``J_t = a_{t+1} var_t / pred_var_{t+1}``:

    mu_s_t  = J_t mu_s_{t+1} + (mu_t - J_t pred_mu_{t+1})
    var_s_t = J_t^2 var_s_{t+1} + var_t q_{t+1} / pred_var_{t+1}

and ``mu_s_{T-1} = mu_{T-1}``, ``var_s_{T-1} = var_{T-1}``. The variance recursion is written with
``var_t - J_t^2 pred_var_{t+1} = var_t q_{t+1} / pred_var_{t+1} >= 0``, so every term is
non-negative and nothing cancels. Both are affine recursions run backwards in time by
:func:`kalmanscan.scan.associative_scan` (``reverse=True``): O(T) work, O(log T) depth,
differentiable by autograd through whichever backend produced the filter. On the triton backend
without gradients, fused reverse walks (:mod:`kalmanscan.fused_smooth`) run them instead.
"""

from __future__ import annotations

import numpy as np
import torch

from . import mobius
from .filtering import make_posterior, resolve_backend, run_backend
from .inputs import prepare
from .scan import associative_scan

__all__ = ["smooth", "rts_torch", "rts_reference"]


def smooth(y, *, theta, sigma, obs_var, mean=0.0, h=1.0, dt=1.0, times=None,
           init_mean=None, init_var=None, backend="auto"):
    """Smoothed moments ``p(x_t | y_0..y_{T-1})``; arguments as :func:`kalmanscan.filter`.

    Returns a :class:`~kalmanscan.Posterior` whose ``mean, var, precision`` are smoothed; its
    ``pred_*`` fields and ``logliks`` are the filter's (one-step predictions and likelihood do not
    change under smoothing), and ``filtered`` holds the filter's full posterior.
    """
    p = prepare(y, theta=theta, sigma=sigma, obs_var=obs_var, mean=mean, h=h, dt=dt, times=times,
                init_mean=init_mean, init_var=init_var, backend=backend)
    out = run_backend(p, backend)
    shape = p.shape
    full = {k: torch.broadcast_to(out[k], shape) for k in ("mean", "var", "pred_mean", "pred_var", "decay", "noise")}
    name = resolve_backend(backend, p.y.device)
    mean_param = torch.broadcast_to(p.mean, shape)
    if name == "triton" and not (torch.is_grad_enabled() and any(x.requires_grad for x in full.values())):
        from .fused_smooth import rts_triton
        mean_s, var_s, precision_s = rts_triton(full, mean_param)
    else:
        mean_s, var_s = (rts_reference if name == "reference" else rts_torch)(full, mean_param)
        precision_s = 1.0 / var_s
    if mobius.no_process_noise(full["decay"], full["noise"]) and not bool(
            (torch.isfinite(mean_s) & torch.isfinite(var_s)).all()):
        raise ValueError("sigma must be > 0 where theta > 0 to smooth this series: without process "
                         "noise the smoother's gain is 1/decay and its backward recursion leaves the "
                         "floating-point range (ks.filter handles sigma = 0)")
    smoothed = dict(out, mean=mean_s, var=var_s, precision=precision_s)
    return make_posterior(p, smoothed, filtered=make_posterior(p, out))


def _gain_terms(f, mean_param):
    mu = f["mean"] - mean_param
    pred_mu = f["pred_mean"] - mean_param
    a_next, q_next, pv_next = (x[..., 1:, :] for x in (f["decay"], f["noise"], f["pred_var"]))
    J = a_next * f["var"][..., :-1, :] / pv_next
    bm = mu[..., :-1, :] - J * pred_mu[..., 1:, :]
    bv = f["var"][..., :-1, :] * q_next / pv_next
    return mu, J, bm, bv


def rts_torch(f: dict, mean_param):
    """Smoothed ``(mean, var)`` from filter tensors ``f`` (each ``(..., T, C)``) by reverse scans."""
    mu, J, bm, bv = _gain_terms(f, mean_param)
    last = (torch.zeros_like(mu[..., -1:, :]), mu[..., -1:, :])
    elems = (torch.cat([J, last[0]], -2), torch.cat([bm, last[1]], -2))
    _, mu_s = associative_scan(mobius.affine_compose, elems, dim=-2, reverse=True)
    elems = (torch.cat([J * J, last[0]], -2), torch.cat([bv, f["var"][..., -1:, :]], -2))
    _, var_s = associative_scan(mobius.affine_compose, elems, dim=-2, reverse=True)
    return mu_s + mean_param, var_s


def rts_reference(f: dict, mean_param):
    """The same smoother as a sequential float64 NumPy loop (the oracle for :func:`rts_torch`)."""
    g = {k: v.detach().cpu().double().numpy() for k, v in f.items()}
    mean_param = mean_param.detach().cpu().double().numpy()
    mu, var = g["mean"] - mean_param, g["var"]
    mu_s, var_s = mu.copy(), var.copy()
    with np.errstate(divide="ignore", invalid="ignore"):  # 0/0 without process noise: smooth() raises
        for t in range(mu.shape[-2] - 2, -1, -1):
            a, pv = g["decay"][..., t + 1, :], g["pred_var"][..., t + 1, :]
            J = a * var[..., t, :] / pv
            mu_s[..., t, :] = mu[..., t, :] + J * (mu_s[..., t + 1, :] - (g["pred_mean"][..., t + 1, :] - mean_param[..., t + 1, :]))
            var_s[..., t, :] = var[..., t, :] + J * J * (var_s[..., t + 1, :] - pv)
    dev = f["mean"].device
    return (torch.as_tensor(mu_s + mean_param, device=dev).to(f["mean"].dtype),
            torch.as_tensor(var_s, device=dev).to(f["mean"].dtype))

