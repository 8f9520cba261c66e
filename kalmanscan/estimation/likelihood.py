"""The log-likelihood that :func:`kalmanscan.fit` maximises, as a lean function of the estimated
parameters: validated once, then one backend call per evaluation.

:class:`Likelihood` checks and broadcasts ``y`` and the fixed parameters once
(:func:`kalmanscan.problem.prepare.prepare`); each evaluation replaces the estimated fields of that problem
and runs the backend's filter asking for the per-step log-likelihoods alone (no validation, no
:class:`~kalmanscan.Posterior`). Its gradient is the backend's exact first-order backward (the
compiled adjoint on the CPU, the fused kernels on CUDA, the scans' autograd on the torch
backend). Evaluations add no device synchronisation of their own; on the triton backend the
filter decides whether the parameters leave some filter without process noise (one small
read-back, :meth:`kalmanscan.problem.problem.Problem.no_process_noise`, per evaluation where ``theta`` or
``sigma`` is estimated), and a diffuse prior locates each channel's first observation
(:func:`kalmanscan.inference.diffuse.finite_problem`).

On the ``"cpu"`` backend in float64, :attr:`Likelihood.numpy` evaluates the same
log-likelihood and its gradient without torch
(:class:`kalmanscan.estimation.cpu_objective.NumpyLikelihood`: the compiled loops on NumPy
buffers prepared once): :func:`kalmanscan.fit` feeds it to L-BFGS directly, and calls without
gradients and :meth:`Likelihood.gradient` use it.

:func:`gradient_and_hessian` gives the observed information of independent series: central
differences of the exact gradient, one pair of gradient evaluations per estimated name for every
series at once (a series' log-likelihood depends on its own parameters only, so moving one name
in every series moves each block's column alone). With the relative step ``2^-17`` (about
``eps^(1/3)`` in float64) the truncation and rounding errors are each about ``1e-10`` of the
Hessian's scale; the differences are taken in float64 whatever the data's dtype.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import torch

from kalmanscan.model import mobius, ou
from kalmanscan.inference.diffuse import finite_problem, run_finite, set_leading
from kalmanscan.problem.prepare import prepare
from kalmanscan.problem.problem import Problem
from kalmanscan.ops.filter.dispatch import get_backend
from kalmanscan.estimation.cpu_objective import NumpyLikelihood
from kalmanscan.types import ArrayLike

__all__ = ["Likelihood", "gradient_and_hessian", "spd_inverse", "valid", "FD_STEP", "POSITIVE"]

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
    ``y``'s dtype. Differentiable with respect to ``nat``. ``numpy``: the NumPy evaluation of the
    same function on the ``"cpu"`` backend in float64 (``None`` elsewhere), used when no
    gradient is recorded. :meth:`of_problem` makes one from a problem already prepared (what
    :func:`kalmanscan.fit` does: it prepares once).
    """

    def __init__(self, y: torch.Tensor, fixed: dict, start: dict[str, torch.Tensor], *, h: ArrayLike = 1.0,
                 dt: ArrayLike = 1.0, times: ArrayLike | None = None, backend: str = "auto"):
        kw = {**fixed, **{k: v if k.startswith("init_") else _static(v) for k, v in start.items()}}
        self._setup(prepare(y, **kw, h=h, dt=dt, times=times, backend=backend), tuple(fixed), start)

    @classmethod
    def of_problem(cls, p: Problem, fixed: Sequence[str], start: dict[str, torch.Tensor]) -> Likelihood:
        """The likelihood of the prepared problem ``p`` (its plan's backend), ``fixed`` naming the
        fields given by the caller and ``start`` the estimated names' values (each ``B + (Cp,)``,
        checked by the caller), which replace ``p``'s fields; nothing is validated again."""
        lik = cls.__new__(cls)
        lik._setup(p, tuple(fixed), start)
        return lik

    def _setup(self, p: Problem, fixed: tuple[str, ...], start: dict[str, torch.Tensor]) -> None:
        self.names, self.fixed = tuple(start), fixed
        self.stationary_init = "init_var" not in fixed and "init_var" not in start
        self.mean_init = "init_mean" not in fixed and "init_mean" not in start
        self.batch = tuple(p.y.shape[:-2])
        if tuple(p.shape[:-2]) != self.batch:
            raise ValueError(f"fixed parameters must not add batch dimensions to y's {self.batch}")
        self.p = self._with(p, start)
        finite_problem(self.p)  # a diffuse prior's errors surface here, before any optimiser
        lean = self.p.backend == "cpu" and self.p.dtype == torch.float64 and min(self.p.shape) > 0
        self.numpy = NumpyLikelihood(self.p, self.names, self.stationary_init, self.mean_init) if lean else None

    def _with(self, p: Problem, nat: dict[str, torch.Tensor], **changes) -> Problem:
        """``p`` with the estimated fields at ``nat`` (and the initial belief that follows them)."""
        fields = {k: _static(v) for k, v in nat.items()}
        if self.stationary_init and ("theta" in fields or "sigma" in fields):
            theta = fields.get("theta", p.theta[..., :1, :])
            sigma = fields.get("sigma", p.sigma[..., :1, :])
            fields["init_var"] = ou.stationary_var(theta, sigma)
        if self.mean_init and "mean" in fields:
            fields["init_mean"] = fields["mean"]
        moved = "theta" in fields or "sigma" in fields  # the decay and noise, and so no_noise, change
        return dataclasses.replace(p, **fields, no_noise=None if moved else p.no_noise, **changes)

    def __call__(self, nat: dict[str, torch.Tensor], graphed: bool = False) -> torch.Tensor:
        """``graphed``: no host decision on the values (for a CUDA graph's capture,
        :mod:`kalmanscan.estimation.graphed`): the kernels' path is taken as if every filter had process
        noise, and the result is NaN where one lacks it (the eager call then decides)."""
        if self.numpy is not None and not (torch.is_grad_enabled() and any(v.requires_grad for v in nat.values())):
            ll, _ = self.numpy.evaluate({k: v.detach().numpy() for k, v in nat.items()})
            return torch.from_numpy(ll)
        p = self._with(self.p, nat, outputs=("logliks",))
        moved = "theta" in nat or "sigma" in nat
        lacking = None
        if graphed and moved:
            lacking = mobius.lacks_noise(*p.decay_noise())
            p = dataclasses.replace(p, no_noise=False)
        finite, diffuse = finite_problem(p, split=p.y.device.type == "cpu")  # as ks.filter
        logliks = run_finite(finite, diffuse, get_backend(p.backend).filter)["logliks"]
        if diffuse is not None:
            logliks = set_leading(logliks, diffuse.upto, 0.0, p.shape)
        logliks = torch.broadcast_to(logliks, p.shape)
        ll = logliks.sum(-2, dtype=torch.float64).to(p.dtype)
        return ll if lacking is None else torch.where(lacking, torch.full_like(ll, math.nan), ll)

    def gradient(self, nat: dict[str, torch.Tensor], names: Sequence[str]) -> torch.Tensor:
        """The gradient ``B + (Cp, P)`` of ``-loglik(nat).sum()`` with respect to the estimated
        ``names`` (in that order): by :attr:`numpy` (no torch operation) where there is one, else
        by autograd through the backend's backward."""
        if self.numpy is not None:
            cot = np.full(self.batch + (self.p.shape[-1],), -1.0)
            _, g = self.numpy.evaluate({k: nat[k].detach().numpy() for k in self.names}, cot)
            return torch.from_numpy(np.stack([g[k] for k in names], -1))
        leaves = {k: nat[k].detach().clone().requires_grad_(True) for k in self.names}
        with torch.enable_grad():
            gs = torch.autograd.grad(-self(leaves).sum(), list(leaves.values()), allow_unused=True)
        got = {k: torch.zeros_like(v) if g is None else g for (k, v), g in zip(leaves.items(), gs)}
        return torch.stack([got[k] for k in names], -1)

    def in_float64(self) -> Likelihood:
        """The same likelihood computed in float64 (itself when it already is)."""
        if self.p.dtype == torch.float64:
            return self
        tensors = {f.name: getattr(self.p, f.name) for f in dataclasses.fields(self.p)}
        wide = {k: x.double() for k, x in tensors.items() if isinstance(x, torch.Tensor) and x.is_floating_point()}
        p = dataclasses.replace(self.p, **wide, derived=None, no_noise=None)
        return Likelihood.of_problem(p, self.fixed, {k: getattr(p, k)[..., 0, :] for k in self.names})


def _static(v: torch.Tensor) -> torch.Tensor:
    """``B + (Cp,)`` as the problem's static field ``B + (1, Cp)`` (every estimable name's form)."""
    return v.unsqueeze(-2)


def valid(nat: dict[str, torch.Tensor]) -> torch.Tensor:
    """Whether every value is finite and every positive name ``> 0`` (a 0-d bool tensor, no
    synchronisation)."""
    ok = [(torch.isfinite(v) & (v > 0) if k in POSITIVE else torch.isfinite(v)).all() for k, v in nat.items()]
    return torch.stack(ok).all()


def gradient_and_hessian(loglik: Likelihood, nat: dict[str, torch.Tensor], names: Sequence[str],
                         scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
        return loglik.gradient(dict(zip(names, values)), names)

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


def spd_inverse(H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse ``B + (P, P)`` of symmetric positive definite blocks ``H`` by their Cholesky
    factors, and ``B`` booleans: True for a block that is not positive definite (or not finite),
    whose inverse is then meaningless. On the CPU the factorisation is a loop over ``P`` in NumPy,
    vectorised over the blocks (no thread pool for a few tiny matrices); elsewhere
    ``torch.linalg.cholesky_ex`` and ``torch.cholesky_inverse``."""
    if H.device.type != "cpu":
        eye = torch.eye(H.shape[-1], dtype=H.dtype, device=H.device)
        L, info = torch.linalg.cholesky_ex(H)
        bad = (info != 0) | ~torch.isfinite(L).all(-1).all(-1)
        return torch.cholesky_inverse(torch.where(bad[..., None, None], eye, L)), bad
    A = H.detach().numpy()
    P = A.shape[-1]
    L = np.zeros_like(A)
    bad = np.zeros(A.shape[:-2], bool)
    for j in range(P):
        d = A[..., j, j] - (L[..., j, :j] ** 2).sum(-1)
        bad |= ~(np.isfinite(d) & (d > 0))
        L[..., j, j] = np.sqrt(np.where(bad, 1.0, d))
        below = A[..., j + 1:, j] - (L[..., j + 1:, :j] * L[..., j:j + 1, :j]).sum(-1)
        L[..., j + 1:, j] = below / L[..., j, j, None]
    bad |= ~np.isfinite(L).all((-2, -1))
    M = np.zeros_like(A)  # L^-1, row by row
    for i in range(P):
        row = np.eye(P)[i] - (L[..., i, :i, None] * M[..., :i, :]).sum(-2)
        M[..., i, :] = row / L[..., i, i, None]
    return torch.from_numpy((M[..., :, :, None] * M[..., :, None, :]).sum(-3)), torch.from_numpy(bad)
