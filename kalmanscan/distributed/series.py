"""Sequence-parallel ``filter`` and ``smooth``: one long series split along time across ranks.

Rank ``r`` of ``group`` holds the contiguous stretch ``r`` of the series (rank order is time
order). The filter:

1. each rank summarises its stretch by the product of its steps in the merged homogeneous form
   (:mod:`kalmanscan.model.merged`: 7 numbers per channel, carry-independent; rank 0's
   first step has no transition and its summary includes the initial belief);
2. one ``all_gather`` of the summaries;
3. each rank composes the summaries of the ranks before it (an exclusive prefix) into its incoming
   state ``(lam, eta)``, the filtered belief at the previous rank's last step;
4. each rank filters its stretch from that carry: the carry predicted over the rank's first
   transition, ``N(mean_0 + a_0 mu, a_0^2 / lam + q_0)``, is exactly the belief at its first
   observation before it is seen, so it becomes the stretch's ``init_mean``/``init_var`` and any
   backend (``torch``, or ``triton`` on CUDA) runs the stretch unchanged.

The smoother runs the RTS recursion (:mod:`kalmanscan.inference.smoothing`) backwards. Rank ``r >= 1`` knows
the filtered belief at rank ``r - 1``'s last step (its carry), so it can form the RTS link from
its first step back to that step; it summarises the affine maps of its stretch plus that link
(mean: ``(F, B)``, variance: ``(F, B)``: 4 numbers per channel; the last rank's map is constant,
it starts from its filtered last step). A second ``all_gather`` and an exclusive suffix give
each rank the smoothed moments of its own last step, then a local reverse scan.

Both are differentiable: see :mod:`kalmanscan.distributed.comm` for the backward exchange.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING


import torch
import torch.distributed as dist


from kalmanscan.inference.filtering import make_posterior
from kalmanscan.problem.prepare import prepare
from kalmanscan.ops.filter import resolve_backend, run_backend
from kalmanscan.ops.filter.torch import smooth as rts_torch
from kalmanscan.inference import stretches
from kalmanscan.distributed import summaries
from kalmanscan.distributed.comm import agree, all_gather, fingerprint, rank_world, tie
from kalmanscan.types import ArrayLike

if TYPE_CHECKING:
    from kalmanscan.inference.posterior import Posterior



__all__ = ["filter", "smooth"]

_INPUTS = ("y", "theta", "sigma", "obs_var", "mean", "h", "dt", "init_mean", "init_var")


def filter(y_local: ArrayLike, *, theta: ArrayLike, sigma: ArrayLike, obs_var: ArrayLike, mean: ArrayLike = 0.0,
           h: ArrayLike = 1.0, dt: ArrayLike = 1.0, times: ArrayLike | None = None,
           init_mean: ArrayLike | None = None, init_var: ArrayLike | None = None,
           group: dist.ProcessGroup | None = None, backend: str = "auto") -> Posterior:
    """Filter one series split along time across the ranks of ``group``; a collective call.

    Args:
        y_local: this rank's stretch ``(..., T_local, C)`` (``T_local >= 1``; may differ between
            ranks; the batch shape ``(..., C)`` must be the same on every rank). NaN = missing.
        theta, sigma, obs_var, mean, h, dt: as :func:`kalmanscan.filter`, static or per step for
            the local stretch. A per-step value at local index 0 governs the transition into this
            rank's first step from the previous rank's last step (on rank 0 it has none).
        times: this rank's observation times ``(T_local,)`` or ``(..., T_local, 1)``; given on
            every rank or on none. The step into a rank's first observation is its first time
            minus the previous rank's last time (exchanged; must be positive).
        init_mean, init_var: the belief at the series' first observation; read on rank 0 only
            (other ranks may omit them, also when ``theta = 0``). ``init_var`` must be finite:
            a diffuse prior raises ``ValueError`` (filter such a series in one process).
        group: a ``torch.distributed`` process group (default: the world).
        backend: the local pass's backend: ``"auto"`` (triton on CUDA, else torch),
            ``"torch"`` or ``"triton"``.

    Returns this rank's :class:`~kalmanscan.Posterior` for its stretch: equal, to rounding, to
    the same rows of :func:`kalmanscan.filter` on the concatenated series (``loglik`` sums this
    rank's steps; sum it over ranks for the series' log-likelihood). On ranks ``r >= 1``,
    ``params["init_mean"]``/``["init_var"]`` hold the predicted belief at the rank's first step,
    and ``params["times"]`` is local (from 0) when ``times`` is not given.

    Communication per call: one ``all_gather`` of ``7 n`` numbers per rank (``n`` the number of
    channels times the batch size) plus one of 6 float64 (input agreement), and one of ``2 n_t``
    (first and last time) when ``times`` is given; the backward adds one ``all_reduce`` of
    ``7 n world`` numbers. Every rank must run backward through its outputs when any does.
    """
    p, out, _, _ = _filter(y_local, dict(theta=theta, sigma=sigma, obs_var=obs_var, mean=mean,
                                         h=h, dt=dt, times=times, init_mean=init_mean,
                                         init_var=init_var), group, backend)
    return make_posterior(p, out)


def smooth(y_local: ArrayLike, *, theta: ArrayLike, sigma: ArrayLike, obs_var: ArrayLike, mean: ArrayLike = 0.0,
           h: ArrayLike = 1.0, dt: ArrayLike = 1.0, times: ArrayLike | None = None,
           init_mean: ArrayLike | None = None, init_var: ArrayLike | None = None,
           group: dist.ProcessGroup | None = None, backend: str = "auto") -> Posterior:
    """RTS-smooth one series split along time across ranks; arguments as :func:`filter`.

    Returns this rank's smoothed :class:`~kalmanscan.Posterior` (``filtered`` holds its filter
    posterior), equal to rounding to the same rows of :func:`kalmanscan.smooth` on the whole
    series. Communication: :func:`filter`'s, plus one ``all_gather`` of ``4 n`` numbers per rank
    (and one ``all_reduce`` of ``4 n world`` in the backward).
    """
    kw = dict(theta=theta, sigma=sigma, obs_var=obs_var, mean=mean, h=h, dt=dt, times=times,
              init_mean=init_mean, init_var=init_var)
    p, out, carry, gathered = _filter(y_local, kw, group, backend)
    rank, world = rank_world(group)
    shape = p.shape
    f = {k: torch.broadcast_to(out[k], shape) for k in ("mean", "var", "pred_mean", "pred_var", "decay", "noise")}
    f["decay"] = f["decay"].to(p.dtype)
    mean_param = torch.broadcast_to(p.mean, shape)

    local = stretches.rts_link(f, mean_param, carry, last=rank == world - 1)
    if gathered.requires_grad:
        local = local if local.requires_grad else local.detach().requires_grad_()
        local = tie(gathered, {"s": local})["s"]
    suffix = all_gather(local, group)
    if rank < world - 1:
        s_mean, s_var = suffix[world - 1, 1], suffix[world - 1, 3]
        for j in range(world - 2, rank, -1):
            s_mean = suffix[j, 0] * s_mean + suffix[j, 1]
            s_var = suffix[j, 2] * s_var + suffix[j, 3]
        f = dict(f, mean=torch.cat([f["mean"][..., :-1, :], s_mean + mean_param[..., -1:, :]], -2),
                 var=torch.cat([f["var"][..., :-1, :], s_var], -2))
    mean_s, var_s, precision_s = rts_torch(f, mean_param)
    smoothed = dict(out, mean=mean_s, var=var_s, precision=precision_s)
    if suffix.requires_grad:
        smoothed = tie(suffix, smoothed)
    return make_posterior(p, smoothed, filtered=make_posterior(p, out))


def _filter(y, kw, group, backend):
    """Prepare, agree, exchange the summaries and run the local pass.

    Returns ``(problem, outputs, carry, gathered)``: ``carry`` is ``(var, mu)`` entering this
    rank (``None`` on rank 0), ``gathered`` the stacked summaries ``(world, 7, ..., 1, C)``.
    """
    rank, world = rank_world(group)
    device = y.device if isinstance(y, torch.Tensor) else torch.device("cpu")

    def check():
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
        args = dict(kw)
        if rank > 0 and args["init_var"] is None:
            args["init_var"] = 1.0
        p = prepare(y, backend=backend, **args)
        if rank == 0 and p.diffuse:
            raise ValueError("init_var: ks.distributed does not take a diffuse prior (init_var = inf); "
                             "give a finite init_var, or filter the series in one process with ks.filter")
        if _uses_kernels(p, backend):
            from kalmanscan.ops.filter.triton.backend import check_device

            check_device(p.y)  # checked before any exchange
        return p

    def info(p):
        grad = torch.is_grad_enabled() and any(
            isinstance(getattr(p, k), torch.Tensor) and getattr(p, k).requires_grad for k in _INPUTS)
        n_times = 0 if p.times is None else p.times[..., :1, :].numel()
        return [grad, p.times is not None, n_times, fingerprint(p.shape[:-2], p.shape[-1]), fingerprint(p.dtype)]

    p, infos = agree(check, info, 5, device, group)
    for col, what in ((1, "times must be given on every rank or on none"),
                      (2, "times must have the same batch shape on every rank"),
                      (3, "y and the parameters must broadcast to the same (..., C) on every rank"),
                      (4, "y and the parameters must have the same dtype on every rank")):
        if not bool((infos[:, col] == infos[0, col]).all()):
            raise ValueError(what)
    if p.times is not None:
        p = _boundary_dt(p, rank, group)

    if rank == world - 1:
        local = torch.zeros((7,) + p.shape[:-2] + (1, p.shape[-1]), dtype=p.dtype, device=device)
    else:
        fused = not bool(infos[:, 0].any()) and _uses_kernels(p, backend)
        local = torch.stack(stretches.summary(p, first=rank == 0, backend="triton" if fused else "torch"))
    if bool(infos[:, 0].any()) and not local.requires_grad:
        local = local.detach().requires_grad_()
    gathered = all_gather(local, group)
    carry = None
    if rank > 0:
        carry = summaries.incoming_moments(gathered, rank)
        p = _continue_from(p, carry)
    out = run_backend(p, backend)
    if gathered.requires_grad:
        out = tie(gathered, out)
    return p, out, carry, gathered


def _boundary_dt(p, rank, group):
    """Replace the step into this rank's first observation by its first time minus the previous
    rank's last time (one ``all_gather`` of first and last times; checked on every rank)."""
    ends = torch.cat([p.times[..., :1, :], p.times[..., -1:, :]], -2).detach()
    with torch.no_grad():
        gathered = all_gather(ends, group)
    if not bool((gathered[1:, ..., 0, :] > gathered[:-1, ..., 1, :]).all()):
        raise ValueError("times must be strictly increasing across ranks (rank order = time order)")
    if rank == 0:
        return p
    first = (p.times[..., :1, :] - gathered[rank - 1, ..., 1:, :]).to(p.dtype)
    return dataclasses.replace(p, dt=torch.cat([first, p.dt[..., 1:, :]], -2), no_noise=None)


def _continue_from(p, carry):
    """``p`` with its initial belief replaced by ``carry = (var, mu)`` (the filtered variance and
    centred mean at the previous step) predicted over ``p``'s first transition. A predicted
    variance that underflowed to 0 (no process noise) becomes the smallest normal number."""
    var, mu = carry
    decay, noise = (x[..., :1, :] for x in p.decay_noise())
    init_var = torch.clamp_min(decay * decay * var + noise, torch.finfo(var.dtype).tiny)
    return dataclasses.replace(p, init_mean=p.mean[..., :1, :] + decay * mu, init_var=init_var)


def _uses_kernels(p, backend) -> bool:
    return resolve_backend(backend, p.y.device) == "triton"
