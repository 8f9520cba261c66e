"""The ``"torch"`` backend of :func:`kalmanscan.filter` and :func:`kalmanscan.smooth`: the
time-parallel information-form filter and RTS smoother in torch tensor ops.

Two associative scans along time (:func:`kalmanscan.model.scan.associative_scan`): the Möbius scan of the precision
(:mod:`kalmanscan.model.mobius`), read out as the variance, then the affine scan of the mean whose gates
need the previous variance (mean form, so no process noise, ``sigma = 0``, stays in range). Runs on
any device, float32 or float64, and is differentiable by autograd
with respect to ``y`` and every parameter (the power-of-two rescaling in the Möbius products is
piecewise constant, so those gradients are exact).
"""

from __future__ import annotations

import math

import torch

from kalmanscan.model import merged, mobius, ou
from kalmanscan.model.reciprocal import quotient, reciprocal
from kalmanscan.problem.problem import Problem
from kalmanscan.model.scan import associative_scan

__all__ = ["compact", "filter", "smooth", "summary", "finish", "gain_terms", "rts_gains", "first_step_identity",
           "adjoint_to"]


def first_step_identity(x: torch.Tensor, value: float) -> torch.Tensor:
    """``x`` broadcast to its time length with index 0 replaced by ``value`` (no transition)."""
    return torch.cat([torch.full_like(x[..., :1, :], value), x[..., 1:, :]], -2)


def compact(x: torch.Tensor) -> torch.Tensor:
    """``x`` without its broadcast dimensions (stride 0, size > 1), each cut to size 1 (a
    differentiable view). The fused and compiled backends read a stride-0 time axis as a static
    parameter, so their backward sums its adjoint over time; given the cut view, autograd's own sum
    takes that total back to the expanded tensor's base, instead of a per-step adjoint being
    expected of it (an expanded ``theta`` of shape ``(T, C)`` got ``T`` times its gradient)."""
    for dim in range(x.ndim):
        if x.stride(dim) == 0 and x.shape[dim] > 1:
            x = x.narrow(dim, 0, 1)
    return x


def adjoint_to(g: torch.Tensor, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A ``(B, 1 or T, C)`` adjoint of a problem of ``shape`` as ``shape[:-2] + (1 or T, C)``,
    summed to ``like``'s (a parameter's broadcastable) shape, in its dtype. Shared by the
    backends' backward passes (cpu, triton)."""
    return g.reshape(shape[:-2] + g.shape[-2:]).sum_to_size(like.shape).to(like.dtype)


def filter(p: Problem) -> dict:
    """Filter the validated problem ``p``; the contract of every backend's ``filter``
    (:mod:`kalmanscan.ops.filter`): a dict of tensors broadcastable to ``p.shape``."""
    shape = p.shape
    y, h, obs_var, mean = p.y, p.h, p.obs_var, p.mean
    decay, noise = p.decay_noise()
    missing = torch.isnan(y)
    y_obs = torch.where(missing, torch.zeros_like(y), y)
    r = reciprocal(obs_var)  # its gradient stays in range at any scale of obs_var
    phi = torch.where(missing, torch.zeros_like(y_obs), h * h * r).expand(shape)
    b = torch.where(missing, torch.zeros_like(y_obs), h * r * (y_obs - h * mean)).expand(shape)
    a = first_step_identity(decay.expand(shape), 1.0)
    q = first_step_identity(noise.expand(shape), 0.0)

    var0 = p.init_var.expand(shape[:-2] + (1, shape[-1]))
    mu0 = (p.init_mean - mean[..., :1, :]).expand(var0.shape)
    P = associative_scan(mobius.compose, mobius.leaf(a, q, phi), dim=-2)
    var = mobius.propagate_var(P, var0)  # from the variance: a known state (var0 = 0) has no finite precision
    var_prev = torch.cat([var0, var[..., :-1, :]], -2)
    pred_var = a * a * var_prev + q
    G, W = associative_scan(mobius.affine_compose, (mobius.mean_gate(a, pred_var, phi), b * var), dim=-2)
    mu_c = G * mu0 + W
    pred_mu_c = a * torch.cat([mu0, mu_c[..., :-1, :]], -2)
    # b * var saved var for the backward; a var needing no gradient may be written in place by the
    # caller (the diffuse restore), so it gets its own copy then
    reported = var.clone() if b.requires_grad and not var.requires_grad and torch.is_grad_enabled() else var
    return finish(p, mu_c, reciprocal(var), pred_mu_c, pred_var, missing, decay, noise, var=reported)


def finish(p: Problem, mu_c: torch.Tensor, lam: torch.Tensor, pred_mu_c: torch.Tensor, pred_var: torch.Tensor,
           missing: torch.Tensor, decay: torch.Tensor, noise: torch.Tensor,
           var: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Add the offsets, the predictive law of y and log-likelihoods to centred filter moments.

    ``mu_c`` and ``pred_mu_c`` are centred (``x - mean``); ``lam`` is the filtered precision and
    ``var`` the filtered variance where the backend carries it (``None``: ``1 / lam``), reported
    as it is: a subnormal variance has no finite precision, and ``1 / (1 / var)`` would be 0.
    Shared by the torch and triton backends so both report identical derived quantities. Only the
    fields of ``p.outputs`` (all when ``None``) are formed, with ``decay`` and ``noise``: a
    log-likelihood alone (:mod:`kalmanscan.estimation.likelihood`) costs no full-size operation for the rest.
    ``"loglik"`` among them adds the log-likelihood summed over time, ``(..., C)`` (in float64,
    returned in the compute dtype; differentiable), as the triton backend's kernels sum it.
    """
    every = p.outputs is None
    wanted = set() if every else set(p.outputs)
    h, mean = p.h, p.mean
    out = dict(decay=decay, noise=noise)
    if every or "mean" in wanted:
        out["mean"] = mu_c + mean
    if every or "var" in wanted:
        out["var"] = reciprocal(lam) if var is None else var
    if every or "precision" in wanted:
        out["precision"] = lam
    if every or "pred_mean" in wanted:
        out["pred_mean"] = pred_mu_c + mean
    if every or "pred_var" in wanted:
        out["pred_var"] = pred_var
    if every or "pred_precision" in wanted:
        out["pred_precision"] = reciprocal(pred_var)
    if every or "pred_obs_mean" in wanted:
        out["pred_obs_mean"] = (h * (pred_mu_c + mean)).expand(p.shape)
    if every or wanted & {"pred_obs_var", "logliks", "loglik"}:
        pred_obs_var = h * h * pred_var + p.obs_var
        out["pred_obs_var"] = pred_obs_var.expand(p.shape)
    if every or wanted & {"logliks", "loglik"}:
        y_obs = torch.where(missing, torch.zeros_like(p.y), p.y)
        innov = (y_obs - h * mean) - h * pred_mu_c  # centred: no cancellation against a large offset
        ll = -0.5 * (math.log(2 * math.pi) + torch.log(pred_obs_var) + innov * innov * reciprocal(pred_obs_var))
        out["logliks"] = torch.where(missing, torch.zeros_like(ll), ll).expand(p.shape)
    if "loglik" in wanted:
        out["loglik"] = out["logliks"].sum(-2, dtype=torch.float64).to(p.dtype)
    if every or "missing" in wanted:
        out["missing"] = missing.to(p.dtype)
    return out


def gain_terms(f: dict[str, torch.Tensor], mean_param: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(mu, J, bm, bv)`` of the RTS recursion from the filter's tensors ``f``: the centred
    filtered mean, the gains ``J_t = a_{t+1} var_t / pred_var_{t+1}`` and the offsets of the mean
    and variance recursions (``(..., T - 1, C)``; see :mod:`kalmanscan.inference.smoothing`), with
    a predicted variance of 0 read as its limit (:func:`rts_gains`). The mean's offset is ``bm_t =
    e_t mu_t``, ``e_t = 1 - a_{t+1} J_t = q_{t+1} / pred_var_{t+1}`` (1 at that limit): the
    textbook ``mu_t - J_t pred_mu_{t+1}`` with the prediction ``a_{t+1} mu_t`` cancelled exactly."""
    mu = f["mean"] - mean_param
    a_next, q_next, pv_next = (x[..., 1:, :] for x in (f["decay"], f["noise"], f["pred_var"]))
    var = f["var"][..., :-1, :]
    J, k, _ = rts_gains(a_next, q_next, var, pv_next)
    e = torch.where(pv_next > 0, k, 1.0)
    return mu, J, e * mu[..., :-1, :], var * k


def rts_gains(a: torch.Tensor, q: torch.Tensor, var: torch.Tensor,
              pred_var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(J, k, c)`` of one RTS step from the filtered ``var`` at ``t`` and the transition into
    ``t + 1`` (decay ``a``, noise ``q``, ``pred_var = a^2 var + q``): the gain ``J = a var /
    pred_var`` and the shares ``k = q / pred_var``, ``c = a^2 var / pred_var = a J`` (``k + c = 1``
    where ``pred_var`` is the filter's). Without process noise ``J = 1 / a``, ``k = 0`` and ``c =
    1``, formed so, where a subnormal ``pred_var`` would round ``a var / pred_var`` (as functions of
    free inputs the gradients are the textbook form's wherever ``q > 0``; at ``q = 0`` none flows
    to ``q``: the process noise ``sigma^2 (...)`` of every parameter has derivative 0 at ``sigma =
    0``, and ``1 / pred_var`` may overflow).

    A predicted variance of 0 (no process noise and ``a^2 var`` 0 or below the floating-point
    range) is read as its limit: the next state is ``a x_t`` exactly, so ``c = 1, k = 0`` where
    ``a > 0`` and ``c = 0, k = 1`` where ``a = 0`` (the next state says nothing of this one). The
    gain is then 0: the next step's update and smoothing correction are exactly 0 (its variance
    is 0), and the exact correction ``J (mean_s_{t+1} - pred_mean_{t+1})`` is of the order of
    ``a var_t h^2 / obs_var``, below the range, where ``J = 1 / a`` itself may not be. The
    quotients take safe denominators, so no branch left out puts a NaN in the gradient."""
    known = pred_var > 0
    noisy = known & (q > 0)
    pv = torch.where(known, pred_var, torch.ones_like(pred_var))
    exact = known & (q <= 0)  # J = 1 / a (a > 0 there: a^2 var > 0)
    J = torch.where(noisy, quotient(a * var, pv),
                    torch.where(exact, reciprocal(torch.where(exact, a, torch.ones_like(a))), torch.zeros_like(pv)))
    k = torch.where(noisy, quotient(q, pv), torch.where(known, torch.zeros_like(pv), (a <= 0).to(J.dtype)))
    return J, k, torch.where(noisy, a * J, 1.0 - k)


def smooth(f: dict[str, torch.Tensor], mean_param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Smoothed ``(mean, var, precision)`` from the filter's tensors ``f`` (each ``(..., T, C)``)
    by two reverse affine scans; differentiable by autograd. The contract of every backend's
    ``smooth`` (:mod:`kalmanscan.ops.filter`).

    The mean is scanned centred, ``mu_s_t = J_t mu_s_{t+1} + e_t mu_t`` (``mu = mean -
    mean_param``; :func:`gain_terms`): non-negative coefficients, so where ``f``'s means are
    centred to full precision (:func:`kalmanscan.smooth` passes them so, with ``mean_param`` 0) the
    result and its gradient keep it through any number of steps without process noise, where
    ``J = 1 / a`` compounds (the textbook difference ``mu_s_{t+1} - pred_mu_{t+1}`` lost it).
    The variance is scanned as the ratio ``rho_t = var_s_t / var_t = k_t + c_t g_{t+1} rho_{t+1}``
    (``rho_{T-1} = 1``, ``g_{t+1} = var_{t+1} / pred_var_{t+1}``; :func:`rts_gains`), which is
    the textbook ``var_s_t = var_t + J_t^2 (var_s_{t+1} - pred_var_{t+1})`` rearranged: its gains
    and offsets lie in ``[0, 1]``, so the scan neither cancels nor leaves the range (``J^2`` is
    ``1 / a^2`` without process noise), and ``var_s = var rho`` is exact where the predicted
    variance is subnormal or 0. There ``g`` is 1: its exact value ``1 / (1 + h^2 pred_var /
    obs_var)`` is 1 to within ``h^2 pred_var / obs_var`` (below the dtype's resolution unless
    ``obs_var`` is itself near the bottom of the range), where the quotient of two subnormals
    would have lost digits."""
    mu, J, bm, _ = gain_terms(f, mean_param)
    last = (torch.zeros_like(mu[..., -1:, :]), mu[..., -1:, :])
    elems = (torch.cat([J, last[0]], -2), torch.cat([bm, last[1]], -2))
    _, mu_s = associative_scan(mobius.affine_compose, elems, dim=-2, reverse=True)
    var, pred_var = f["var"], f["pred_var"][..., 1:, :]
    _, k, c = rts_gains(f["decay"][..., 1:, :], f["noise"][..., 1:, :], var[..., :-1, :], pred_var)
    normal = pred_var >= torch.finfo(pred_var.dtype).tiny
    g = torch.where(normal, quotient(var[..., 1:, :], torch.where(normal, pred_var, torch.ones_like(pred_var))), 1.0)
    elems = (torch.cat([c * g, last[0]], -2), torch.cat([k, torch.ones_like(last[0])], -2))
    _, rho = associative_scan(mobius.affine_compose, elems, dim=-2, reverse=True)
    var_s = var * rho
    return mu_s + mean_param, var_s, reciprocal(var_s)


def summary(p: Problem, *, chunk_elements: int = merged.CHUNK_ELEMENTS) -> tuple[torch.Tensor, ...]:
    """The merged-form product of every step of ``p`` with no transition at step 0
    (:mod:`kalmanscan.model.merged`: 7 tensors ``(..., 1, C)``), in chunks of ``chunk_elements``
    step-channels (bounded memory), differentiable (each chunk recomputed in the backward).
    :mod:`kalmanscan.distributed` exchanges it."""
    shape = p.shape

    def steps(i, y, theta, sigma, dt, obs_var, mean, h):
        decay, noise = ou.discretize(theta, sigma, dt)
        missing = torch.isnan(y)
        r = 1.0 / obs_var
        phi = torch.where(missing, torch.zeros_like(y), h * h * r)
        b = torch.where(missing, torch.zeros_like(y), h * r * (torch.where(missing, torch.zeros_like(y), y) - h * mean))
        a, q = decay.expand(phi.shape), noise.expand(phi.shape)
        if i == 0:
            a, q = first_step_identity(a, 1.0), first_step_identity(q, 0.0)
        return merged.leaf(a, q, phi, b)

    sliced = tuple(getattr(p, k) for k in ("y", "theta", "sigma", "dt", "obs_var", "mean", "h"))
    total = merged.chunked_total(steps, sliced, -2, math.prod(shape[:-2]) * shape[-1],
                                 chunk_elements=chunk_elements)
    return tuple(x.expand(shape[:-2] + (1, shape[-1])) for x in total)
