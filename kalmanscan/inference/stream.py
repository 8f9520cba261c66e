"""Streaming: ``ks.filter(y_chunk, ..., state=...)`` continues a previous call exactly.

A :class:`StreamState` is the filtered belief at the last step of a call, ``N(mean, var)`` per
series ``(..., C)``, with what continuing it needs: the OU mean level at that step (the filter
carries the deviation ``mean - level``), the time of that step when the call had ``times``, and
the number of steps filtered so far. ``post.state`` returns it; ``state=`` takes it or a
:class:`~kalmanscan.Posterior`.

Continuing is one prediction step. For a chunk whose first step comes ``dt_0`` after the state's
(``times[0] - state.time`` with ``times``, else the chunk's ``dt`` at index 0), with the chunk's
``theta, sigma, mean`` at index 0:

    decay, noise = discretize(theta_0, sigma_0, dt_0)
    init_mean = mean_0 + decay (state.mean - state.level)
    init_var  = decay^2 state.var + noise          (inf stays inf: nothing observed yet)

which is the filter's own transition into that step, so the chunk filtered from this prior is the
filter of the whole series at those steps, on every backend unchanged: the log-likelihoods of the
chunks add up to the whole series', and the smoother of a chunk is conditioned on all the data up
to its end. A state whose variance is still ``inf`` (a diffuse prior and no observation yet) gives
a diffuse prior for the chunk, whose first observation is then left out of the log-likelihood as
it is in one call. In float64 the chunks agree with one call to rounding; in float32 with data
offset far from zero the state's mean carries the rounding of the reported mean (``|mean|``
times 6e-8), which the continuation inherits.

Validation. The state's deviation ``mean - level`` and variance go through
:func:`kalmanscan.problem.prepare.prepare` as the prior (shapes, values, the diffuse flag: no further
synchronisation), its errors renamed to the state's fields; with ``times`` the chunk must start
after ``state.time``, one more synchronisation when the times are on a device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from kalmanscan.model import ou
from kalmanscan.problem.checks import Checks
from kalmanscan.problem.problem import Problem
from kalmanscan.inference.posterior import Posterior
from kalmanscan.inference.state import StreamState, last_state

__all__ = ["StreamState", "as_prior", "naming_state", "continue_problem", "known_state", "predict", "mark",
           "last_state"]


def as_prior(state: StreamState | Posterior, init_mean: Any, init_var: Any) -> tuple[StreamState, Any, Any]:
    """``(state, deviation, var)``: ``state`` as a :class:`StreamState` (a Posterior gives its
    ``.state``) and its ``mean - level`` and ``var``, which :func:`kalmanscan.problem.prepare.prepare` then
    checks as the prior (values, shapes and the diffuse flag, with its one synchronisation; see
    :class:`naming_state`) before :func:`continue_problem` predicts them into the chunk.
    ``ValueError`` naming ``state`` when ``init_mean`` or ``init_var`` is given too, or for another type.

    A state of variance 0 is a known state, which the filter reaches without process noise
    (``sigma = 0``, the variance underflowing): ``prepare``'s rule for a prior is ``init_var > 0``,
    so the variance handed to it is 1 there (:func:`known_state`), and :func:`continue_problem`
    takes that 1 off again (exactly, and with the gradient of ``state.var`` unchanged)."""
    if init_mean is not None or init_var is not None:
        raise ValueError("state and init_mean/init_var exclude each other: the prior of a chunk that "
                         "continues a state is the state's prediction to the chunk's first step")
    if isinstance(state, Posterior):
        state = state.state
    if not isinstance(state, StreamState):
        raise ValueError(f"state must be a ks.StreamState or a ks.Posterior, got {type(state).__name__}")
    return state, state.mean - state.level, state.var + (state.var == 0)


class naming_state:
    """The context of :func:`kalmanscan.problem.prepare.prepare` given :func:`as_prior`'s prior: its errors
    about ``init_var`` and ``init_mean`` are about the state, and name it (no-op without one)."""

    def __init__(self, state: StreamState | None):
        self.state = state

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, err, trace) -> bool:
        if self.state is None or kind is not ValueError:
            return False
        message = str(err)
        if message.startswith(("init_mean", "init_var")) and " does not broadcast to " in message:
            shapes = [tuple(np.shape(getattr(self.state, k))) for k in ("mean", "var", "level")]
            raise ValueError(f"state (mean, var, level of shapes {shapes}) does not broadcast to "
                             f"{message.rsplit(' does not broadcast to ', 1)[1]}") from None
        if message.startswith("init_var must be > 0"):  # 0 is a known state (as_prior)
            raise ValueError("state.var must be >= 0" + message[len("init_var must be > 0"):]) from None
        for prior, field in (("init_var", "state.var"), ("init_mean", "state.mean - state.level")):
            if message.startswith(prior):
                raise ValueError(field + message[len(prior):]) from None
        return False


def continue_problem(p: Problem, state: StreamState) -> Problem:
    """``p``, prepared with :func:`as_prior`'s prior, with the prior of a chunk that continues
    ``state``: its prediction through the chunk's transition into step 0 (module docstring).

    Without ``times`` this adds no check. With them, the chunk must start after ``state.time``
    (``ValueError`` naming ``times``, or ``state.time`` when it is missing or not finite): no
    synchronisation when both are on the CPU, one when they are on a device.
    """
    if p.times is None:
        dt0 = p.dt[..., :1, :]
    else:
        if state.time is None:
            raise ValueError("state.time is None (the state comes from a call without times): a chunk with "
                             "times needs the time of the state's last step; give it as StreamState(time=...)")
        time = torch.as_tensor(state.time.detach() if isinstance(state.time, torch.Tensor) else state.time,
                               dtype=torch.float64, device=p.times.device)
        time = time.reshape(1, 1) if time.ndim == 0 else time.unsqueeze(-2)
        try:
            np.broadcast_shapes(p.shape[:-2] + (1, 1), tuple(time.shape))
        except ValueError:
            raise ValueError(f"state.time of shape {tuple(time.shape[:-2]) + (1,)} does not broadcast to "
                             f"{p.shape[:-2] + (1,)}") from None
        gap = p.times[..., :1, :] - time  # float64, as the steps within the chunk
        checks = Checks()
        checks.add("state.time", time, torch.isfinite, "finite")
        checks.require("times must start after state.time (the time of the state's last step)", torch.all(gap > 0))
        checks.decide()
        dt0 = gap.to(p.dtype)
    if p.times is None and p.derived is not None:  # static: computed on the host with the checks
        decay, noise = (x[..., :1, :] for x in p.decay_noise())
    else:
        decay, noise = ou.discretize(p.theta[..., :1, :], p.sigma[..., :1, :], dt0)
    var = p.init_var - known_state(state.var, p.init_var)  # as_prior handed prepare 1 for a known state
    init_mean, init_var = predict(p.mean[..., :1, :], decay, noise, p.init_mean, var, p.diffuse)
    return dataclasses.replace(p, init_mean=init_mean, init_var=init_var)


def known_state(var: Any, like: torch.Tensor) -> torch.Tensor | float:
    """1 where the state's variance ``var`` ``(..., C)`` is 0 (a known state), else 0, shaped as the
    prior ``like`` ``(..., 1, C)`` and on its device, in its dtype (0.0 when no NumPy or Python
    variance is 0: no operation for the common state)."""
    if isinstance(var, torch.Tensor):
        zero = var.detach() == 0
    else:
        zero = np.asarray(var) == 0
        if not zero.any():
            return 0.0
        zero = torch.as_tensor(zero)
    zero = zero.to(device=like.device, dtype=like.dtype)
    return zero.reshape(1, 1) if zero.ndim == 0 else zero.unsqueeze(-2)


def predict(level: torch.Tensor, decay: torch.Tensor, noise: torch.Tensor, deviation: torch.Tensor,
            var: torch.Tensor, diffuse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The belief ``N(level + deviation, var)`` one transition on: ``(level + decay deviation,
    decay^2 var + noise)``, ``level`` the OU mean at the new step. With ``diffuse`` a variance
    still ``inf`` stays ``inf`` (and no ``inf * 0`` enters the gradient)."""
    if diffuse:
        unknown = torch.isinf(var)
        known = torch.where(unknown, torch.zeros_like(var), var)
        new_var = torch.where(unknown, var, torch.addcmul(noise, decay * decay, known))
    else:
        new_var = torch.addcmul(noise, decay * decay, var)
    return torch.addcmul(level, decay, deviation), new_var


def mark(post: Posterior, state: StreamState) -> Posterior:
    """``post`` (and the filter's posterior inside a smoother's) counting the steps before it:
    ``params["steps_before"] = state.steps``, which :func:`last_state` adds to."""
    for q in (post, post.filtered):
        if q is not None:
            q.params["steps_before"] = state.steps
    return post
