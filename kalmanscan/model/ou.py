"""Exact discretisation of the Ornstein–Uhlenbeck prior ``dx = -theta (x - mean) dt + sigma dW``.

Every function works elementwise on NumPy arrays, Python floats and torch tensors (differentiable
through autograd), broadcasting its arguments.

Over a step ``dt`` the exact transition is ``x_t - mean = decay (x_{t-1} - mean) + N(0, noise)``:

    decay = exp(-theta dt)
    noise = sigma^2 (1 - decay^2) / (2 theta) = sigma^2 dt * phi(2 theta dt),
    phi(x) = -expm1(-x) / x,   phi(0) = 1

``phi`` is evaluated with ``expm1`` (never ``1 - exp``), and with its Taylor series
``1 - x/2 + x^2/6 - x^3/24`` below ``x = 1e-4`` (truncation error below ``x^4/120 < 1e-18``), so
``noise`` is accurate to a few float64 ulps from ``theta dt = 0`` (the random walk, ``noise =
sigma^2 dt``) up to ``theta dt = 1e3`` (``decay`` underflows to 0, ``noise`` is the stationary
variance), and its gradient is finite at ``theta = 0``.

The zero-order-hold variant (``method="zoh"``, the ablation in the KLA paper) keeps the same decay
but uses the Euler noise ``sigma^2 dt``: it ignores the decay inside the step, so it overstates the
noise and its variance grows without bound in ``dt`` instead of saturating.
"""

from __future__ import annotations

import math
from typing import Any


import numpy as np
import torch

from kalmanscan.types import ArrayLike


__all__ = ["discretize", "discretize_vjp", "stationary_var", "half_life", "continuous", "phi"]

_TAYLOR_BELOW = 1e-4


def _ns(*xs):
    """The array namespace of the arguments: torch if any is a tensor, else NumPy."""
    return torch if any(isinstance(x, torch.Tensor) for x in xs) else np


def _as_array(x, ns, like=None):
    if ns is torch:
        if isinstance(x, torch.Tensor):
            return x
        ref = like if isinstance(like, torch.Tensor) else None
        dtype = ref.dtype if ref is not None and ref.is_floating_point() else torch.float64
        return torch.as_tensor(x, dtype=dtype, device=None if ref is None else ref.device)
    return np.asarray(x, dtype=np.result_type(np.asarray(x).dtype, np.float64))


def phi(x: ArrayLike) -> ArrayLike:
    """``-expm1(-x) / x`` for ``x >= 0``, equal to 1 at 0; accurate to rounding everywhere."""
    ns = _ns(x)
    x = _as_array(x, ns)
    small = x < _TAYLOR_BELOW
    safe = ns.where(small, ns.ones_like(x), x)
    exact = -ns.expm1(-safe) / safe
    taylor = 1.0 - x * (0.5 - x * (1.0 / 6.0 - x / 24.0))
    return ns.where(small, taylor, exact)


def discretize(theta: ArrayLike, sigma: ArrayLike, dt: ArrayLike = 1.0, method: str = "ou") -> tuple[Any, Any]:
    """``(theta, sigma, dt) -> (decay, noise)`` for the OU prior over a step ``dt``.

    ``theta >= 0`` is the mean-reversion rate, ``sigma >= 0`` the diffusion scale, ``dt > 0`` the
    step. ``method="ou"`` is the exact discretisation; ``"zoh"`` the zero-order-hold ablation
    (same decay, noise ``sigma^2 dt``). Shapes broadcast; torch in gives torch out.
    """
    ns = _ns(theta, sigma, dt)
    like = next((v for v in (theta, sigma, dt) if isinstance(v, torch.Tensor)), None)
    theta, sigma, dt = (_as_array(v, ns, like) for v in (theta, sigma, dt))
    x = theta * dt
    decay = ns.exp(-x)
    if method == "ou":
        noise = sigma * sigma * dt * phi(2.0 * x)
    elif method == "zoh":
        noise = sigma * sigma * dt * ns.ones_like(x)
    else:
        raise ValueError(f"method must be 'ou' or 'zoh', got {method!r}")
    return decay, noise


def discretize_vjp(theta: ArrayLike, sigma: ArrayLike, dt: ArrayLike, g_decay: ArrayLike,
                   g_noise: ArrayLike) -> tuple[Any, Any, Any]:
    """``(g_theta, g_sigma, g_dt)``: the adjoints ``g_decay, g_noise`` of :func:`discretize`
    (``method="ou"``) mapped to its inputs, elementwise and broadcast (sum to each input's shape
    where it was broadcast); NumPy or torch, no value read on the host.

    With ``x = 2 theta dt``: ``d decay = -decay (dt dtheta + theta ddt)``, ``d noise = 2 sigma dt
    phi(x) dsigma + 2 sigma^2 dt^2 phi'(x) dtheta + sigma^2 exp(-x) ddt``, where ``phi'(x) = (exp(-x)
    - phi(x)) / x`` and below ``x = 1e-4`` the derivative of ``phi``'s Taylor series (where
    :func:`phi` switches to it too), so every adjoint is finite at ``theta = 0``. Equal to autograd
    through :func:`discretize` to a few ulps times the cancellation in ``phi'`` (relative ``1e-12``
    at worst, just above the switch).
    """
    ns = _ns(theta, sigma, dt, g_decay, g_noise)
    like = next((v for v in (theta, sigma, dt, g_decay, g_noise) if isinstance(v, torch.Tensor)), None)
    theta, sigma, dt, g_decay, g_noise = (_as_array(v, ns, like) for v in (theta, sigma, dt, g_decay, g_noise))
    x = 2.0 * theta * dt
    phi_x = phi(x)
    small = x < _TAYLOR_BELOW
    safe = ns.where(small, ns.ones_like(x), x)
    exp_x = ns.expm1(-safe) + 1.0
    dphi = ns.where(small, -(0.5 - x * (1.0 / 6.0 - x / 24.0)) + x * (1.0 / 6.0 - x / 12.0),
                    exp_x / safe - phi_x / safe)
    decay_g = g_decay * ns.exp(-theta * dt)
    noise_g = g_noise * (sigma * sigma)
    g_theta = -decay_g * dt + noise_g * dt * dphi * 2.0 * dt
    g_sigma = (g_noise * dt * phi_x) * 2.0 * sigma
    g_dt = -decay_g * theta + noise_g * ns.where(small, ns.exp(-x), exp_x)
    return g_theta, g_sigma, g_dt


def stationary_var(theta: ArrayLike, sigma: ArrayLike) -> ArrayLike:
    """Stationary variance ``sigma^2 / (2 theta)``; ``inf`` for the random walk ``theta = 0``."""
    ns = _ns(theta, sigma)
    like = theta if isinstance(theta, torch.Tensor) else sigma
    theta, sigma = (_as_array(v, ns, like) for v in (theta, sigma))
    with np.errstate(divide="ignore"):
        return sigma * sigma / (2.0 * theta)


def half_life(theta: ArrayLike) -> ArrayLike:
    """Time for the mean deviation to halve: ``ln 2 / theta`` (``inf`` at ``theta = 0``)."""
    ns = _ns(theta)
    theta = _as_array(theta, ns)
    with np.errstate(divide="ignore"):
        return math.log(2.0) / theta


def continuous(decay: ArrayLike, noise: ArrayLike, dt: ArrayLike = 1.0) -> tuple[Any, Any]:
    """Inverse of :func:`discretize`: ``(decay, noise, dt) -> (theta, sigma)``.

    ``decay`` in ``(0, 1]``, ``noise >= 0``; ``theta = -log(decay) / dt`` and
    ``sigma = sqrt(noise / (dt * phi(2 theta dt)))``, including ``decay = 1``. Near ``decay = 1``
    the decay itself holds ``theta dt`` only to float64 rounding, so ``theta`` comes back to about
    ``eps / dt`` absolute (a few ulps relative elsewhere); ``sigma`` to a few ulps.
    """
    ns = _ns(decay, noise, dt)
    like = next((v for v in (decay, noise, dt) if isinstance(v, torch.Tensor)), None)
    decay, noise, dt = (_as_array(v, ns, like) for v in (decay, noise, dt))
    theta = -ns.log(decay) / dt
    sigma = ns.sqrt(noise / (dt * phi(2.0 * theta * dt)))
    return theta, sigma
