"""``ks.filter``: the public entry point of the diagonal information-form Kalman filter."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence


import numpy as np
import torch

from kalmanscan.inference import derived
from kalmanscan.inference.diffuse import Diffuse, diffuse_witness, finite_problem, restore, run_finite
from kalmanscan.problem.checks import decide_y
from kalmanscan.problem.prepare import GUESSED, prepare
from kalmanscan.problem.problem import OUTPUTS, Problem
from kalmanscan.ops.filter.dispatch import get_backend
from kalmanscan.inference.frames import pandas_io
from kalmanscan.inference.posterior import Params, Posterior
from kalmanscan.inference.stream import StreamState, as_prior, continue_problem, mark, naming_state
from kalmanscan.types import ArrayLike


__all__ = ["filter", "make_posterior", "sum_time", "attempts", "confirmed", "OUTPUTS", "LEAN"]

LEAN = ("mean", "var", "logliks", "loglik")
"""The outputs :func:`filter` asks its backend for: the filtered moments and the log-likelihood's
sum (without the per-step terms where the backend sums without them, its module's ``SUMS_LOGLIK``;
the first two alone when the log-likelihood is not wanted); the other fields are derived from
them on first access (:mod:`kalmanscan.inference.derived`)."""

@pandas_io
def filter(y: ArrayLike, *, theta: ArrayLike, sigma: ArrayLike, obs_var: ArrayLike, mean: ArrayLike = 0.0,
           h: ArrayLike = 1.0, dt: ArrayLike = 1.0, times: ArrayLike | None = None,
           init_mean: ArrayLike | None = None, init_var: ArrayLike | None = None, backend: str = "auto",
           outputs: Sequence[str] | None = None, state: StreamState | Posterior | None = None,
           check_finite: bool = True) -> Posterior:
    """Filter ``y`` of shape ``(..., T, C)`` with an OU prior per channel; returns a :class:`Posterior`.

    Model per channel ``c`` (independent channels): ``x_t - mean = decay_t (x_{t-1} - mean) +
    N(0, noise_t)`` with ``(decay, noise)`` the exact OU discretisation of ``(theta, sigma)`` over
    the step ``dt_t`` (:func:`kalmanscan.model.ou.discretize`), and ``y_t = h x_t + N(0, obs_var)``.
    ``N(init_mean, init_var)`` is the belief at the first observation time, before ``y_0``.

    Args:
        y: observations ``(..., T, C)``; NaN marks a missing value (predict, no update, zero
            log-likelihood). NumPy in gives NumPy out; a torch tensor gives tensors on its device,
            differentiable with respect to ``y`` and every parameter. A pandas ``DataFrame`` (channels
            by column) or ``Series`` (one channel) gives DataFrames with its index and columns, the
            index giving the times (``time_unit=`` for dates): :mod:`kalmanscan.inference.frames`.
        theta: mean-reversion rate ``>= 0`` (0 is the random walk).
        sigma: diffusion scale ``>= 0``.
        obs_var: observation noise variance ``> 0``.
        mean: OU mean level (the filter works on the centred state ``x - mean``).
        h: observation gain.
        dt: step between consecutive observations ``> 0``; ignored when ``times`` is given.
        times: observation times ``(T,)`` or ``(..., T, 1)``, strictly increasing.
        init_mean: prior mean ``(..., C)``; default ``mean``.
        init_var: prior variance ``(..., C)``; default the stationary ``sigma^2 / (2 theta)``,
            required when ``theta = 0`` or ``sigma = 0``. ``float("inf")`` is the exact diffuse
            prior (precision 0): the log-likelihood then leaves out each such channel's first
            observation, counted by ``Posterior.n_diffuse`` (:mod:`kalmanscan.inference.diffuse`).
        backend: ``"auto"`` (triton on CUDA, the compiled loop on the CPU), ``"cpu"``,
            ``"torch"``, ``"triton"``, ``"reference"`` (sequential float64 covariance form) or
            a name added by :func:`kalmanscan.ops.filter.register_backend`.

        outputs: the fields to compute, a subset of :data:`OUTPUTS` (``None``: all). The others
            are ``None`` in the result (``"loglik"`` brings the per-step ``logliks``; ``"missing"``
            is the 0/1 flag in ``params``). The backend writes the filtered mean and variance and
            sums the log-likelihood when it is wanted (:data:`LEAN`); every other field is derived
            from them on its first access, all wanted ones in one pass, and kept
            (:mod:`kalmanscan.inference.derived`): a call whose mean and variance alone are read
            pays for those.
        state: continue a stream from a previous call's ``post.state`` (a :class:`StreamState`)
            or its Posterior: the prior is the state's prediction through this chunk's transition
            into step 0 (``dt`` at index 0, or ``times[0] - state.time``; with ``state`` index 0
            has a transition), so chunk by chunk equals one call over the whole series
            (:mod:`kalmanscan.inference.stream`). Excludes ``init_mean`` and ``init_var``.
        check_finite: whether to check that ``y`` holds no ``inf`` (``ValueError`` naming ``y``),
            as SciPy's ``check_finite``. On a GPU it is one reduction of ``y`` (4 bytes an
            element read) queued before the kernels and read back once they are queued: the
            call's one synchronisation, which waits for the reduction, not for the kernels (with
            parameters given as device tensors, it is read with their checks, once the kernels
            are queued). On a CPU it is one reduction of the result. A result read that way
            which is not finite though ``y`` is (a log-likelihood of ``-inf``: an observation
            too far from its prediction for the dtype) is an error too. ``False`` skips it: no
            synchronisation, and an ``inf`` in ``y`` shows as a non-finite result instead of an
            error. The parameters are checked either way.

    Parameters are static (scalars or ``(C,)``, or ``(..., 1, C)`` with batch dimensions) or per
    step (``(..., T, C)``); a per-step value at index ``t`` governs the transition into step ``t``
    and the observation at ``t`` (index 0 has no transition).

    Raises:
        ValueError: naming the argument, for bad values or shapes (see :mod:`kalmanscan.problem.prepare`),
            and naming the parameter and the limit where a derived quantity (the stationary
            variance, the process noise, a value in y's dtype) overflows (:mod:`kalmanscan.problem.bounds`).
    """
    # With parameters checked on the host, y's inf check is decided once the kernels are queued
    # (checks.decide_y): for a large y on a GPU the triton backend queues it with its kernels and
    # it is read while they run (the call's one synchronisation); otherwise from the result (an
    # inf in y makes the log-likelihood and the filtered mean from its step on, the last step's
    # too, non-finite), y searched only when that is not finite. Parameters checked on their
    # device need a read of their own. On the triton backend it is read once the kernels are
    # queued (confirmed), the facts that pick the kernels' path (a diffuse prior, no process noise)
    # assumed until then and the call run again, checked first, when they differ; y's check is
    # then late as on the host path when the parameters are static, else it joins that read (one
    # reduction). On the other backends the read, with y's check, comes before the kernels.
    if state is not None:  # prepare checks the state as the prior; continue_problem predicts it
        state, init_mean, init_var = as_prior(state, init_mean, init_var)
    args = dict(y=y, theta=theta, sigma=sigma, obs_var=obs_var, mean=mean, h=h, dt=dt, times=times,
                init_mean=init_mean, init_var=init_var, backend=backend, outputs=outputs)
    for p, finite, diffuse in attempts(args, state, check_finite):
        # the backend writes the moments and the log-likelihood; the other fields are derived when read
        wanted = OUTPUTS if p.outputs is None else p.outputs
        backend = get_backend(p.backend)
        ask = (LEAN[:2] if "logliks" not in wanted else ("mean", "var", "loglik")
               if getattr(backend, "SUMS_LOGLIK", False) else LEAN)
        out = run_finite(dataclasses.replace(finite, outputs=ask), diffuse, backend.filter)
        if confirmed(p, state):
            break
    queued = out.pop("y_check", None)
    if "logliks" in wanted and "loglik" not in out:  # the fused kernels sum it as they go
        out["loglik"] = sum_time(out["logliks"])  # (the finite problem's steps before a diffuse channel's
    out = {k: out[k] for k in ("mean", "var", "loglik", "decay", "noise") if k in out}  # first observation add 0)
    if diffuse is not None:
        out = {**restore(p, diffuse, out), **{k: out[k] for k in ("loglik",) if k in out}}
    witness = out["loglik"] if "logliks" in wanted else out["mean"][..., -1, :] if "mean" in wanted else None
    post = make_posterior(p, out, diffuse=diffuse, derive=wanted)
    if p.y_late:
        decide_y(p.y, queued, diffuse_witness(witness, finite, diffuse))
    elif check_finite and witness is not None and not p.y.is_cuda:  # (y checked already; no wait on the host)
        decide_y(p.y, None, diffuse_witness(witness, finite, diffuse))
    return post if state is None else mark(post, state)


def attempts(args: dict, state: StreamState | None,
             check_finite: bool) -> Iterator[tuple[Problem, Problem, Diffuse | None]]:
    """``(p, finite, diffuse)`` for each run of a call: the problem and plan
    :func:`~kalmanscan.problem.prepare.prepare` makes of ``args`` (the keywords of :func:`filter`;
    continuing ``state``), its finite form and diffuse part
    (:func:`~kalmanscan.inference.diffuse.finite_problem`), which the caller runs on the plan's
    backend (:func:`~kalmanscan.inference.diffuse.run_finite`) and stops after once
    :func:`confirmed`. With the parameters checked on the host (:attr:`Problem.y_late`) ``y``'s
    check is left to the caller, the triton backend asked to queue it with its kernels; else it
    joins the parameters' checks, which on the triton backend are read once the kernels are
    queued: a read that refutes the facts assumed until then asks for a second run, checked first.
    (A generator: its frame is not on the stack while the backend runs.)"""
    for defer in (True, False):
        with naming_state(state):
            p = prepare(**args, check_y=check_finite, late_y=True, defer=defer)
        if state is not None:
            p = continue_problem(p, state)
        # on a CPU the per-step path costs the loops an exp and an expm1 per element; on a GPU the
        # two runs' joined copies would move more memory than the per-step parameters: not timed
        finite, diffuse = finite_problem(p, split=p.y.device.type == "cpu")
        if p.y_late and diffuse is None:  # the triton backend may queue y's check with its kernels
            finite = dataclasses.replace(finite, y_check=True)
        yield p, finite, diffuse


def confirmed(p: Problem, state: StreamState | None = None) -> bool:
    """Whether ``p``'s facts hold: true unless :func:`~kalmanscan.problem.prepare.prepare` deferred its
    checks (``p.pending``); then they are read now, once the kernels are queued (``ValueError`` for
    a bad value, named as ``prepare`` names it), and compared with the facts it assumed."""
    if p.pending is None:
        return True
    with naming_state(state):
        facts = p.pending.decide()
    return all(facts[k] == GUESSED[k] for k in facts)


def _read_only(x):
    """A NumPy array as a read-only view (a tensor as it is)."""
    if isinstance(x, np.ndarray):
        x = x.view()
        x.flags.writeable = False
    return x


def make_posterior(p: Problem, out: dict[str, torch.Tensor], filtered: Posterior | None = None,
                   diffuse: Diffuse | None = None, derive: Sequence[str] = (),
                   derive_from: Posterior | None = None) -> Posterior:
    """Wrap a backend's result dict into a :class:`Posterior` in the caller's array kind. The fields
    of :data:`~kalmanscan.inference.derived.DERIVED` and ``missing`` named in ``derive`` are
    derived from ``out``'s filtered ``mean`` and ``var`` (restored where ``diffuse``) on the first
    access to any of them, in one pass (:func:`kalmanscan.inference.derived.derive`), and kept; the
    other fields of :data:`OUTPUTS` not in ``derive`` are then ``None``. ``derive_from`` (a
    smoother's filtered posterior): the fields of ``DERIVED`` but ``precision``, and ``missing``,
    are its own, read from it on first access."""
    shape = p.shape
    out = dict(out)
    loglik = out.pop("loglik", None)
    def full(v):
        return p.output(v if tuple(v.shape) == shape else torch.broadcast_to(v, shape))

    lazily = ("decay", "noise", "missing")
    deferred = tuple(k for k in derived.DERIVED if k in derive)
    shared = () if derive_from is None else tuple(k for k in derived.DERIVED if k != "precision")
    out.update(dict.fromkeys(shared))
    if derive:
        moments = out["mean"], out["var"]
        named = tuple(k for k in (*derived.DERIVED, "missing") if k in derive)  # the others are not made
        fields = functools.cache(lambda: derived.derive(p, *moments, diffuse, named))
        out.update({k: out.get(k) if k in derive else None for k in ("mean", "var", *derived.DERIVED, "missing")})
    conv = {k: None if v is None else full(v) for k, v in out.items() if k not in lazily}
    # The parameters, times and counts are made when read (Params): most callers read none.
    # NumPy parameters come back read-only: they may be views of the caller's arrays.
    lazy = {k: (lambda k=k: _read_only(full(getattr(p, k)))) for k in ("theta", "sigma", "obs_var", "mean", "h", "dt")}
    for k in lazily:
        v = out.get(k)
        lazy[k] = (lambda v=v: None if v is None else full(v))
    transition = functools.cache(p.decay_noise)  # decay and noise: the problem's where the backend left them out
    for i, k in enumerate(("decay", "noise")):
        if out.get(k) is None:
            lazy[k] = lambda i=i: full(transition()[i])
    if "missing" in derive:
        lazy["missing"] = lambda: full(fields()["missing"])
    if derive_from is not None:
        lazy["missing"] = lambda: derive_from.params["missing"]
    for k in ("init_mean", "init_var"):
        lazy[k] = lambda k=k: _read_only(p.output(getattr(p, k).expand(shape[:-2] + (1, shape[-1]))[..., 0, :]))
    lazy["times"] = lambda: _read_only(_times(p))
    lazy["n_diffuse"] = lambda: _n_diffuse(p, diffuse)
    params = Params({"times_given": p.times is not None}, lazy)
    logliks = conv.pop("logliks", None)
    if p.outputs is not None and "loglik" not in p.outputs:
        loglik = None
    elif loglik is None:  # summed as filter() sums it: before any conversion to NumPy
        loglik = None if out.get("logliks") is None else p.output(sum_time(out["logliks"]))
    else:
        loglik = p.output(loglik)
    post = Posterior(logliks=logliks, loglik=loglik, params=params, filtered=filtered, **conv)
    if deferred:
        post.defer(deferred, lambda: {k: full(fields()[k]) for k in deferred})
    if shared:
        post.defer(shared, lambda: {k: getattr(derive_from, k) for k in shared})
    return post


def _n_diffuse(p: Problem, diffuse: Diffuse | None):
    """Observations left out of the log-likelihood per channel, ``(..., C)`` (:attr:`Posterior.n_diffuse`)."""
    shape = p.shape
    n = (torch.zeros(shape[:-2] + (shape[-1],), dtype=torch.int64, device=p.y.device)
         if diffuse is None else diffuse.n_diffuse)
    return n.cpu().numpy() if p.numpy_out else n


_BLOCK = 64
"""Steps summed in the input's dtype before the float64 sum over blocks (:func:`sum_time`)."""


def sum_time(logliks: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """The sum over time, returned in the input's dtype and array kind, accumulated in float64 (a
    float32 sum over 10^6 steps would lose about 3 digits). A large float32 tensor is summed in
    blocks of :data:`_BLOCK` steps in float32 (relative rounding below ``64 eps`` of a block's
    magnitude, under the float32 result's own) and the blocks in float64: no float64 copy of every
    step, which torch's ``sum(dtype=float64)`` would make."""
    if not isinstance(logliks, torch.Tensor):
        return logliks.sum(-2, dtype=np.float64).astype(logliks.dtype, copy=False)
    T = logliks.shape[-2]
    if logliks.dtype == torch.float64 or logliks.numel() < (1 << 20) or T < 2 * _BLOCK:
        return logliks.sum(-2, dtype=torch.float64).to(logliks.dtype)
    whole = T - T % _BLOCK
    blocks = logliks[..., :whole, :].unflatten(-2, (whole // _BLOCK, _BLOCK)).sum(-2)
    total = blocks.sum(-2, dtype=torch.float64) + logliks[..., whole:, :].sum(-2, dtype=torch.float64)
    return total.to(logliks.dtype)


def _times(p: Problem):
    """Observation times broadcast to ``p.shape`` in float64 (from 0 by ``dt`` when not given).

    Kept in float64 whatever the compute dtype, so absolute times (e.g. epoch seconds) survive
    for forecasting to given future times. Returned as a broadcast view: nothing of the full
    shape is materialised for static ``dt`` or ``times``.
    """
    if p.times is not None:
        t = p.times
    else:
        dt = p.dt.detach().to(torch.float64)
        if dt.shape[-2] == 1:
            steps = torch.arange(p.shape[-2], dtype=torch.float64, device=dt.device).unsqueeze(-1)
            t = steps * dt
        else:
            # cumsum along the last axis: CUDA scans an inner axis in parallel, an outer one per column
            steps = torch.cat([torch.zeros_like(dt[..., :1, :]), dt[..., 1:, :]], -2)
            t = torch.cumsum(steps.transpose(-1, -2), -1).transpose(-1, -2)
    t = torch.broadcast_to(t, p.shape)
    return t.detach().cpu().numpy() if p.numpy_out else t
