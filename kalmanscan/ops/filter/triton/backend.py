"""The ``"triton"`` backend of :func:`kalmanscan.filter` and :func:`kalmanscan.smooth`: launch
wrappers; autograd through the custom operators of :mod:`kalmanscan.ops.filter.triton.library`. Launch
options come from a :class:`~kalmanscan.ops.filter.triton.config.FilterConfig`.

Forward (:mod:`kalmanscan.kernels.filter.fwd`): every (stretch of time, channel) lane walks its stretch
sequentially, building each step's decay, noise and observation terms in registers from ``y`` and
the parameters (static or per step, read through their strides: no leaf tensor is written). Long
series are split into ``NS`` stretches across programs through the merged homogeneous form
(aggregate, carry, apply); :func:`plan` picks ``NS`` from the shape. Backward
(:mod:`kalmanscan.kernels.filter.bwd`): the same lanes walk backwards with the scalar adjoints, reading the
forward's filtered mean and precision back as the per-step state; gradients for ``y``, ``theta``,
``sigma``, ``dt``, ``obs_var``, ``mean``, ``h`` and the initial state. Static parameters get
per-lane sums inside the kernel; the last step from ``(decay, noise, phi, info)`` adjoints to the
user's parameters is the derivative of :func:`kalmanscan.model.ou.discretize` and of
``phi = h^2 / obs_var``, ``info = (h / obs_var)(y - h mean)``, taken by torch autograd on
``(..., 1 or T, C)`` tensors. With ``tile_bwd`` on (the default), few long series (the forward's tile regime,
:func:`uses_tiles`) run backwards time-parallel too (:mod:`kalmanscan.kernels.filter.tiles_bwd`).

Arithmetic is in the compute dtype of the problem: float32 (half-precision inputs are promoted by
:mod:`kalmanscan.problem.prepare`), or float64 for float64 inputs. Runs on CUDA tensors, or on the CPU under
``TRITON_INTERPRET=1`` (the tests). Index arithmetic is 32-bit while ``4 B T C`` (more than the largest
array a walking kernel indexes, the backward's ``(3, B, T, C)`` per-step observation adjoints) is
below ``FilterConfig.wide_from = 2^31``, 64-bit from there on.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable


import torch

from kalmanscan.kernels.filter.bwd import filter_bwd_carry_kernel
from kalmanscan.kernels.filter.fwd import (filter_agg_kernel, filter_total_kernel)
from kalmanscan.kernels.filter.rts import rts_agg_kernel, rts_kernel
from kalmanscan.kernels.filter.stream import stream_step_kernel

from kalmanscan.problem import checks
from kalmanscan.problem.problem import Problem
from kalmanscan.ops.launch import cdiv, next_power_of_2
from kalmanscan.ops.filter.triton import replay
from kalmanscan.ops.filter import torch as torch_backend
from kalmanscan.ops.filter.triton.config import DEFAULT_CONFIG, FilterConfig
from kalmanscan.ops.filter.triton.library import filter_fused, filter_posterior
from kalmanscan.ops.filter.triton.walks import (OBS, ORDER, POSTERIOR, TRANS, agg_opts, check_device, filter_backward,
                                                filter_forward, flat, fwd_opts, kernel_args, kernel_views, launch,
                                                plan, posterior_mask, replayed, step_flags, tile_plan, time_varying,
                                                uses_tiles)

__all__ = ["filter", "smooth", "summary", "filter_forward", "filter_backward", "plan", "tile_plan", "uses_tiles",
           "replayed", "flat", "kernel_views", "check_device", "step_flags", "initial_state",
           "stream_step", "FilterConfig", "DEFAULT_CONFIG", "POSTERIOR", "posterior_mask", "SUMS_LOGLIK"]


def filter(p: Problem, config: FilterConfig = DEFAULT_CONFIG) -> dict:
    """Filter the validated problem ``p`` with the fused kernels; the contract of every backend's
    ``filter`` (:mod:`kalmanscan.ops.filter`).

    Differentiable with respect to ``y``, every parameter and the initial belief. When nothing
    needs a gradient, one kernel pass writes every field of the result (no torch passes after it).
    ``"loglik"`` among ``p.outputs`` adds the log-likelihood summed over time, ``(..., C)``, in
    ``y``'s dtype (accumulated in float64); without ``"logliks"`` the kernels write no per-step
    terms for it (:data:`SUMS_LOGLIK`).
    A problem with no process noise where ``decay < 1`` (``sigma = 0``, or a noise below
    :data:`kalmanscan.model.mobius.NO_NOISE`) runs on the torch backend instead: its precision grows like
    ``decay^(-2t)``, past the range of the kernels, which carry it (see :mod:`kalmanscan.model.mobius`).
    ``config`` sets the launch (:class:`FilterConfig`). With ``p.y_check``, for a ``y`` of more
    than :attr:`kalmanscan.tuning.Tuning.y_by_result` elements, ``"y_check"``: ``y``'s inf check queued with
    the kernels (:func:`filter_forward`, or :func:`kalmanscan.problem.checks.queue_y_sum` before them).
    """
    shape = p.shape
    check_device(p.y)
    if p.no_process_noise():
        return torch_backend.filter(p)
    init = initial_state(p)
    inputs = (p.y, p.theta, p.sigma, p.dt, p.obs_var, p.mean, p.h)

    y_check = p.y_check and checks.queued_with_kernels(p.y)
    if not (torch.is_grad_enabled() and any(x.requires_grad for x in inputs + (init,))):
        fields = POSTERIOR if p.outputs is None else tuple(k for k in (*POSTERIOR, "loglik") if k in p.outputs)
        # decay and noise only when no outputs are named (the package's contract): with parameters
        # per step they are y-sized arrays that a call naming its outputs does not read
        transition = {} if p.outputs is not None else dict(zip(("decay", "noise"), p.decay_noise()))
        if torch.compiler.is_compiling():  # one opaque operator for the compiler (library module docstring)
            values = filter_posterior(*inputs, init, list(shape), config.as_ints(), posterior_mask(fields))
            return {**dict(zip(fields, values)), **transition}
        views = {k: flat(x, shape) for k, x in zip(ORDER, inputs)}
        run = functools.partial(filter_forward, config=config, posterior=fields, out_shape=shape, one_block=True)
        out, queued = None, None
        small = replayed(shape, fields, config)
        if small:  # its launches are the host's time: replayed, y's check queued before them
            queued = checks.queue_y_sum(p.y) if y_check else None
            out = replay.forward(run, views, init, (fields, config, tuple(shape)))
        if out is None:
            out = run(views, init, y_check=y_check and not small)
        if queued is not None:
            out["y_check"] = queued
        if "loglik" in out:
            out["loglik"] = out["loglik"].reshape(shape[:-2] + shape[-1:])
        return {**out, **transition}

    decay, noise = p.decay_noise()
    queued = checks.queue_y_sum(p.y) if y_check else None
    mu_c, lam, pred_mu_c, pred_var = filter_fused(*inputs, init, list(shape), config.as_ints())
    missing = torch.isnan(p.y)
    out = torch_backend.finish(p, *(x.reshape(shape) for x in (mu_c, lam, pred_mu_c, pred_var)), missing, decay, noise)
    return out if queued is None else {**out, "y_check": queued}


SUMS_LOGLIK = True
"""``"loglik"`` among the outputs without ``"logliks"``: the kernels sum each series'
log-likelihood (float64) and write no per-step terms for it (:func:`kalmanscan.filter` asks for it
so: a default call writes the filtered mean and variance alone)."""


def initial_state(p: Problem) -> torch.Tensor:
    """``init`` of the kernels, ``(B, 2, C)`` contiguous: the initial precision and information
    mean of every series (:meth:`kalmanscan.problem.problem.Problem.initial_info`)."""
    shape = p.shape
    B, C = math.prod(shape[:-2]), shape[-1]
    lam0, eta0 = p.initial_info()
    if B == 1 and lam0.shape == eta0.shape == (1, C):
        if _side_by_side(lam0, eta0):  # the host's derived rows, copied together: a view of them
            return lam0.as_strided((1, 2, C), (2 * C, C, 1))
        return torch.cat([lam0, eta0]).view(1, 2, C)
    bshape = shape[:-2] + (1, C)
    return torch.stack([x.expand(bshape).reshape(B, C) for x in (lam0, eta0)], 1)


def _side_by_side(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether contiguous ``b`` follows contiguous ``a`` in the same memory (neither needing a
    gradient): then ``(a, b)`` stacked is a view."""
    return (a.is_contiguous() and b.is_contiguous() and not (a.requires_grad or b.requires_grad)
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and b.storage_offset() == a.storage_offset() + a.numel())


def smooth(f: dict[str, torch.Tensor], mean_param: torch.Tensor,
           config: FilterConfig = DEFAULT_CONFIG) -> tuple[torch.Tensor, ...]:
    """Smoothed ``(mean, var, precision)``, each ``(..., T, C)``, from the filter's tensors ``f``
    (``mean, var, pred_mean, pred_var, decay, noise``, broadcastable to ``(..., T, C)``) and the
    model's mean parameter: the reverse walks of :mod:`kalmanscan.kernels.filter.rts`; the
    contract of every backend's ``smooth``. Stretches, lanes and launch options are the filter's
    (:func:`plan`); the carry between stretches is the filter backward's reverse scan of
    five-number affine maps. Without gradients only: when any input needs one, the torch
    backend's differentiable reverse scans run instead."""
    if torch.is_grad_enabled() and any(x.requires_grad for x in (*f.values(), mean_param)):
        return torch_backend.smooth(f, mean_param)
    shape = tuple(f["mean"].shape)
    fields = (f["mean"], f["var"], f["pred_mean"], f["pred_var"], f["decay"], f["noise"], mean_param)
    views = [flat(x, shape) for x in fields]
    B, T, C = math.prod(shape[:-2]), shape[-2], shape[-1]
    dtype, dev = views[0].dtype, views[0].device
    ns, L = plan(B, T, C, config)
    grid, opts = launch(B, T, C, ns, config)
    args = [a for x in views for a in (x, *x.stride())]
    top = torch.zeros(B, 2, ns, C, dtype=dtype, device=dev)
    if ns > 1:
        agg = torch.empty(B, 5, ns, C, dtype=dtype, device=dev)
        rts_agg_kernel[grid](*args, agg, T, C, ns, L, **opts)
        filter_bwd_carry_kernel[(B * C,)](agg, top, C, ns, CH=min(config.carry_chunk, next_power_of_2(ns - 1)),
                                          num_warps=config.carry_warps)
    out = [torch.empty(B, T, C, dtype=dtype, device=dev) for _ in range(3)]
    rts_kernel[grid](*args, top, *out, T, C, ns, L, **opts)
    return tuple(x.reshape(shape) for x in out)


def summary(p: Problem, config: FilterConfig = DEFAULT_CONFIG) -> tuple[torch.Tensor, ...]:
    """The merged-form product of every step of ``p`` with no transition at step 0
    (:mod:`kalmanscan.model.merged`: 7 tensors ``(..., 1, C)``), without gradient: the aggregate kernel's
    per-(stretch, channel) products (one pass over the inputs) composed by a kernel per series
    (trace-normalised, not by powers of two). :mod:`kalmanscan.distributed` exchanges it."""
    shape = p.shape
    B, T, C = math.prod(shape[:-2]), shape[-2], shape[-1]
    views = kernel_views(p)
    ns, stretch = plan(B, T, C, config)
    agg = torch.empty(B, 7, ns, C, dtype=p.dtype, device=p.y.device)
    grid, opts = launch(B, T, C, ns, config)
    opts.update(fwd_opts(config), **agg_opts(config, opts["BLOCK"]))
    filter_agg_kernel[grid](*kernel_args(views), agg, T, C, ns, stretch, TRANS_STEP=time_varying(views, TRANS),
                            OBS_STEP=time_varying(views, OBS), **opts)
    total = torch.empty(B, 7, C, dtype=p.dtype, device=p.y.device)
    filter_total_kernel[(B * C,)](agg, total, C, ns, CH=min(config.carry_chunk, next_power_of_2(ns)),
                                  num_warps=config.carry_warps)
    return tuple(x.reshape(shape[:-2] + (1, C)) for x in total.unbind(1))


def stream_step(y: torch.Tensor, belief: torch.Tensor, rows: torch.Tensor,
                fields: Iterable[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of ``N`` streamed series (:mod:`kalmanscan.kernels.filter.stream`): ``y`` holds
    ``N`` values (any shape), ``belief`` ``(2, ...)`` their filtered mean and variance (``N``
    each), ``rows`` ``(5, N)`` their ``decay, noise, obs_var, mean, h``. Returns ``(out,
    new_belief)``: ``out`` ``(10, N)`` with the rows of :data:`POSTERIOR` named in ``fields``
    written, ``new_belief`` ``(2, N)``. Nothing given is written."""
    check_device(y)
    N = rows.shape[1]
    like = dict(dtype=rows.dtype, device=rows.device)
    out, new_belief = torch.empty(10, N, **like), torch.empty(2, N, **like)
    block = min(1024, next_power_of_2(N))
    stream_step_kernel[(cdiv(N, block),)](y.contiguous(), belief.contiguous(), new_belief, rows, out, N,
                                          POSTERIOR=posterior_mask(fields), BLOCK=block, num_warps=4)
    return out, new_belief
