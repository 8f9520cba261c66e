"""The log-likelihood that :func:`kalmanscan.fit` maximises, as a lean function of the estimated
parameters: validated once, then one backend call per evaluation.

:class:`Likelihood` checks and broadcasts ``y`` and the fixed parameters once
(:func:`kalmanscan.inputs.prepare`); each evaluation replaces the estimated fields of that problem
and runs the backend's filter asking for the per-step log-likelihoods alone (no validation, no
:class:`~kalmanscan.Posterior`). Its gradient is the backend's exact first-order backward (the
compiled adjoint on the CPU, the fused kernels on CUDA, the scans' autograd on the torch
backend). Evaluations add no device synchronisation of their own; on the triton backend the
filter decides whether the parameters leave some filter without process noise (one small
read-back, :meth:`kalmanscan.inputs.Problem.no_process_noise`, per evaluation where ``theta`` or
``sigma`` is estimated), and a diffuse prior locates each channel's first observation
(:func:`kalmanscan.diffuse.finite_problem`).

:func:`gradient_and_hessian` gives the observed information of independent series: central
differences of the exact gradient, one pair of gradient evaluations per estimated name for every
series at once (a series' log-likelihood depends on its own parameters only, so moving one name
in every series moves each block's column alone). With the relative step ``2^-17`` (about
``eps^(1/3)`` in float64) the truncation and rounding errors are each about ``1e-10`` of the
Hessian's scale; the differences are taken in float64 whatever the data's dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from . import ou
from .diffuse import finite_problem
from .inputs import prepare
from .ops.filter import run_backend
from .types import ArrayLike

__all__ = ["Likelihood", "gradient_and_hessian", "valid", "FD_STEP", "POSITIVE"]

FD_STEP = 2.0 ** -17
"""Relative step of the central differences of :func:`gradient_and_hessian`."""

POSITIVE = ("theta", "sigma", "obs_var", "init_var")


class Likelihood:
    """``loglik(nat) -> B + (C,)``: the exact Gaussian log-likelihood per series of :func:`kalmanscan.filter`
    for ``y`` (``B + (T, C)``, a tensor) where the estimated names take the values ``nat`` (each
    ``B + (Cp,)``, ``Cp`` = C or 1, static) and every other keyword is fixed.

    ``fixed`` holds the fixed values of ``theta, sigma, obs_var, mean, init_mean, init_var`` (given
    ones only); ``start`` the estimated names' values used to validate the problem once. An
    ``init_var`` neither given nor estimated is the stationary variance of the current ``theta,
    sigma``, an ``init_mean`` the current ``mean``, as in :func:`kalmanscan.filter`. Evaluated
    values are not checked: :func:`valid` tells whether ``nat`` is in the domain (as a tensor,
    without a synchronisation). The sum over time is accumulated in float64 and returned in
    ``y``'s dtype. Differentiable with respect to ``nat``.
    """

    def __init__(self, y: torch.Tensor, fixed: dict, start: dict[str, torch.Tensor], *, h: ArrayLike = 1.0,
                 dt: ArrayLike = 1.0, times: ArrayLike | None = None, backend: str = "auto"):
        self.names = tuple(start)
        self.fixed, self.h, self.dt, self.times, self.backend = dict(fixed), h, dt, times, backend
        kw = {**fixed, **{k: v if k.startswith("init_") else _static(v) for k, v in start.items()}}
        self.p = prepare(y, **kw, h=h, dt=dt, times=times, backend=backend)
        self.stationary_init = "init_var" not in fixed and "init_var" not in start
        self.mean_init = "init_mean" not in fixed and "init_mean" not in start
        self.batch = tuple(y.shape[:-2])
        if tuple(self.p.shape[:-2]) != self.batch:
            raise ValueError(f"fixed parameters must not add batch dimensions to y's {self.batch}")
        finite_problem(self.p)  # a diffuse prior's errors surface here, before any optimiser

    def __call__(self, nat: dict[str, torch.Tensor]) -> torch.Tensor:
        fields = {k: _static(v) for k, v in nat.items()}
        if self.stationary_init and ("theta" in fields or "sigma" in fields):
            theta = fields.get("theta", self.p.theta[..., :1, :])
            sigma = fields.get("sigma", self.p.sigma[..., :1, :])
            fields["init_var"] = ou.stationary_var(theta, sigma)
        if self.mean_init and "mean" in fields:
            fields["init_mean"] = fields["mean"]
        moved = "theta" in fields or "sigma" in fields  # the decay and noise, and so no_noise, change
        p = dataclasses.replace(self.p, **fields, no_noise=None if moved else self.p.no_noise, outputs=("logliks",))
        finite, diffuse = finite_problem(p)
        logliks = run_backend(finite, self.backend)["logliks"]
        if diffuse is not None:
            logliks = torch.where(diffuse.upto, torch.zeros_like(logliks), logliks)
        logliks = torch.broadcast_to(logliks, p.shape)
        return logliks.sum(-2, dtype=torch.float64).to(p.dtype)

    def in_float64(self) -> Likelihood:
        """The same likelihood computed in float64 (itself when it already is)."""
        if self.p.dtype == torch.float64:
            return self
        start = {k: getattr(self.p, k)[..., 0, :].double() for k in self.names}
        return Likelihood(self.p.y.double(), self.fixed, start, h=self.h, dt=self.dt, times=self.times,
                          backend=self.backend)


def _static(v: torch.Tensor) -> torch.Tensor:
    """``B + (Cp,)`` as the problem's static field ``B + (1, Cp)`` (every estimable name's form)."""
    return v.unsqueeze(-2)


def valid(nat: dict[str, torch.Tensor]) -> torch.Tensor:
    """Whether every value is finite and every positive name ``> 0`` (a 0-d bool tensor, no
    synchronisation)."""
    ok = [(torch.isfinite(v) & (v > 0) if k in POSITIVE else torch.isfinite(v)).all() for k, v in nat.items()]
    return torch.stack(ok).all()


def gradient_and_hessian(loglik: Callable[[dict], torch.Tensor], nat: dict[str, torch.Tensor],
                         names: Sequence[str], scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient ``B + (Cp, P)`` and Hessian blocks ``B + (Cp, P, P)`` of ``-loglik`` (summed over
    series) in the natural parameters ``nat`` (each ``B + (Cp,)``), ``P = len(names)``.

    Column ``i`` of every block is the central difference of the exact gradient over a step of
    ``FD_STEP`` times the value (positive names) or times ``|value| + scale`` (``scale``: the
    data's standard deviation per series, for ``mean`` and ``init_mean``); the result is
    symmetrised. The gradient is the mean of the differences' midpoints (exact to second order
    in the step, like the columns). ``loglik`` and its gradient are evaluated ``2 P`` times.
    """
    x = [nat[k].detach() for k in names]

    def grad(values):
        leaves = [v.clone().requires_grad_(True) for v in values]
        with torch.enable_grad():
            total = -loglik(dict(zip(names, leaves))).sum()
            gs = torch.autograd.grad(total, leaves, allow_unused=True)
        return torch.stack([torch.zeros_like(v) if g is None else g for g, v in zip(gs, values)], -1)

    cols, mids = [], []
    for i, k in enumerate(names):
        step = FD_STEP * (x[i] if k in POSITIVE else x[i].abs() + scale.to(x[i].dtype))
        plus, minus = list(x), list(x)
        plus[i], minus[i] = x[i] + step, x[i] - step
        g_plus, g_minus = grad(plus), grad(minus)
        cols.append((g_plus - g_minus) / (plus[i] - minus[i]).unsqueeze(-1))
        mids.append(0.5 * (g_plus + g_minus))
    H = torch.stack(cols, -1)
    return sum(mids) / len(mids), 0.5 * (H + H.transpose(-1, -2))
