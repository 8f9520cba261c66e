"""``ks.smooth``: Rauch–Tung–Striebel smoothing as two reverse affine scans over the filter's output.

Given the filtered centred mean ``mu_t`` and variance ``var_t`` and the one-step predictions of the
next step, with ``J_t = a_{t+1} var_t / pred_var_{t+1}``:

    mu_s_t  = J_t mu_s_{t+1} + e_t mu_t,        e_t = q_{t+1} / pred_var_{t+1} = 1 - a_{t+1} J_t
    var_s_t = J_t^2 var_s_{t+1} + var_t q_{t+1} / pred_var_{t+1}

and ``mu_s_{T-1} = mu_{T-1}``, ``var_s_{T-1} = var_{T-1}``. The mean recursion is the textbook
``mu_t + J_t (mu_s_{t+1} - pred_mu_{t+1})`` with ``pred_mu_{t+1} = a_{t+1} mu_t`` cancelled exactly,
and the variance recursion is written with ``var_t - J_t^2 pred_var_{t+1} = var_t q_{t+1} /
pred_var_{t+1} >= 0``: every coefficient is non-negative and nothing cancels. Without process
noise ``J = 1 / a`` compounds over steps without an observation; the textbook difference, of the
size of the next step's update, then lost the value's and above all the gradient's digits at the
rate ``a^-k``. Here every term is of the size of the result, given a centred mean kept to full
precision as it shrinks: the filter runs on the centred problem (:func:`centre`), whose mean is
the centred one. Both are affine recursions run backwards in time by
:func:`kalmanscan.model.scan.associative_scan` (``reverse=True``) in the torch backend: O(T) work,
O(log T) depth, differentiable by autograd. Every backend provides ``smooth`` (:mod:`kalmanscan.ops.filter`):
the reference a float64 loop, triton fused reverse walks (without gradients), cpu a compiled loop.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from kalmanscan.inference.diffuse import diffuse_witness, restore, run_finite, smooth_leading
from kalmanscan.problem.checks import decide_y
from kalmanscan.inference.frames import pandas_io
from kalmanscan.inference import derived
from kalmanscan.inference.filtering import LEAN, attempts, confirmed, make_posterior, sum_time
from kalmanscan.ops.filter.dispatch import get_backend
from kalmanscan.problem.problem import OUTPUTS
from kalmanscan.inference.stream import StreamState, as_prior, mark
from kalmanscan.types import ArrayLike

if TYPE_CHECKING:
    from kalmanscan.inference.posterior import Posterior
    from kalmanscan.problem.problem import Problem


__all__ = ["smooth", "centre"]


@pandas_io
def smooth(y: ArrayLike, *, theta: ArrayLike, sigma: ArrayLike, obs_var: ArrayLike, mean: ArrayLike = 0.0,
           h: ArrayLike = 1.0, dt: ArrayLike = 1.0, times: ArrayLike | None = None,
           init_mean: ArrayLike | None = None, init_var: ArrayLike | None = None, backend: str = "auto",
           state: StreamState | Posterior | None = None, check_finite: bool = True) -> Posterior:
    """Smoothed moments ``p(x_t | y_0..y_{T-1})``; arguments as :func:`kalmanscan.filter` but ``outputs``
    (``check_finite=False`` skips the check that ``y`` holds no ``inf``).

    Returns a :class:`~kalmanscan.Posterior` whose ``mean, var, precision`` are smoothed; its
    ``pred_*`` fields and ``logliks`` are the filter's (one-step predictions and likelihood do not
    change under smoothing), and ``filtered`` holds the filter's full posterior. With ``state``
    (as :func:`kalmanscan.filter`) the chunk is smoothed given all the data before it as well.
    """
    if state is not None:  # prepare checks the state as the prior; continue_problem predicts it
        state, init_mean, init_var = as_prior(state, init_mean, init_var)
    # y's inf check as ks.filter's: decided once the kernels are queued when the parameters are
    # checked on the host (checks.decide_y), else joined with their checks, read once the triton
    # backend's kernels are queued (before the kernels on the other backends).
    args = dict(y=y, theta=theta, sigma=sigma, obs_var=obs_var, mean=mean, h=h, dt=dt, times=times,
                init_mean=init_mean, init_var=init_var, backend=backend)
    for p, finite, diffuse in attempts(args, state, check_finite):
        backend = get_backend(p.backend)  # the filter's moments and log-likelihood, as ks.filter asks
        ask = ("mean", "var", "loglik") if getattr(backend, "SUMS_LOGLIK", False) else LEAN
        centred = centre(finite)
        out = run_finite(dataclasses.replace(centred, outputs=ask), diffuse, backend.filter)
        if confirmed(p, state):
            break
    queued = out.pop("y_check", None)
    if "loglik" not in out:  # the fused kernels sum it as they go
        out["loglik"] = sum_time(out["logliks"])
    # decay and noise: the problem's where the backend left them out
    decay, noise = (out["decay"], out["noise"]) if "decay" in out else centred.decay_noise()
    out = dict(mean=out["mean"], var=out["var"], loglik=out["loglik"], decay=decay, noise=noise)
    shape = p.shape
    # the smoother reads the centred filtered mean (centred.mean is 0); the predictions, derived
    # on the finite problem (in a diffuse channel's window, replaced below, they need not follow
    # its identity transitions)
    z = torch.broadcast_to(out["mean"], shape)
    pred = derived.derive(centred, z, torch.broadcast_to(out["var"], shape), fields=("pred_mean", "pred_var"))
    full = {k: torch.broadcast_to(out[k], shape) for k in ("var", "decay", "noise")}
    full.update(mean=z, pred_mean=pred["pred_mean"], pred_var=pred["pred_var"])
    del pred
    mean_param = torch.broadcast_to(p.mean, shape)
    mean_s, var_s, precision_s = backend.smooth(full, torch.broadcast_to(centred.mean, shape))
    del full
    mean_s = mean_s + mean_param
    if diffuse is not None and diffuse.hold is not None:
        # the window's run hands its belief to the rest through the mean less the OU mean
        # (diffuse.run_finite), rounded otherwise on the centred problem: the filtered fields
        # reported are those of the problem as given, as ks.filter's
        given = run_finite(dataclasses.replace(finite, outputs=ask), diffuse, backend.filter)
        out.update(mean=given["mean"], loglik=given["loglik"] if "loglik" in given else sum_time(given["logliks"]))
    else:  # the backends add the OU mean to the centred one so: the same bits
        out["mean"] = z + mean_param
    if finite.no_process_noise() and not bool(
            (torch.isfinite(mean_s) & torch.isfinite(var_s)).all()):
        raise ValueError("sigma must be > 0 where theta > 0 to smooth this series: without process "
                         "noise the smoother's gain is 1/decay and its backward recursion leaves the "
                         "floating-point range (ks.filter handles sigma = 0)")
    if diffuse is not None:
        out = {**restore(p, diffuse, out), "loglik": out["loglik"]}
        mean_s, var_s, precision_s = smooth_leading(p, diffuse, out, mean_s, var_s, precision_s)
    filtered = make_posterior(p, out, diffuse=diffuse, derive=OUTPUTS)
    smoothed = dict(out, mean=mean_s, var=var_s, precision=precision_s)
    post = make_posterior(p, smoothed, filtered=filtered, diffuse=diffuse, derive_from=filtered)
    if p.y_late:
        decide_y(p.y, queued, diffuse_witness(out["loglik"], finite, diffuse))
    elif check_finite and not p.y.is_cuda:  # (y checked already; no wait on the host)
        decide_y(p.y, None, diffuse_witness(out["loglik"], finite, diffuse))
    return post if state is None else mark(post, state)


def centre(p: Problem) -> Problem:
    """``p`` on the centred state ``x - mean``: ``y - h mean``, ``init_mean - mean_0`` and an OU
    mean of 0, so the filter's mean is the centred one, to full precision as it shrinks (the
    backends form exactly these two differences and filter the same numbers: the moments and the
    log-likelihood are unchanged, bit for bit), and differentiable as such: the gradient of the
    smoothed mean through ``J = 1 / a`` compounded over steps without process noise needs it (the
    mean minus ``mean`` afterwards, rounded to the mean's own scale, lost it)."""
    level = p.mean.to(p.dtype)
    return dataclasses.replace(p, y=p.y - p.h * level, mean=torch.zeros_like(level[..., :1, :1]),
                               init_mean=p.init_mean - level[..., :1, :])
