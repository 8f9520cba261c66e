"""The ``"torch"`` backend: the time-parallel information-form filter in torch tensor ops.

Two associative scans along time (:mod:`kalmanscan.scan`): the Möbius scan of the precision
(:mod:`kalmanscan.mobius`), then the affine scan of the information mean whose forget gates need
the previous precision. Runs on any device, float32 or float64, and is differentiable by autograd
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

    lam0 = (1.0 / p.init_var).expand(shape[:-2] + (1, shape[-1]))
    mu0 = (p.init_mean - mean[..., :1, :]).expand(lam0.shape)
    P = associative_scan(mobius.compose, mobius.leaf(a, q, phi), dim=-2)
    lam = mobius.readout(P, lam0)
    lam_prev = torch.cat([lam0, lam[..., :-1, :]], -2)
    f = mobius.forget_gate(a, q, lam_prev)
    F, B = associative_scan(mobius.affine_compose, (f, b), dim=-2)
    eta = F * (lam0 * mu0) + B

    var = 1.0 / lam
    mu_c = eta * var
    mu_prev = torch.cat([mu0, mu_c[..., :-1, :]], -2)
    var_prev = torch.cat([1.0 / lam0, var[..., :-1, :]], -2)
    pred_mu_c = a * mu_prev
    pred_var = a * a * var_prev + q
    return finish(p, mu_c, lam, pred_mu_c, pred_var, missing, decay, noise)


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
