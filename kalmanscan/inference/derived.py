"""The fields of a filter's :class:`~kalmanscan.Posterior` that follow from its filtered mean and
variance, the parameters and ``y``, derived in one vectorised pass (:func:`derive`).

A default :func:`kalmanscan.filter` call has its backend write only the filtered mean and variance
and sum the log-likelihood; the others are made from them on first access. With the centred
filtered mean ``z_t = mean_t - m_t`` (``m`` the OU mean level) and ``(a_t, q_t)`` the transition
into step ``t``:

    pred_mean_t = m_t + a_t z_{t-1},   pred_var_t = a_t^2 var_{t-1} + q_t   (t >= 1)
    pred_mean_0 = init_mean,           pred_var_0 = init_var               (the prior of step 0)
    pred_obs_mean = h pred_mean,       pred_obs_var = S = h^2 pred_var + obs_var
    logliks_t = -(log(2 pi) + log S_t + v_t^2 / S_t) / 2,   v_t = (y_t - h_t m_t) - h_t a_t z_{t-1}

(0 where ``y_t`` is missing), ``precision = 1 / var`` and ``pred_precision = 1 / pred_var``: the
operations of the covariance-form backends, in torch ops on the problem's tensors (differentiable);
without a gradient, the triton backend's problems evaluate the same formulas in one kernel pass
that writes only the fields asked for (:mod:`kalmanscan.kernels.filter.derive`).
A continued stream's prior is already the state's prediction into step 0
(:func:`kalmanscan.inference.stream.continue_problem`). With a diffuse prior the moments come from
:func:`kalmanscan.inference.diffuse.restore` (``var = inf`` before a channel's first observation)
and the fields the diffuse prior leaves undefined up to it are set as ``restore`` sets them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kalmanscan.inference.diffuse import Diffuse, restore
from kalmanscan.model.reciprocal import reciprocal
from kalmanscan.problem.problem import Problem

__all__ = ["DERIVED", "derive", "torch_fields"]

DERIVED = ("precision", "pred_mean", "pred_var", "pred_precision", "pred_obs_mean", "pred_obs_var", "logliks")
"""The Posterior fields :func:`derive` makes (and ``missing``, a parameter)."""


def _next(x: torch.Tensor) -> torch.Tensor:
    """A per-step value at steps ``1..T-1`` (a static one as it is)."""
    return x if x.shape[-2] == 1 else x[..., 1:, :]


def derive(p: Problem, mean: torch.Tensor, var: torch.Tensor, diffuse: Diffuse | None = None,
           fields: Sequence[str] = (*DERIVED, "missing")) -> dict[str, torch.Tensor]:
    """The named ``fields`` (of :data:`DERIVED` and ``missing``; default all) as ``p.shape`` tensors
    of the compute dtype, from the filtered ``mean`` and ``var`` (``p.shape``, the backend's,
    restored where ``diffuse``).

    Where nothing tracks a gradient, the triton backend's problems (CUDA tensors, or the CPU under
    ``TRITON_INTERPRET=1``) take the values from one kernel pass writing the named fields alone
    (:func:`kalmanscan.ops.filter.triton.derive.derived_fields`; under ``torch.compile``, the
    torch ops). On the CPU they come from one
    compiled pass with the forward loops' operations
    (:func:`kalmanscan.ops.filter.cpu.backend.derived_fields`), the gradient, where one is
    tracked, from the torch ops of :func:`torch_fields`; elsewhere the torch ops alone."""
    tracked = torch.is_grad_enabled() and any(
        x.requires_grad for x in (mean, var, p.y, p.theta, p.sigma, p.dt, p.obs_var, p.mean, p.h, p.init_mean,
                                  p.init_var))
    floating = mean.dtype in (torch.float32, torch.float64)
    if p.backend == "triton" and floating and not tracked and not torch.compiler.is_compiling():
        from kalmanscan.ops.filter.triton.derive import derived_fields as kernel_fields

        out = kernel_fields(p, mean, var, fields)
    elif p.y.device.type != "cpu" or not floating:
        out = torch_fields(p, mean, var)
    else:
        from kalmanscan.ops.filter.cpu.backend import derived_fields

        with torch.no_grad():
            out = derived_fields(p, mean.detach(), var.detach())
        if tracked:
            graph = torch_fields(p, mean, var)
            out = {k: v if not graph[k].requires_grad else v + (graph[k] - graph[k].detach())
                   for k, v in out.items()}
    if diffuse is not None:
        out = restore(p, diffuse, out)
    return {k: out[k] for k in fields}


def torch_fields(p: Problem, mean: torch.Tensor, var: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every field of :func:`derive` (before the diffuse window is set) in torch ops, differentiable."""
    shape, dtype = p.shape, mean.dtype
    level, h, obs_var = (x.to(dtype) for x in (p.mean, p.h, p.obs_var))
    a, q = (x.to(dtype) for x in p.decay_noise())
    z = mean - level
    zp_next = _next(a) * z[..., :-1, :]
    prior = shape[:-2] + (1, shape[-1])
    zp0 = torch.broadcast_to(p.init_mean.to(dtype) - level[..., :1, :], prior)
    zp = torch.cat([zp0, torch.broadcast_to(zp_next, shape[:-2] + (shape[-2] - 1, shape[-1]))], -2)
    pred_var = torch.cat([torch.broadcast_to(p.init_var.to(dtype), prior),
                          torch.broadcast_to(_next(a) * _next(a) * var[..., :-1, :] + _next(q),
                                             shape[:-2] + (shape[-2] - 1, shape[-1]))], -2)
    pred_mean = zp + level
    S = h * h * pred_var + obs_var
    missing = torch.isnan(p.y)
    y_obs = torch.where(missing, torch.zeros((), dtype=dtype, device=mean.device), p.y.to(dtype))
    v = (y_obs - h * level) - h * zp  # centred: no cancellation against a large offset
    ll = -0.5 * ((math.log(2 * math.pi) + torch.log(S)) + v * v * reciprocal(S))
    out = dict(precision=reciprocal(var), pred_mean=pred_mean, pred_var=pred_var,
               pred_precision=reciprocal(pred_var), pred_obs_mean=h * pred_mean, pred_obs_var=S,
               logliks=torch.where(missing, torch.zeros((), dtype=dtype, device=mean.device), ll),
               missing=missing.to(dtype))
    return {k: torch.broadcast_to(x, shape) for k, x in out.items()}
