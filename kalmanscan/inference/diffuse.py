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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kalmanscan.model import mobius
from kalmanscan.problem.problem import Problem
from kalmanscan.ops import host_memory
from kalmanscan.ops.filter.dispatch import backend_tensors
from kalmanscan.model.scan import associative_scan
from kalmanscan.inference.stream import predict

__all__ = ["Diffuse", "finite_problem", "run_finite", "restore", "set_leading", "diffuse_witness", "smooth_leading"]


@dataclass
class Diffuse:
    """Where the prior is diffuse: ``mask`` ``(..., 1, C)`` (bool, ``init_var = inf``), ``first``
    ``(..., 1, C)`` (int64: index of the first observation, ``T`` when there is none) and
    ``before``/``upto`` ``(..., W, C)`` (bool: diffuse channels at steps ``t < first`` /
    ``t <= first``) over the leading ``W`` steps, past which both are False (``W`` is one more
    than the last first observation of a diffuse channel, at most ``T``); ``length`` is ``T``.
    ``hold`` ``(..., W, C)`` (bool), where :func:`finite_problem` left them to :func:`run_finite`:
    the identity transitions into steps ``1..first`` of the channels with a leading gap."""

    mask: torch.Tensor
    first: torch.Tensor
    before: torch.Tensor
    upto: torch.Tensor
    length: int
    hold: torch.Tensor | None = None

    @property
    def n_diffuse(self) -> torch.Tensor:
        """Observations left out of the log-likelihood, ``(..., C)`` int64."""
        return (self.mask & (self.first < self.length)).to(torch.int64)[..., 0, :]

    @property
    def window(self) -> int:
        """``W``, the leading steps :attr:`before` and :attr:`upto` cover."""
        return self.upto.shape[-2]


def _first_seen(y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Index of each channel's first observed step, ``(..., 1, C)`` int64 (``T`` for none), for
    the channels of ``mask``; ``y`` is ``(..., T, C)``. Reads leading blocks of rows, growing, until
    every masked channel has an observation: usually one block, not the whole series."""
    T = y.shape[-2]
    rows = min(T, 8)
    while True:
        seen = ~torch.isnan(y[..., :rows, :])
        any_seen = seen.any(-2, keepdim=True)
        if rows == T or not bool((mask & ~any_seen).any()):
            break
        rows = min(T, rows * 8)
    unseen_before = (seen.cumsum(-2) == 0).sum(-2, keepdim=True)  # rows before the first seen
    return torch.where(any_seen, unseen_before, T)


def finite_problem(p: Problem, split: bool = False) -> tuple[Problem, Diffuse | None]:
    """The finite problem equivalent to ``p`` at every step from each channel's first observation
    on (module docstring), and where ``p`` is diffuse; ``(p, None)`` when no ``init_var`` is inf.
    Only the leading steps up to the last first observation are touched; ``y`` is copied once.

    With ``split`` (the caller runs the result through :func:`run_finite`; :func:`kalmanscan.filter`
    asks for it on a CPU), identity transitions
    that the window can take alone are left to it as :attr:`Diffuse.hold`: ``theta, sigma`` then
    stay as in ``p``, and the problem is only complete as ``run_finite`` runs it."""
    if not p.diffuse:
        return p, None
    shape, T = p.shape, p.shape[-2]
    bshape = shape[:-2] + (1, shape[-1])
    mask = torch.broadcast_to(torch.isinf(p.init_var), bshape)
    y = torch.broadcast_to(p.y, shape)
    first = _first_seen(y, mask)
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
    W = int(torch.where(mask, first, 0).max()) + 1 if first.numel() else 1
    W = min(W, T)
    steps = torch.arange(W, device=y.device).view(W, 1)
    before = mask & (steps < first)
    upto = mask & (steps <= first)
    y_finite = y.clone()
    y_finite[..., :W, :] = torch.where(upto, math.nan, y[..., :W, :])
    kw = dict(y=y_finite, init_mean=init_mean, init_var=init_var)
    hold = None
    if bool((observed & (first > 0)).any()):  # identity transitions into steps 1..first
        alone = split and W < T and p.times is None and p.theta.shape[-2] == 1 and p.sigma.shape[-2] == 1
        steps = steps if alone else torch.arange(T, device=y.device).view(T, 1)  # the window, or every step
        hold = mask & (steps <= first) & (steps > 0)
        if not alone:
            for k in ("theta", "sigma"):
                kw[k] = torch.where(hold, torch.zeros_like(y), torch.broadcast_to(getattr(p, k), shape))
            hold = None
    return dataclasses.replace(p, **kw), Diffuse(mask, first, before, upto, T, hold)


def run_finite(finite: Problem, d: Diffuse | None, run: Callable[[Problem], dict]) -> dict:
    """The backend's result (``run`` of a problem, a backend's ``filter``) on :func:`finite_problem`'s
    ``finite`` form, made with ``split=True``, as tensors of the compute dtype
    (:func:`kalmanscan.ops.filter.dispatch.backend_tensors`).

    Identity transitions into the leading steps would make ``theta, sigma`` per step over the
    whole series, and every step would take the backends' per-step path. Where ``finite_problem``
    left them here (:attr:`Diffuse.hold`: ``theta, sigma`` static, no ``times``, the window ``W``
    shorter than the series), the window runs alone with them, and steps ``W..T-1`` run as a second
    problem with the static parameters, its prior the window's filtered belief at ``W - 1``
    predicted through the transition into step ``W`` (:func:`kalmanscan.inference.stream.predict`): the same
    filter, as it is Markov. The fields are joined along time (``loglik`` summed); the window's run
    also returns ``mean`` and ``var``, which the second needs.
    """
    if d is None or d.hold is None:
        return backend_tensors(run(finite), finite)
    shape, T, W = finite.shape, finite.shape[-2], d.window

    def steps(a: int, b: int, **kw) -> Problem:
        fields = {k: getattr(finite, k) for k in ("y", "obs_var", "mean", "h", "dt")}
        fields = {k: x[..., a:b, :] if x.shape[-2] == T else x for k, x in fields.items()}
        keep = fields["dt"] is finite.dt and "theta" not in kw  # the host's decay and noise still apply
        return dataclasses.replace(finite, **fields, **kw, shape=shape[:-2] + (b - a, shape[-1]),
                                   derived=finite.derived if keep else None)

    window = shape[:-2] + (W, shape[-1])
    held = {k: torch.where(d.hold, 0.0, torch.broadcast_to(getattr(finite, k), window)) for k in ("theta", "sigma")}
    outputs = None if finite.outputs is None else tuple(dict.fromkeys((*finite.outputs, "mean", "var")))
    head = backend_tensors(run(steps(0, W, outputs=outputs, **held)), finite)
    decay, noise = (x[..., W:W + 1, :] if x.shape[-2] == T else x for x in finite.decay_noise())
    level = torch.broadcast_to(finite.mean, shape)
    deviation = head["mean"][..., W - 1:W, :] - level[..., W - 1:W, :]
    init_mean, init_var = predict(level[..., W:W + 1, :], decay, noise, deviation, head["var"][..., W - 1:W, :])
    out = {}
    tail = steps(W, T, init_mean=init_mean, init_var=init_var, diffuse=False)
    for k, x in backend_tensors(run(tail), finite).items():
        if k == "loglik":
            out[k] = head[k] + x
        else:  # two copies into memory that is cheap to touch first (kalmanscan.ops.host_memory)
            joined = host_memory.empty(shape, x.dtype, x.device)
            joined[..., :W, :] = head[k]
            joined[..., W:, :] = x
            out[k] = joined
    return out


def set_leading(x: torch.Tensor, where: torch.Tensor, value: torch.Tensor | float, shape: Sequence[int],
                own: bool = False) -> torch.Tensor:
    """``x`` broadcast to ``shape`` ``(..., T, C)`` with its leading ``W`` steps set to ``value``
    where ``where`` (``(..., W, C)``, a :class:`Diffuse` window) holds; ``value`` broadcasts to
    ``(..., W, C)``. With ``own`` (``x`` is this call's own result,
    no other output shares its memory) and ``x`` already of ``shape`` with nothing tracking its
    gradient, its leading rows are written in place; else a new tensor is made."""
    W = where.shape[-2]
    value = torch.as_tensor(value, dtype=x.dtype, device=x.device)
    if (own and tuple(x.shape) == tuple(shape) and 0 not in x.stride()
            and not (x.requires_grad and torch.is_grad_enabled())):
        x[..., :W, :] = torch.where(where, value, x[..., :W, :])
        return x
    x = torch.broadcast_to(x, shape)
    head = torch.where(where, value, x[..., :W, :])
    return head if W == shape[-2] else torch.cat([head, x[..., W:, :]], -2)


def restore(p: Problem, d: Diffuse, out: dict) -> dict:
    """The backend's result on the finite problem, as the diffuse filter of ``p``: diffuse moments
    where the state is still unknown, ``p``'s own ``decay``, ``noise`` and ``missing``. Only the
    leading :attr:`Diffuse.window` steps change; ``out``'s own tensors are written there in place
    where nothing tracks their gradient."""
    shape, W = p.shape, d.window
    mean, h, y = (torch.broadcast_to(x, shape)[..., :W, :] for x in (p.mean, p.h, p.y))
    mean, h = mean.to(p.dtype), h.to(p.dtype)
    fields = (("mean", d.before, mean), ("var", d.before, math.inf), ("precision", d.before, 0.0),
              ("pred_mean", d.upto, mean), ("pred_var", d.upto, math.inf), ("pred_precision", d.upto, 0.0),
              ("pred_obs_mean", d.upto, h * mean), ("pred_obs_var", d.upto, math.inf), ("logliks", d.upto, 0.0),
              ("missing", d.upto, torch.isnan(y).to(p.dtype)))
    owners = [out[k].untyped_storage().data_ptr() + out[k].storage_offset() * out[k].element_size()
              for k, _, _ in fields if isinstance(out.get(k), torch.Tensor)]
    own = len(set(owners)) == len(owners)  # no two outputs share memory
    fixed = dict(out)
    for k, where, value in fields:
        if out.get(k) is None:
            continue
        fixed[k] = set_leading(out[k], where, value, shape, own)
    fixed["decay"], fixed["noise"] = p.decay_noise()
    if fixed.get("missing") is None:
        fixed["missing"] = torch.isnan(p.y).to(p.dtype)
    fixed.pop("loglik", None)
    return fixed


def diffuse_witness(witness: torch.Tensor | None, finite: Problem, d: Diffuse | None) -> torch.Tensor | None:
    """The result that ``y``'s inf check reads (:func:`kalmanscan.problem.checks.check_y_by_result`) with a
    diffuse prior: an ``inf`` at a diffuse channel's first observation sets the finite problem's
    initial mean, which may reach no later output (a channel observed once), so its sum is added;
    an ``inf`` anywhere else reaches ``witness`` as without one."""
    if witness is None or d is None:
        return witness
    return witness + finite.init_mean.sum().to(witness.dtype)


def smooth_leading(p: Problem, d: Diffuse, filtered: dict, mean_s: torch.Tensor, var_s: torch.Tensor,
                   precision_s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Smoothed ``(mean, var, precision)`` with the steps before each diffuse channel's first
    observation smoothed backwards through ``p``'s transitions (module docstring): ``filtered`` is
    :func:`restore`'s result (its ``decay, noise`` are ``p``'s), the others the smoother's output
    on the finite problem. Only the window's steps and the one after it are scanned (the steps
    before a first observation lead back from it); the others keep the smoother's values, and
    its own tensors are written in place where nothing tracks their gradient."""
    if not bool(d.before.any()):
        return mean_s, var_s, precision_s
    shape, T = p.shape, p.shape[-2]
    R = min(d.window + 1, T)
    rows = shape[:-2] + (R, shape[-1])
    a_next, q_next = (torch.broadcast_to(filtered[k], shape)[..., 1:R + 1, :].to(mean_s.dtype)
                      for k in ("decay", "noise"))
    if R == T:  # no transition after the last step
        a_next = torch.cat([a_next, torch.ones_like(mean_s[..., :1, :])], -2)
        q_next = torch.cat([q_next, torch.zeros_like(mean_s[..., :1, :])], -2)
    lead = d.before if R == d.window else torch.cat([d.before, torch.zeros_like(d.before[..., :1, :])], -2)
    lead = torch.broadcast_to(lead, rows)
    mean = torch.broadcast_to(p.mean, shape)[..., :R, :].to(mean_s.dtype)
    zero = torch.zeros(rows, dtype=mean_s.dtype, device=mean_s.device)
    # s_t = F_t s_{t+1} + B_t, scanned backwards: the leading steps follow the transitions, the
    # others are constants (F = 0) holding the smoothed values from the first observation on.
    gain = torch.where(lead, 1.0 / a_next, zero)
    _, z = associative_scan(mobius.affine_compose, (gain, torch.where(lead, zero, mean_s[..., :R, :] - mean)),
                            dim=-2, reverse=True)
    _, v = associative_scan(mobius.affine_compose,
                            (gain * gain, torch.where(lead, q_next * gain * gain, var_s[..., :R, :])),
                            dim=-2, reverse=True)
    unseen = torch.broadcast_to(d.mask & (d.first >= T), rows)  # never observed: unknown (then R = T)
    v = torch.where(unseen, torch.full_like(v, math.inf), v)
    return (set_leading(mean_s, lead, z + mean, shape, own=True), set_leading(var_s, lead, v, shape, own=True),
            set_leading(precision_s, lead, 1.0 / v, shape, own=True))
