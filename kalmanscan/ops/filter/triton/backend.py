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
import os
from collections.abc import Iterable, Sequence
from typing import Any


import torch

from kalmanscan.kernels.filter.bwd import filter_bwd_agg_kernel, filter_bwd_carry_kernel, filter_bwd_kernel
from kalmanscan.kernels.filter.fwd import (filter_agg_kernel, filter_carry_kernel, filter_fwd_kernel,
                                           filter_total_kernel)
from kalmanscan.kernels.filter.rts import rts_agg_kernel, rts_kernel
from kalmanscan.kernels.filter.stream import stream_step_kernel
from kalmanscan.kernels.filter.tiles import filter_tile_agg_kernel, filter_tile_fwd_kernel
from kalmanscan.kernels.filter.tiles_bwd import filter_tile_bwd_agg_kernel, filter_tile_bwd_kernel

from kalmanscan.problem import checks
from kalmanscan.problem.prepare import Problem
from kalmanscan.ops.launch import cdiv, next_power_of_2
from kalmanscan.ops.filter.triton import replay
from kalmanscan.ops.filter import torch as torch_backend
from kalmanscan.ops.filter.triton.config import DEFAULT_CONFIG, FilterConfig

__all__ = ["filter", "smooth", "summary", "filter_forward", "filter_backward", "plan", "tile_plan", "uses_tiles",
           "replayed", "flat", "kernel_views", "check_device", "step_flags", "initial_state",
           "stream_step", "FilterConfig", "DEFAULT_CONFIG"]

_TRANS = ("theta", "sigma", "dt")
_OBS = ("obs_var", "mean", "h")
_ORDER = ("y",) + _TRANS + _OBS
_RTS_FIELDS = ("mean", "var", "pred_mean", "pred_var", "decay", "noise")


def plan(B: int, T: int, C: int, config: FilterConfig = DEFAULT_CONFIG) -> tuple[int, int]:
    """``(NS, L)``: number of stretches and steps per stretch for a ``(B, T, C)`` problem.

    By default enough stretches for about ``config.target_lanes`` lanes, each at least
    ``config.min_stretch`` steps long, at most ``config.max_stretches`` of them, and one stretch
    where that gives fewer than ``config.min_stretches``; ``config.stretch`` forces ``L``.
    """
    stretch = config.stretch
    if stretch is None:
        ns = max(1, min(cdiv(config.target_lanes, B * C), T // config.min_stretch, config.max_stretches))
        if ns < config.min_stretches:
            ns = 1
        stretch = cdiv(T, ns)
    stretch = max(1, min(int(stretch), T))
    return cdiv(T, stretch), stretch


def flat(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``x`` (``(..., 1 or T, C or 1)``) broadcast to ``shape`` and viewed as ``(B, T, C)``."""
    B = math.prod(shape[:-2])
    if x.ndim <= 2:  # no batch dimensions: one expand (a view)
        return x.expand(B, shape[-2], shape[-1])
    return torch.broadcast_to(x, shape).reshape(B, shape[-2], shape[-1])


def tile_plan(T: int, config: FilterConfig = DEFAULT_CONFIG) -> tuple[int, int]:
    """``(NS, R)`` of the time-parallel forward: ``NS`` stretches of ``R`` tiles of
    ``config.tile`` steps, ``NS <= config.tile_stretches``."""
    tiles = cdiv(T, config.tile)
    r = cdiv(tiles, min(tiles, config.tile_stretches))
    return cdiv(tiles, r), r


def uses_tiles(T: int, C: int, config: FilterConfig = DEFAULT_CONFIG) -> bool:
    """Whether the forward runs time-parallel (lanes along time): few channels, at least a tile of
    steps, and no stretch length forced."""
    return config.stretch is None and C <= config.tile_max_c and T >= config.tile


def kernel_views(p: Problem) -> dict:
    """The inputs of ``p`` in kernel order as ``(B, T, C)`` broadcast views (detached)."""
    return {k: flat(getattr(p, k).detach(), p.shape) for k in _ORDER}


def _kernel_args(views):
    """Pointer and ``(batch, time, channel)`` strides of each input, in kernel order."""
    return [a for name in _ORDER for a in (views[name], *views[name].stride())]


def _steps(views, names):
    """Whether any of ``names`` varies along time (its time stride is non-zero)."""
    return any(views[n].stride(1) != 0 and views[n].shape[1] > 1 for n in names)


def step_flags(views: dict[str, torch.Tensor]) -> tuple[bool, bool]:
    """``(trans_step, obs_step)``: whether any of ``theta, sigma, dt`` / ``obs_var, mean, h`` in the
    ``(B, T, C)`` views varies along time (the kernels' ``TRANS_STEP``/``OBS_STEP``)."""
    return _steps(views, _TRANS), _steps(views, _OBS)


def launch(B: int, T: int, C: int, ns: int,
           config: FilterConfig = DEFAULT_CONFIG) -> tuple[tuple[int, int], dict[str, Any]]:
    """Grid and launch options of the walking kernels (``WIDE``: 64-bit offsets); the forward
    ones add :func:`fwd_opts`, the backward ones ``UNROLL=config.bwd_unroll``."""
    block = min(config.small_c_block if C < 32 else config.block, next_power_of_2(ns * C))
    opts = dict(BLOCK=block, num_warps=config.num_warps, WIDE=4 * B * T * C >= config.wide_from)
    if config.num_stages is not None:
        opts["num_stages"] = config.num_stages
    return (cdiv(ns * C, block), B), opts


def fwd_opts(config: FilterConfig = DEFAULT_CONFIG, posterior: bool = False) -> dict:
    """Constexpr options of the forward walks."""
    return dict(UNROLL=config.unroll, PREFETCH=config.posterior_prefetch if posterior else config.prefetch)


def agg_opts(config: FilterConfig, block: int) -> dict:
    """The aggregate pass's options over the walks' (``block`` lanes a program): closed form, chunk, warps."""
    return dict(CLOSED=config.walk_closed, CHUNK=config.closed_chunk,
                num_warps=max(1, min(config.agg_warps, block // 32)))


def check_device(y: torch.Tensor) -> None:
    """``ValueError`` unless ``y`` is on CUDA (or ``TRITON_INTERPRET=1`` runs the kernels on the CPU)."""
    if y.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU); "
                         f"y is on {y.device}")


POSTERIOR = ("mean", "precision", "pred_mean", "pred_var", "var", "pred_precision", "pred_obs_mean",
             "pred_obs_var", "logliks", "missing")  # in the kernel's pointer order


def filter_forward(views: Sequence[torch.Tensor], init: Sequence[torch.Tensor],
                   outputs: Sequence[str] = ("mu", "lam", "pred_mu", "pred_var"),
                   config: FilterConfig = DEFAULT_CONFIG,
                   posterior: Sequence[str] | bool = False,
                   out_shape: Sequence[int] | None = None, loglik_sum: bool = True,
                   one_block: bool = False, y_check: bool = False) -> dict[str, torch.Tensor]:
    """Launch the fused forward on ``(B, T, C)`` views; returns ``{name: (B, T, C) tensor}``
    (allocated as ``out_shape`` instead when given: any shape of ``B T C`` elements).

    ``views`` maps ``y, theta, sigma, dt, obs_var, mean, h`` to ``(B, T, C)`` tensors (broadcast
    views are fine); ``init`` is ``(B, 2, C)``: initial precision and information mean ``lam0,
    eta0 = lam0 (init_mean - mean_0)``. Only the named centred outputs are written; with
    ``posterior`` (``True``: all, or a collection of names) the fields of :data:`POSTERIOR`
    instead (those of :func:`kalmanscan.ops.filter.torch.finish`, in one pass), only those named.
    With ``"logliks"`` among them and ``loglik_sum`` the walks also return ``"loglik"``, the sum
    over time ``(B, C)``: each stretch's sum accumulated in float64 by the kernel, the stretches
    summed after it, in ``y``'s dtype (the tiles leave it out). ``one_block``: small outputs may
    share one allocation (:func:`_outputs`; not for an operator's returns, which must not alias).
    ``y_check``: also ``"y_check"``, ``y``'s inf check queued with the kernels
    (:class:`kalmanscan.problem.checks.Ahead`): with stretches, the sum of the stretch products' ``e1, e2``
    read after the aggregate pass (an ``inf`` in ``y`` leaves its stretch's ``e1`` or ``e2`` inf or
    NaN: ``info = h (y - h mean) / obs_var`` enters both, scaled by finite non-negative numbers, and
    nothing in a product makes a non-finite number finite again); else ``nansum(y)`` queued before
    them.
    """
    if posterior is True:
        posterior = POSTERIOR
    posterior = tuple(k for k in POSTERIOR if k in posterior) if posterior else ()
    y = views["y"]
    B, T, C = y.shape
    tiles = uses_tiles(T, C, config)
    if tiles:
        ns, r = tile_plan(T, config)
        grid = (ns, B * C)
        opts = dict(TILE=config.tile, ROW=config.tile_row, num_warps=config.tile_warps,
                    WIDE=B * T * C >= config.wide_from, CLOSED=config.tile_closed and ns > 1)
        agg_kernel, fwd_kernel = filter_tile_agg_kernel, filter_tile_fwd_kernel
    else:
        ns, r = plan(B, T, C, config)
        grid, opts = launch(B, T, C, ns, config)
        opts.update(fwd_opts(config, posterior))
        agg_kernel, fwd_kernel = filter_agg_kernel, filter_fwd_kernel
    more = {} if tiles else agg_opts(config, opts["BLOCK"])
    dtype, dev = y.dtype, y.device
    args = _kernel_args(views)
    flags = dict(TRANS_STEP=_steps(views, _TRANS), OBS_STEP=_steps(views, _OBS))
    mask = posterior_mask(posterior)
    sum_loglik = loglik_sum and "logliks" in posterior and fwd_kernel is filter_fwd_kernel
    # the aggregate kernel is launched before the outputs are allocated: the device starts sooner
    init = init.contiguous()
    from_agg = y_check and ns > 1 and agg_kernel is filter_agg_kernel
    queued = checks.queue_y_sum(y) if y_check and not from_agg else None
    start = init  # one stretch: the walks start from init itself; else the carry writes every start
    fast = ()  # the tiles' closed-form flags (one per stretch), passed after agg and after start
    if tiles:
        fast = (torch.empty(B * C, ns, dtype=torch.int32, device=dev) if opts["CLOSED"] else init,)
    if ns > 1:
        start = torch.empty(B, 2, ns, C, dtype=dtype, device=dev)
        agg = torch.empty(B, 7, ns, C, dtype=dtype, device=dev)
        agg_kernel[grid](*args, agg, *fast, T, C, ns, r, **flags, **{**opts, **more})
        if from_agg:  # read while the carry and the outputs' walks run
            queued = checks.Ahead(torch.sum(agg[:, 4:6], dtype=torch.float64))
        filter_carry_kernel[(B * C,)](agg, init, start, C, ns, CH=min(config.carry_chunk, next_power_of_2(ns - 1)),
                                      num_warps=config.carry_warps)
    out, pointers, write = _outputs(y, outputs, posterior, out_shape, one_block)
    partial = torch.empty(B, ns, C, dtype=torch.float64, device=dev) if sum_loglik else None
    if sum_loglik:
        opts.update(loglik_sum_ptr=partial, SUM_LOGLIK=True)
    fwd_kernel[grid](*args, start, *fast, *pointers, T, C, ns, r, **flags, **write, POSTERIOR=mask, **opts)
    result = {k: out[k] for k in (posterior or outputs)}
    if partial is not None:
        result["loglik"] = (partial[:, 0] if ns == 1 else partial.sum(1)).to(dtype)
    if queued is not None:
        result["y_check"] = queued
    return result


def posterior_mask(fields: Iterable[str]) -> int:
    """The kernels' ``POSTERIOR`` bit mask of ``fields`` (names of :data:`POSTERIOR`)."""
    return sum(1 << i for i, k in enumerate(POSTERIOR) if k in fields)


ONE_BLOCK_OUTPUTS = 1 << 22
REPLAY_ELEMENTS = 1 << 22


def replayed(shape: Sequence[int], fields: Sequence[str], config: FilterConfig = DEFAULT_CONFIG) -> bool:
    """Whether a forward call without gradients (its problem's ``shape`` and the ``fields`` it
    writes) goes through :mod:`kalmanscan.ops.filter.triton.replay`: its outputs fit in one block
    (:data:`ONE_BLOCK_OUTPUTS` elements), or it is a few long series (the tiles, :func:`uses_tiles`)
    of at most :data:`REPLAY_ELEMENTS` elements, whose launches take the host longer than the
    kernels take the device (at ``2^24`` steps replay gained nothing, docs/performance.md)."""
    n = math.prod(shape)
    return len(fields) * n <= ONE_BLOCK_OUTPUTS or (uses_tiles(shape[-2], shape[-1], config) and n <= REPLAY_ELEMENTS)


def _outputs(y, outputs, posterior, out_shape=None, one_block=False):
    """``(out, pointers, flags)`` of the forward kernels: the ``(B, T, C)`` output tensors, the ten
    output pointers in kernel order (``y``'s for those not written, never written through) and
    the ``WRITE_*`` flags. The predicted mean and variance are written together (one flag), so
    asking for one allocates both. With ``one_block``, fields of at most :data:`ONE_BLOCK_OUTPUTS`
    elements in all share one allocation (views of it: a small call's fixed cost; a field kept
    alone keeps the others' memory, at most that many elements)."""
    B, T, C = y.shape
    like = dict(dtype=y.dtype, device=y.device)
    names_all = POSTERIOR if posterior else ("mu", "lam", "pred_mu", "pred_var")
    wanted = set(posterior if posterior else outputs)
    if not posterior and wanted & {"pred_mu", "pred_var"}:
        wanted |= {"pred_mu", "pred_var"}
    names = [k for k in names_all if k in wanted]
    shape = tuple(out_shape or (B, T, C))
    if one_block and len(names) > 1 and len(names) * B * T * C <= ONE_BLOCK_OUTPUTS:
        out = dict(zip(names, torch.empty((len(names),) + shape, **like).unbind(0)))
    else:
        out = {k: torch.empty(shape, **like) for k in names}
    dummy = y  # the pointer of a field not written: never written through (its flag is off)
    pointers = [out.get(k, dummy) for k in names_all] + ([] if posterior else [dummy] * 6)
    return out, pointers, dict(WRITE_MU="mu" in out, WRITE_LAM="lam" in out, WRITE_PRED="pred_mu" in out)


def filter_backward(views: Sequence[torch.Tensor], init: Sequence[torch.Tensor], mu: torch.Tensor, lam: torch.Tensor,
                    cot: Sequence[torch.Tensor | None],
                    config: FilterConfig = DEFAULT_CONFIG) -> tuple[torch.Tensor, ...]:
    """Launch the backward; returns ``grad_y``, the observation and transition adjoints, init's.

    ``cot`` is a sequence of four cotangents, of ``(mu, lam, pred_mu, pred_var)``: each a
    ``(B, T, C)`` tensor or ``None`` (absent: the output was not used; a ``(4, B, T, C)`` stack is
    also a sequence of four). Absent ones are never read (the kernels' ``HAS_G_*`` flags); present
    ones are passed as they are when contiguous, else copied. With all four absent every gradient
    is zero and no kernel runs. The observation adjoints ``(d phi, d info, d info * yc)`` come as
    ``(3, B, T, C)`` when any of ``obs_var, mean, h`` is per step, else ``(3, B, 1, C)`` summed over
    time; likewise the transition adjoints ``(d decay, d noise)`` (zero at step 0). With
    ``config.tile_bwd`` on, a problem the forward runs on tiles (:func:`uses_tiles`) runs backwards on
    tiles too (:mod:`kalmanscan.kernels.filter.tiles_bwd`: ``L`` is then the tiles per stretch), else on the walks.
    """
    y = views["y"]
    B, T, C = y.shape
    dtype, dev = y.dtype, y.device
    trans_step, obs_step = _steps(views, _TRANS), _steps(views, _OBS)
    if all(g is None for g in cot):
        like = dict(dtype=dtype, device=dev)
        return (torch.zeros(B, T, C, **like), torch.zeros(3, B, T if obs_step else 1, C, **like),
                torch.zeros(2, B, T if trans_step else 1, C, **like), torch.zeros(B, 2, C, **like))
    if config.tile_bwd and uses_tiles(T, C, config):
        ns, L = tile_plan(T, config)
        grid = (ns, B * C)
        opts = dict(TILE=config.tile, ROW=config.tile_row, num_warps=config.tile_warps,
                    WIDE=4 * B * T * C >= config.wide_from)
        agg_kernel, bwd_kernel = filter_tile_bwd_agg_kernel, filter_tile_bwd_kernel
    else:
        ns, L = plan(B, T, C, config)
        grid, opts = launch(B, T, C, ns, config)
        opts["UNROLL"] = config.bwd_unroll
        agg_kernel, bwd_kernel = filter_bwd_agg_kernel, filter_bwd_kernel
    args = _kernel_args(views)
    dummy = torch.empty(1, dtype=dtype, device=dev)
    g = [dummy if x is None else x.contiguous() for x in cot]
    flags = dict(TRANS_STEP=trans_step, OBS_STEP=obs_step, HAS_G_MU=cot[0] is not None,
                 HAS_G_LAM=cot[1] is not None, HAS_G_PM=cot[2] is not None, HAS_G_PV=cot[3] is not None)
    top = torch.zeros(B, 2, ns, C, dtype=dtype, device=dev)
    if ns > 1:
        agg = torch.empty(B, 5, ns, C, dtype=dtype, device=dev)
        agg_kernel[grid](*args, mu, lam, init, *g, agg, T, C, ns, L, **flags, **opts)
        filter_bwd_carry_kernel[(B * C,)](agg, top, C, ns, CH=min(config.carry_chunk, next_power_of_2(ns - 1)),
                                          num_warps=config.carry_warps)
    grad_y = torch.empty(B, T, C, dtype=dtype, device=dev)
    obs_grad = torch.empty((3, B, T, C) if obs_step else (1,), dtype=dtype, device=dev)
    trans_grad = torch.empty((2, B, T, C) if trans_step else (1,), dtype=dtype, device=dev)
    sums = torch.empty(B, 5, ns, C, dtype=dtype, device=dev)
    grad_init = torch.empty(B, 2, C, dtype=dtype, device=dev)
    bwd_kernel[grid](*args, mu, lam, init, *g, top, grad_y, obs_grad, trans_grad, sums, grad_init,
                     B, T, C, ns, L, **flags, **opts)
    totals = sums.sum(2, keepdim=True).transpose(0, 1)
    obs_grad = obs_grad if obs_step else totals[:3]
    trans_grad = trans_grad if trans_step else totals[3:]
    return grad_y, obs_grad, trans_grad, grad_init


def filter(p: Problem, config: FilterConfig = DEFAULT_CONFIG) -> dict:
    """Filter the validated problem ``p`` with the fused kernels; the contract of every backend's
    ``filter`` (:mod:`kalmanscan.ops.filter`).

    Differentiable with respect to ``y``, every parameter and the initial belief. When nothing
    needs a gradient, one kernel pass writes every field of the result (no torch passes after it).
    A problem with no process noise where ``decay < 1`` (``sigma = 0``, or a noise below
    :data:`kalmanscan.model.mobius.NO_NOISE`) runs on the torch backend instead: its precision grows like
    ``decay^(-2t)``, past the range of the kernels, which carry it (see :mod:`kalmanscan.model.mobius`).
    ``config`` sets the launch (:class:`FilterConfig`). With ``p.y_check``, for a ``y`` of more
    than :data:`kalmanscan.problem.checks.BY_RESULT` elements, ``"y_check"``: ``y``'s inf check queued with
    the kernels (:func:`filter_forward`, or :func:`kalmanscan.problem.checks.queue_y_sum` before them).
    """
    shape = p.shape
    check_device(p.y)
    if p.no_process_noise():
        return torch_backend.filter(p)
    init = initial_state(p)
    inputs = (p.y, p.theta, p.sigma, p.dt, p.obs_var, p.mean, p.h)
    decay, noise = p.decay_noise()
    from kalmanscan.ops.filter.triton.library import filter_fused, filter_posterior  # (it imports this module)

    y_check = p.y_check and p.y.numel() > checks.BY_RESULT and not torch.compiler.is_compiling()
    if not (torch.is_grad_enabled() and any(x.requires_grad for x in inputs + (init,))):
        fields = POSTERIOR if p.outputs is None else tuple(k for k in POSTERIOR if k in p.outputs)
        if torch.compiler.is_compiling():  # one opaque operator for the compiler (library module docstring)
            values = filter_posterior(*inputs, init, list(shape), config.as_ints(), posterior_mask(fields))
            return {**dict(zip(fields, values)), "decay": decay, "noise": noise}
        views = {k: flat(x, shape) for k, x in zip(_ORDER, inputs)}
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
        return {**out, "decay": decay, "noise": noise}

    queued = checks.queue_y_sum(p.y) if y_check else None
    mu_c, lam, pred_mu_c, pred_var = filter_fused(*inputs, init, list(shape), config.as_ints())
    missing = torch.isnan(p.y)
    out = torch_backend.finish(p, *(x.reshape(shape) for x in (mu_c, lam, pred_mu_c, pred_var)), missing, decay, noise)
    return out if queued is None else {**out, "y_check": queued}


def initial_state(p: Problem) -> torch.Tensor:
    """``init`` of the kernels, ``(B, 2, C)`` contiguous: the initial precision and information
    mean of every series (:meth:`kalmanscan.problem.prepare.Problem.initial_info`)."""
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
    views = [flat(f[k], shape) for k in _RTS_FIELDS] + [flat(mean_param, shape)]
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
    filter_agg_kernel[grid](*_kernel_args(views), agg, T, C, ns, stretch, TRANS_STEP=_steps(views, _TRANS),
                            OBS_STEP=_steps(views, _OBS), **opts)
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
