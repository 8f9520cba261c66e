"""Exact diffuse initialisation: ``init_var = inf`` (precision 0 at the first observation time).

In information form a diffuse prior is exact: ``lam_0 = 0``. Until a channel's first observation
``y_f`` its state is unknown (infinite variance); after it the filtered belief is
``N(y_f / h_f, obs_var_f / h_f^2)`` (on the centred state ``x - mean``: ``(y_f - h_f mean_f) / h_f``),
and the filter proceeds from there. As statsmodels and KFAS do, the log-likelihood leaves out the
diffuse step (the log-density of ``y_f``, which is improper); :attr:`Posterior.n_diffuse` counts
the observations left out per channel (1 for a diffuse channel with any observation).

Every backend runs it unchanged through an equivalent finite problem (:func:`finite_problem`):
the prior at step 0 becomes the belief after ``y_f``, ``y`` is treated as missing up to ``f``, and
the transitions into steps ``1..f`` become the identity (``theta = sigma = 0``: decay 1, noise
0), which carry that belief to step ``f`` unchanged. The outputs at steps ``t <= f`` that the
diffuse prior leaves undefined (variance ``inf``, precision 0, log-likelihood 0) are then set
(:func:`restore`), and :func:`smooth_leading` smooths the steps before ``f`` backwards through the
real transitions: ``x_t - mean_t = (x_{t+1} - mean_{t+1} - w) / a_{t+1}``, so the smoothed centred
mean is ``z_{t+1} / a_{t+1}`` and the variance ``(var_{t+1} + q_{t+1}) / a_{t+1}^2``. With every
first observation at step 0 (no leading gap) only the prior and ``y_0`` change: static parameters
stay static. All of it is differentiable.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from . import mobius
from .inputs import Problem
from .scan import associative_scan

__all__ = ["Diffuse", "finite_problem", "restore", "smooth_leading"]


@dataclass
class Diffuse:
    """Where the prior is diffuse: ``mask`` ``(..., 1, C)`` (bool, ``init_var = inf``), ``first``
    ``(..., 1, C)`` (int64: index of the first observation, ``T`` when there is none) and
    ``before``/``upto`` ``(..., T, C)`` (bool: diffuse channels at steps ``t < first`` /
    ``t <= first``)."""

    mask: torch.Tensor
    first: torch.Tensor
    before: torch.Tensor
    upto: torch.Tensor

    @property
    def n_diffuse(self) -> torch.Tensor:
        """Observations left out of the log-likelihood, ``(..., C)`` int64."""
        T = self.before.shape[-2]
        return (self.mask & (self.first < T)).to(torch.int64)[..., 0, :]


def finite_problem(p: Problem) -> tuple[Problem, Diffuse | None]:
    """The finite problem equivalent to ``p`` at every step from each channel's first observation
    on (module docstring), and where ``p`` is diffuse; ``(p, None)`` when no ``init_var`` is inf."""
    if not p.diffuse:
        return p, None
    shape, T = p.shape, p.shape[-2]
    bshape = shape[:-2] + (1, shape[-1])
    mask = torch.broadcast_to(torch.isinf(p.init_var), bshape)
    y = torch.broadcast_to(p.y, shape)
    seen = ~torch.isnan(y)
    steps = torch.arange(T, device=y.device).view(T, 1)
    first = torch.where(seen, steps, T).amin(-2, keepdim=True)
    at = first.clamp_max(T - 1)
    pick = {k: torch.gather(torch.broadcast_to(getattr(p, k), shape), -2, at)
            for k in ("y", "h", "obs_var", "mean")}
    observed = mask & (first < T)
    if bool((observed & (pick["h"] == 0)).any()):
        raise ValueError("h must be non-zero at the first observation of a channel with init_var = inf "
                         "(a diffuse prior needs an observation of the state to become proper)")
    h = torch.where(observed, pick["h"], torch.ones_like(pick["h"]))
    centred = torch.where(observed, (pick["y"] - h * pick["mean"]) / h, torch.zeros_like(h))
    init_mean = torch.broadcast_to(p.mean[..., :1, :], bshape) + centred
    init_var = torch.where(observed, pick["obs_var"] / (h * h), torch.ones_like(h))
    init_mean = torch.where(mask, init_mean, torch.broadcast_to(p.init_mean, bshape))
    init_var = torch.where(mask, init_var, torch.broadcast_to(p.init_var, bshape))
    before = mask & (steps < first)
    upto = mask & (steps <= first)
    kw = dict(y=torch.where(upto, torch.full_like(y, math.nan), y), init_mean=init_mean, init_var=init_var)
    if bool((observed & (first > 0)).any()):  # identity transitions into steps 1..first
        hold = mask & (steps <= first) & (steps > 0)
        for k in ("theta", "sigma"):
            kw[k] = torch.where(hold, torch.zeros_like(y), torch.broadcast_to(getattr(p, k), shape))
    return dataclasses.replace(p, **kw), Diffuse(mask, first, before, upto)


def restore(p: Problem, d: Diffuse, out: dict) -> dict:
    """The backend's result on the finite problem, as the diffuse filter of ``p``: diffuse moments
    where the state is still unknown, ``p``'s own ``decay``, ``noise`` and ``missing``."""
    shape = p.shape
    mean = torch.broadcast_to(p.mean, shape).to(p.dtype)
    h = torch.broadcast_to(p.h, shape).to(p.dtype)
    inf, zero = torch.full_like(mean, math.inf), torch.zeros_like(mean)
    fixed = dict(out)
    for k, where, value in (("mean", d.before, mean), ("var", d.before, inf), ("precision", d.before, zero),
                            ("pred_mean", d.upto, mean), ("pred_var", d.upto, inf),
                            ("pred_precision", d.upto, zero), ("pred_obs_mean", d.upto, h * mean),
                            ("pred_obs_var", d.upto, inf), ("logliks", d.upto, zero)):
        if out.get(k) is None:
            continue
        fixed[k] = torch.where(where, value, torch.broadcast_to(out[k], shape))
    fixed["decay"], fixed["noise"] = p.decay_noise()
    fixed["missing"] = torch.isnan(p.y).to(p.dtype)
    fixed.pop("loglik", None)
    return fixed


def smooth_leading(p: Problem, d: Diffuse, filtered: dict, mean_s: torch.Tensor, var_s: torch.Tensor,
                   precision_s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Smoothed ``(mean, var, precision)`` with the steps before each diffuse channel's first
    observation smoothed backwards through ``p``'s transitions (module docstring): ``filtered`` is
    :func:`restore`'s result (its ``decay, noise`` are ``p``'s), the others the smoother's output
    on the finite problem."""
    if not bool(d.before.any()):
        return mean_s, var_s, precision_s
    shape = p.shape
    decay, noise = (torch.broadcast_to(filtered[k], shape).to(mean_s.dtype) for k in ("decay", "noise"))
    mean = torch.broadcast_to(p.mean, shape).to(mean_s.dtype)
    a_next = torch.cat([decay[..., 1:, :], torch.ones_like(decay[..., :1, :])], -2)
    q_next = torch.cat([noise[..., 1:, :], torch.zeros_like(noise[..., :1, :])], -2)
    lead = d.before
    zero = torch.zeros_like(mean_s)
    # s_t = F_t s_{t+1} + B_t, scanned backwards: the leading steps follow the transitions, the
    # others are constants (F = 0) holding the smoothed values from the first observation on.
    gain = torch.where(lead, 1.0 / a_next, zero)
    _, z = associative_scan(mobius.affine_compose, (gain, torch.where(lead, zero, mean_s - mean)),
                            dim=-2, reverse=True)
    _, v = associative_scan(mobius.affine_compose, (gain * gain, torch.where(lead, q_next * gain * gain, var_s)),
                            dim=-2, reverse=True)
    unseen = torch.broadcast_to(d.mask & (d.first >= shape[-2]), shape)  # never observed: unknown
    v = torch.where(unseen, torch.full_like(v, math.inf), v)
    return z + mean, v, 1.0 / v
