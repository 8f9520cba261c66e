"""The ``"torch"`` backend: the time-parallel information-form filter in torch tensor ops.

Two associative scans along time (:mod:`kalmanscan.scan`): the Möbius scan of the precision
(:mod:`kalmanscan.mobius`), read out as the variance, then the affine scan of the mean whose gates
need the previous variance (mean form, so no process noise, ``sigma = 0``, stays in range). Runs on any device, float32 or float64, and is differentiable by autograd
with respect to ``y`` and every parameter (the power-of-two rescaling in the Möbius products is
piecewise constant, so those gradients are exact).
"""

from __future__ import annotations

import math

import torch

from . import mobius
from .inputs import Problem
from .scan import associative_scan

__all__ = ["filter_torch", "first_step_identity"]


def first_step_identity(x, value):
    """``x`` broadcast to its time length with index 0 replaced by ``value`` (no transition)."""
    return torch.cat([torch.full_like(x[..., :1, :], value), x[..., 1:, :]], -2)


def filter_torch(p: Problem) -> dict:
    """Filter the validated problem ``p``; returns a dict of ``(..., T, C)`` tensors."""
    shape = p.shape
    y, h, obs_var, mean = p.y, p.h, p.obs_var, p.mean
    decay, noise = p.decay_noise()
    missing = torch.isnan(y)
    y_obs = torch.where(missing, torch.zeros_like(y), y)
    r = 1.0 / obs_var
    phi = torch.where(missing, torch.zeros_like(y_obs), h * h * r).expand(shape)
    b = torch.where(missing, torch.zeros_like(y_obs), h * r * (y_obs - h * mean)).expand(shape)
    a = first_step_identity(decay.expand(shape), 1.0)
    q = first_step_identity(noise.expand(shape), 0.0)

    var0 = p.init_var.expand(shape[:-2] + (1, shape[-1]))
    mu0 = (p.init_mean - mean[..., :1, :]).expand(var0.shape)
    P = associative_scan(mobius.compose, mobius.leaf(a, q, phi), dim=-2)
    var = mobius.readout_var(P, 1.0 / var0)
    var_prev = torch.cat([var0, var[..., :-1, :]], -2)
    pred_var = a * a * var_prev + q
    G, W = associative_scan(mobius.affine_compose, (mobius.mean_gate(a, pred_var, phi), b * var), dim=-2)
    mu_c = G * mu0 + W
    pred_mu_c = a * torch.cat([mu0, mu_c[..., :-1, :]], -2)
    return finish(p, mu_c, 1.0 / var, pred_mu_c, pred_var, missing, decay, noise)


def finish(p: Problem, mu_c, lam, pred_mu_c, pred_var, missing, decay, noise) -> dict:
    """Add the offsets, the predictive law of y and log-likelihoods to centred filter moments.

    ``mu_c`` and ``pred_mu_c`` are centred (``x - mean``); ``lam`` is the filtered precision.
    Shared by the torch and triton backends so both report identical derived quantities.
    """
    h, mean = p.h, p.mean
    y_obs = torch.where(missing, torch.zeros_like(p.y), p.y)
    pred_obs_mean = h * (pred_mu_c + mean)
    pred_obs_var = h * h * pred_var + p.obs_var
    innov = (y_obs - h * mean) - h * pred_mu_c  # centred: no cancellation against a large offset
    ll = -0.5 * (math.log(2 * math.pi) + torch.log(pred_obs_var) + innov * innov / pred_obs_var)
    logliks = torch.where(missing, torch.zeros_like(ll), ll)
    return dict(mean=mu_c + mean, var=1.0 / lam, precision=lam,
                pred_mean=pred_mu_c + mean, pred_var=pred_var, pred_precision=1.0 / pred_var,
                pred_obs_mean=pred_obs_mean.expand(p.shape), pred_obs_var=pred_obs_var.expand(p.shape),
                logliks=logliks.expand(p.shape), decay=decay, noise=noise,
                missing=missing.to(p.dtype))
