"""Launch wrappers of the filter's walking kernels (:mod:`kalmanscan.kernels.filter`): the plan of
stretches and lanes, the ``(B, T, C)`` views of a problem's inputs, the forward
(:func:`filter_forward`, every field of the posterior or the few the backward reads) and its
backward (:func:`filter_backward`). The backend (:mod:`kalmanscan.ops.filter.triton.backend`) and
the autograd operators (:mod:`kalmanscan.ops.filter.triton.library`) both launch through them.
Launch options come from a :class:`~kalmanscan.ops.filter.triton.config.FilterConfig`."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from kalmanscan.kernels.filter.bwd import filter_bwd_agg_kernel, filter_bwd_carry_kernel, filter_bwd_kernel
from kalmanscan.kernels.filter.fwd import filter_agg_kernel, filter_carry_kernel, filter_fwd_kernel
from kalmanscan.kernels.filter.tiles import filter_tile_agg_kernel, filter_tile_fwd_kernel
from kalmanscan.kernels.filter.tiles_bwd import filter_tile_bwd_agg_kernel, filter_tile_bwd_kernel

from kalmanscan.problem import checks
from kalmanscan.problem.problem import Problem
from kalmanscan.ops.launch import cdiv, next_power_of_2
from kalmanscan.ops.filter.triton.config import DEFAULT_CONFIG, FilterConfig

__all__ = ["plan", "flat", "tile_plan", "uses_tiles", "kernel_views", "kernel_args", "time_varying", "step_flags",
           "launch", "fwd_opts", "agg_opts", "check_device", "POSTERIOR", "filter_forward", "posterior_mask",
           "replayed", "filter_backward", "ORDER", "TRANS", "OBS", "ONE_BLOCK_OUTPUTS", "REPLAY_ELEMENTS",
           "LOGLIK_SUM"]

TRANS = ("theta", "sigma", "dt")
OBS = ("obs_var", "mean", "h")
ORDER = ("y",) + TRANS + OBS
"""The inputs of the walking kernels in their pointer order: ``y``, the transition's and the
observation's parameters."""


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
    return {k: flat(getattr(p, k).detach(), p.shape) for k in ORDER}


def kernel_args(views: dict[str, torch.Tensor]) -> list:
    """Pointer and ``(batch, time, channel)`` strides of each input, in kernel order."""
    return [a for name in ORDER for a in (views[name], *views[name].stride())]


def time_varying(views: dict[str, torch.Tensor], names: Sequence[str]) -> bool:
    """Whether any of ``names`` varies along time (its time stride is non-zero)."""
    return any(views[n].stride(1) != 0 and views[n].shape[1] > 1 for n in names)


def step_flags(views: dict[str, torch.Tensor]) -> tuple[bool, bool]:
    """``(trans_step, obs_step)``: whether any of ``theta, sigma, dt`` / ``obs_var, mean, h`` in the
    ``(B, T, C)`` views varies along time (the kernels' ``TRANS_STEP``/``OBS_STEP``)."""
    return time_varying(views, TRANS), time_varying(views, OBS)


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
LOGLIK_SUM = 1 << len(POSTERIOR)
"""The kernels' ``POSTERIOR`` bit of ``"loglik"``, the log-likelihood's sum over time alone: each
step's term computed and summed in the kernel, none written (:func:`posterior_mask`)."""


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
    With ``"loglik"`` among them, or ``"logliks"`` and ``loglik_sum``, the forward also returns
    ``"loglik"``, the sum over time ``(B, C)``: each stretch's sum accumulated in float64 by the
    kernel, the stretches summed after it, in ``y``'s dtype; ``"loglik"`` without ``"logliks"``
    writes no per-step terms (:data:`LOGLIK_SUM`: a default call pays for the mean and variance and
    this sum). ``one_block``: small outputs may share one allocation (:func:`_outputs`; not for an
    operator's returns, which must not alias).
    ``y_check``: also ``"y_check"``, ``y``'s inf check queued with the kernels
    (:class:`kalmanscan.problem.checks.Ahead`): with stretches, the sum of the stretch products' ``e1, e2``
    read after the aggregate pass (an ``inf`` in ``y`` leaves its stretch's ``e1`` or ``e2`` inf or
    NaN: ``info = h (y - h mean) / obs_var`` enters both, scaled by finite non-negative numbers, and
    nothing in a product makes a non-finite number finite again; a sum that overflows only sends
    :func:`~kalmanscan.problem.checks.decide_y` to search ``y``); else ``nansum(y)`` queued before
    them.
    """
    if posterior is True:
        posterior = POSTERIOR
    fields = bool(posterior)  # the Posterior's fields (or its log-likelihood's sum), not the centred moments
    sums = fields and ("loglik" in posterior or (loglik_sum and "logliks" in posterior))
    posterior = tuple(k for k in POSTERIOR if fields and k in posterior)
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
        opts.update(fwd_opts(config, fields))
        agg_kernel, fwd_kernel = filter_agg_kernel, filter_fwd_kernel
    more = {} if tiles else agg_opts(config, opts["BLOCK"])
    dtype, dev = y.dtype, y.device
    args = kernel_args(views)
    flags = dict(TRANS_STEP=time_varying(views, TRANS), OBS_STEP=time_varying(views, OBS))
    mask = posterior_mask(posterior) | (LOGLIK_SUM if sums else 0)
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
            queued = checks.Ahead(agg[:, 4:6].sum())  # one reduction, no float64 copy of its input
        filter_carry_kernel[(B * C,)](agg, init, start, C, ns, CH=min(config.carry_chunk, next_power_of_2(ns - 1)),
                                      num_warps=config.carry_warps)
    out, pointers, write = _outputs(y, outputs, posterior, fields, out_shape, one_block)
    partial = torch.empty(B, ns, C, dtype=torch.float64, device=dev) if sums else None
    if sums:
        opts.update(loglik_sum_ptr=partial, SUM_LOGLIK=True)
    fwd_kernel[grid](*args, start, *fast, *pointers, T, C, ns, r, **flags, **write, POSTERIOR=mask, **opts)
    result = {k: out[k] for k in (posterior if fields else outputs)}
    if partial is not None:
        result["loglik"] = (partial[:, 0] if ns == 1 else partial.sum(1)).to(dtype)
    if queued is not None:
        result["y_check"] = queued
    return result


def posterior_mask(fields: Iterable[str]) -> int:
    """The kernels' ``POSTERIOR`` bit mask of ``fields`` (names of :data:`POSTERIOR`, and
    ``"loglik"``: :data:`LOGLIK_SUM`)."""
    fields = tuple(fields)
    return sum(1 << i for i, k in enumerate(POSTERIOR) if k in fields) | (LOGLIK_SUM if "loglik" in fields else 0)


ONE_BLOCK_OUTPUTS = 1 << 22
REPLAY_ELEMENTS = 1 << 22


def replayed(shape: Sequence[int], fields: Sequence[str], config: FilterConfig = DEFAULT_CONFIG) -> bool:
    """Whether a forward call without gradients (its problem's ``shape`` and the ``fields`` it
    writes) goes through :mod:`kalmanscan.ops.filter.triton.replay`: its per-step outputs fit in
    one block (:data:`ONE_BLOCK_OUTPUTS` elements), or it is a few long series (the tiles,
    :func:`uses_tiles`) of at most :data:`REPLAY_ELEMENTS` elements, whose launches take the host
    longer than the kernels take the device (at ``2^24`` steps replay gained nothing,
    docs/performance.md)."""
    n = math.prod(shape)
    per_step = sum(k in POSTERIOR for k in fields)
    return per_step * n <= ONE_BLOCK_OUTPUTS or (uses_tiles(shape[-2], shape[-1], config) and n <= REPLAY_ELEMENTS)


def _outputs(y, outputs, posterior, fields, out_shape=None, one_block=False):
    """``(out, pointers, flags)`` of the forward kernels: the ``(B, T, C)`` output tensors, the ten
    output pointers in kernel order (``y``'s for those not written, never written through) and
    the ``WRITE_*`` flags: the fields of :data:`POSTERIOR` named in ``posterior`` when ``fields``
    (possibly none: a log-likelihood summed alone), else the centred ``outputs``. The predicted mean and
    variance are written together (one flag), so asking for one allocates both. With
    ``one_block``, fields of at most :data:`ONE_BLOCK_OUTPUTS` elements in all share one
    allocation (views of it: a small call's fixed cost; a field kept alone keeps the others'
    memory, at most that many elements)."""
    B, T, C = y.shape
    like = dict(dtype=y.dtype, device=y.device)
    names_all = POSTERIOR if fields else ("mu", "lam", "pred_mu", "pred_var")
    wanted = set(posterior if fields else outputs)
    if not fields and wanted & {"pred_mu", "pred_var"}:
        wanted |= {"pred_mu", "pred_var"}
    names = [k for k in names_all if k in wanted]
    shape = tuple(out_shape or (B, T, C))
    if one_block and len(names) > 1 and len(names) * B * T * C <= ONE_BLOCK_OUTPUTS:
        out = dict(zip(names, torch.empty((len(names),) + shape, **like).unbind(0)))
    else:
        out = {k: torch.empty(shape, **like) for k in names}
    dummy = y  # the pointer of a field not written: never written through (its flag is off)
    pointers = [out.get(k, dummy) for k in names_all] + ([] if fields else [dummy] * 6)
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
    trans_step, obs_step = time_varying(views, TRANS), time_varying(views, OBS)
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
    args = kernel_args(views)
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
