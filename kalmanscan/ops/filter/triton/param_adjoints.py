"""The chain rule from the triton filter backward's adjoints to the user's parameters.

The backward kernels (:func:`kalmanscan.ops.filter.triton.filter_backward`) end at the adjoints of
each step's ``(decay, noise)`` and ``(phi, info, info * yc)``, per step or summed over time; the
parameters enter through :func:`kalmanscan.model.ou.discretize` and ``phi = h^2 / obs_var``,
``info = (h / obs_var)(y - h mean)``. Closed forms, a few elementwise operations, no autograd graph.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kalmanscan.model import ou
from kalmanscan.ops.filter import torch as torch_backend

__all__ = ["param_grads"]


def param_grads(shape: tuple[int, ...], params: dict[str, torch.Tensor], obs_grad: torch.Tensor,
                trans_grad: torch.Tensor, needed: Sequence[bool]) -> tuple[torch.Tensor | None, ...]:
    """Gradients of the user's parameters from the kernel's per-step or summed adjoints.

    ``obs_grad = (d phi, d info, d info * yc)`` and ``trans_grad = (d decay, d noise)`` are
    ``(B, 1 or T, C)`` stacks; the parameters enter through ``phi = h^2 / obs_var``,
    ``info = (h / obs_var)(y - h mean)`` (with ``y - h mean`` as ``yc + h0 mean0 - h mean`` around
    the current values, so no ``y`` is needed here) and :func:`kalmanscan.model.ou.discretize`, whose
    adjoint is :func:`kalmanscan.model.ou.discretize_vjp`. Closed forms, each summed to its parameter's
    shape: a few elementwise operations, no autograd graph.
    """
    names = ("theta", "sigma", "dt", "obs_var", "mean", "h")
    if not any(needed):
        return (None,) * 6
    x = {k: _flat_time(params[k].detach(), shape) for k in names}
    g = {}
    if any(needed[:3]):
        g["theta"], g["sigma"], g["dt"] = ou.discretize_vjp(x["theta"], x["sigma"], x["dt"], *trans_grad)
    if any(needed[3:]):
        g_phi, g_info, g_info_yc = obs_grad
        h, obs_var, mean = x["h"], x["obs_var"], x["mean"]
        hr = h / obs_var
        g["obs_var"] = -hr * (h * g_phi + g_info_yc) / obs_var
        g["mean"] = -hr * h * g_info
        g["h"] = 2.0 * hr * g_phi + (g_info_yc - h * mean * g_info) / obs_var
    return tuple(torch_backend.adjoint_to(g[k], shape, params[k]) if n else None for k, n in zip(names, needed))


def _flat_time(x, shape):
    """``x`` (``(..., 1 or T, C or 1)``) broadcast over batch and channels: ``(B, 1 or T, C)``."""
    B = math.prod(shape[:-2])
    full = shape[:-2] + (x.shape[-2], shape[-1])
    return torch.broadcast_to(x, full).reshape(B, x.shape[-2], shape[-1])
