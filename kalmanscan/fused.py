"""The ``"triton"`` backend of :func:`kalmanscan.filter`: launch wrappers and autograd.

Forward (:mod:`kernels.filter_fwd`): every (stretch of time, channel) lane walks its stretch
sequentially, building each step's decay, noise and observation terms in registers from ``y`` and
the parameters (static or per step, read through their strides: no leaf tensor is written). Long
series are split into ``NS`` stretches across programs through the merged homogeneous form
(aggregate, carry, apply); :func:`plan` picks ``NS`` from the shape. Backward
(:mod:`kernels.filter_bwd`): the same lanes walk backwards with the scalar adjoints, reading the
forward's filtered mean and precision back as the per-step state; gradients for ``y``, ``theta``,
``sigma``, ``dt``, ``obs_var``, ``mean``, ``h`` and the initial state. Static parameters get
per-lane sums inside the kernel; the last step from ``(decay, noise, phi, info)`` adjoints to the
user's parameters is the derivative of :func:`kalmanscan.ou.discretize` and of
``phi = h^2 / obs_var``, ``info = (h / obs_var)(y - h mean)``, taken by torch autograd on
``(..., 1 or T, C)`` tensors. With :data:`TILE_BWD` on (the default), few long series (the forward's tile regime,
:func:`uses_tiles`) run backwards time-parallel too (:mod:`kernels.filter_tiles_bwd`). With
:data:`CHAIN` on (opt-in), the forward of many series is one chained kernel instead of three
(:mod:`kernels.filter_chain`: aggregate, decoupled look-back and apply per stretch).

Arithmetic is in the compute dtype of the problem: float32 (half-precision inputs are promoted by
:mod:`kalmanscan.inputs`), or float64 for float64 inputs. Runs on CUDA tensors, or on the CPU under
``TRITON_INTERPRET=1`` (the tests). Index arithmetic is 32-bit while ``4 B T C`` (more than the largest
array a walking kernel indexes, the backward's ``(3, B, T, C)`` per-step observation adjoints) is
below ``WIDE_FROM = 2^31``, 64-bit from there on.
"""

from __future__ import annotations

import math
import os

import torch

from kernels.filter_bwd import filter_bwd_agg_kernel, filter_bwd_carry_kernel, filter_bwd_kernel
from kernels.filter_chain import filter_chain_kernel
from kernels.filter_fwd import filter_agg_kernel, filter_carry_kernel, filter_fwd_kernel
from kernels.filter_tiles import filter_tile_agg_kernel, filter_tile_fwd_kernel
from kernels.filter_tiles_bwd import filter_tile_bwd_agg_kernel, filter_tile_bwd_kernel

from . import mobius, ou
from .inputs import Problem
from .launch import cdiv, next_power_of_2
from .parallel import filter_torch, finish

__all__ = ["filter_triton", "filter_forward", "plan"]

TARGET_LANES = 1 << 18      # enough (stretch, channel) lanes to fill an H100 with one-warp programs
MIN_STRETCH = 64            # shortest stretch worth an aggregate pass
MAX_STRETCHES = 16384       # bound on the carry scan's length
BLOCK = 128                 # lanes per program (one warp, 4 lanes per thread) when C >= 32
SMALL_C_BLOCK = 32          # lanes per program when C < 32 (lanes are then mostly stretches)
NUM_WARPS = 1
NUM_STAGES = None           # software-pipelining depth of the walks (None: Triton's default)
PREFETCH = True             # forward walks load y four steps ahead (a register ring)
POSTERIOR_PREFETCH = False  # ... but not the one-pass posterior walk (ten outputs: the ring slowed it)
UNROLL = 4                  # unrolling of the forward walks' time loops
BWD_UNROLL = 1              # the same for the backward walks (unrolling slowed them)
CARRY_CHUNK = 1024          # stretches per step of the carry scan
CARRY_WARPS = 4
WIDE_FROM = 1 << 31         # 64-bit offsets once 4 B T C reaches this (bounds every array a walk indexes)
TILE = 1024                 # steps per tile of the time-parallel forward (lanes along time)
TILE_ROW = 8                # steps per row of a tile, composed in-thread before the scan over rows (a
                            # power of two dividing TILE; 8: 128 rows, one per thread of the 4 warps,
                            # the fewest sm_90 instructions per step, no spills: benchmarks.sass_stats)
TILE_WARPS = 4
TILE_STRETCHES = 1024       # at most this many stretches of tiles per series (one carry chunk)
TILE_MAX_C = 1              # the time-parallel forward serves series of at most this many channels
TILE_BWD = True             # the backward also runs time-parallel (kernels.filter_tiles_bwd, the forward's
                            # tiles and stretches) wherever the forward does (uses_tiles); off, it runs
                            # on the walks (H200, forward+backward at (1, 2^22): 0.207 ms on, 0.374 off)
CHAIN = False               # many series (C >= CHAIN_MIN_C): the single-pass chained forward
                            # (kernels.filter_chain) instead of aggregate, carry and apply; opt-in: on
                            # an H200 at (4096, 32768) 0.649 ms against 0.658 (docs/performance.md)
CHAIN_STRETCH = 64          # its steps per stretch (16 / 32 / 64 / 128: 1.197 / 0.702 / 0.649 / 0.646 ms)
CHAIN_MIN_C = 32            # its lanes are channels only: fewer channels would leave them empty
CHAIN_PUBLISH = 1           # test knob of the look-back (kernels.filter_chain: PUBLISH)
_TRANS = ("theta", "sigma", "dt")
_OBS = ("obs_var", "mean", "h")
_ORDER = ("y",) + _TRANS + _OBS


def plan(B: int, T: int, C: int, stretch: int | None = None) -> tuple[int, int]:
    """``(NS, L)``: number of stretches and steps per stretch for a ``(B, T, C)`` problem.

    By default enough stretches for about ``TARGET_LANES`` lanes, each at least ``MIN_STRETCH``
    steps long, at most ``MAX_STRETCHES`` of them; ``stretch`` forces ``L`` (the tests use it to
    cross many stretch boundaries on small problems).
    """
    if stretch is None:
        ns = max(1, min(cdiv(TARGET_LANES, B * C), T // MIN_STRETCH, MAX_STRETCHES))
        stretch = cdiv(T, ns)
    stretch = max(1, min(int(stretch), T))
    return cdiv(T, stretch), stretch


def _flat(x, shape):
    """``x`` (``(..., 1 or T, C or 1)``) broadcast to ``shape`` and viewed as ``(B, T, C)``."""
    B = math.prod(shape[:-2])
    return torch.broadcast_to(x, shape).reshape(B, shape[-2], shape[-1])


def tile_plan(T: int) -> tuple[int, int]:
    """``(NS, R)`` of the time-parallel forward: ``NS`` stretches of ``R`` tiles of ``TILE`` steps,
    ``NS <= TILE_STRETCHES``."""
    tiles = cdiv(T, TILE)
    r = cdiv(tiles, min(tiles, TILE_STRETCHES))
    return cdiv(tiles, r), r


def uses_tiles(T: int, C: int, stretch: int | None = None) -> bool:
    """Whether the forward runs time-parallel (lanes along time): few channels, at least a tile of
    steps, and no stretch length forced."""
    return stretch is None and C <= TILE_MAX_C and T >= TILE


def _kernel_args(views):
    """Pointer and ``(batch, time, channel)`` strides of each input, in kernel order."""
    args = []
    for name in _ORDER:
        x = views[name]
        args += [x, *x.stride()]
    return args


def _steps(views, names):
    """Whether any of ``names`` varies along time (its time stride is non-zero)."""
    return any(views[n].stride(1) != 0 and views[n].shape[1] > 1 for n in names)


def _launch(B, T, C, ns):
    """Grid and launch options of the walking kernels (``WIDE``: 64-bit offsets); the forward
    ones add ``fwd_opts()``, the backward ones ``UNROLL=BWD_UNROLL``."""
    block = min(SMALL_C_BLOCK if C < 32 else BLOCK, next_power_of_2(ns * C))
    opts = dict(BLOCK=block, num_warps=NUM_WARPS, WIDE=4 * B * T * C >= WIDE_FROM)
    if NUM_STAGES is not None:
        opts["num_stages"] = NUM_STAGES
    return (cdiv(ns * C, block), B), opts


def fwd_opts(posterior=False):
    """Constexpr options of the forward walks (read at launch, so the benchmarks can sweep them)."""
    return dict(UNROLL=UNROLL, PREFETCH=POSTERIOR_PREFETCH if posterior else PREFETCH)


def _check_device(y):
    if y.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU); "
                         f"y is on {y.device}")


POSTERIOR = ("mean", "precision", "pred_mean", "pred_var", "var", "pred_precision", "pred_obs_mean",
             "pred_obs_var", "logliks", "missing")  # in the kernel's pointer order


def filter_forward(views, init, outputs=("mu", "lam", "pred_mu", "pred_var"), stretch=None,
                   posterior=False):
    """Launch the fused forward on ``(B, T, C)`` views; returns ``{name: (B, T, C) tensor}``.

    ``views`` maps ``y, theta, sigma, dt, obs_var, mean, h`` to ``(B, T, C)`` tensors (broadcast
    views are fine); ``init`` is ``(B, 2, C)``: initial precision and information mean ``lam0,
    eta0 = lam0 (init_mean - mean_0)``. Only the named centred outputs are written; with
    ``posterior`` the fields of :data:`POSTERIOR` instead (those of
    :func:`kalmanscan.parallel.finish`, in one pass).
    """
    y = views["y"]
    B, T, C = y.shape
    tiles = uses_tiles(T, C, stretch)
    if CHAIN and not tiles and C >= CHAIN_MIN_C:
        return _chain_forward(views, init, outputs, stretch, posterior)
    if tiles:
        ns, r = tile_plan(T)
        grid = (ns, B * C)
        opts = dict(TILE=TILE, ROW=TILE_ROW, num_warps=TILE_WARPS, WIDE=B * T * C >= WIDE_FROM)
        agg_kernel, fwd_kernel = filter_tile_agg_kernel, filter_tile_fwd_kernel
    else:
        ns, r = plan(B, T, C, stretch)
        grid, opts = _launch(B, T, C, ns)
        opts.update(fwd_opts(posterior))
        agg_kernel, fwd_kernel = filter_agg_kernel, filter_fwd_kernel
    dtype, dev = y.dtype, y.device
    args = _kernel_args(views)
    flags = dict(TRANS_STEP=_steps(views, _TRANS), OBS_STEP=_steps(views, _OBS))
    start = torch.empty(B, 2, ns, C, dtype=dtype, device=dev)
    start[:, :, 0, :] = init
    if ns > 1:
        agg = torch.empty(B, 7, ns, C, dtype=dtype, device=dev)
        agg_kernel[grid](*args, agg, T, C, ns, r, **flags, **opts)
        filter_carry_kernel[(B * C,)](agg, start, C, ns, CH=min(CARRY_CHUNK, next_power_of_2(ns - 1)),
                                      num_warps=CARRY_WARPS)
    out, pointers, write = _outputs(y, outputs, posterior)
    fwd_kernel[grid](*args, start, *pointers, T, C, ns, r, **flags, **write, POSTERIOR=posterior, **opts)
    return {k: out[k] for k in (POSTERIOR if posterior else outputs)}


def _outputs(y, outputs, posterior):
    """``(out, pointers, flags)`` of the forward kernels: the ``(B, T, C)`` output tensors, the ten
    output pointers in kernel order (a one-element dummy for those not written) and the
    ``WRITE_*`` flags. The predicted mean and variance are written together (one flag), so asking
    for one allocates both."""
    B, T, C = y.shape
    like = dict(dtype=y.dtype, device=y.device)
    names = POSTERIOR if posterior else ("mu", "lam", "pred_mu", "pred_var")
    wanted = set(names if posterior else outputs)
    if wanted & {"pred_mu", "pred_var"}:
        wanted |= {"pred_mu", "pred_var"}
    out = {k: torch.empty(B, T, C, **like) for k in names if k in wanted}
    dummy = torch.empty(1, **like)
    pointers = [out.get(k, dummy) for k in names] + ([] if posterior else [dummy] * 6)
    return out, pointers, dict(WRITE_MU="mu" in out, WRITE_LAM="lam" in out, WRITE_PRED="pred_mu" in out)


def _chain_forward(views, init, outputs, stretch, posterior):
    """:func:`filter_forward` through :mod:`kernels.filter_chain` (stretches of ``CHAIN_STRETCH``
    steps unless ``stretch`` is given)."""
    y = views["y"]
    B, T, C = y.shape
    L = max(1, min(int(stretch or CHAIN_STRETCH), T))
    ns = cdiv(T, L)
    block = min(BLOCK, next_power_of_2(C))
    ncb = cdiv(C, block)
    dtype, dev = y.dtype, y.device
    start = torch.empty(B, 2, ns + 1, C, dtype=dtype, device=dev)
    start[:, :, 0, :] = init
    agg = torch.empty(B, 7, ns, C, dtype=dtype, device=dev)
    flags = torch.zeros(B, ns, ncb, dtype=torch.int32, device=dev)
    ticket = torch.zeros(1, dtype=torch.int32, device=dev)
    out, pointers, write = _outputs(y, outputs, posterior)
    filter_chain_kernel[(ns * B * ncb,)](
        *_kernel_args(views), agg, start, flags, ticket, *pointers, B, T, C, ns, L, ncb,
        TRANS_STEP=_steps(views, _TRANS), OBS_STEP=_steps(views, _OBS), **write, POSTERIOR=posterior,
        BLOCK=block, num_warps=NUM_WARPS, WIDE=4 * B * T * C >= WIDE_FROM, PUBLISH=CHAIN_PUBLISH,
        **fwd_opts(posterior))
    return {k: out[k] for k in (POSTERIOR if posterior else outputs)}


def filter_backward(views, init, mu, lam, cot, stretch=None):
    """Launch the backward; returns ``grad_y``, the observation and transition adjoints, init's.

    ``cot`` is a sequence of four cotangents, of ``(mu, lam, pred_mu, pred_var)``: each a
    ``(B, T, C)`` tensor or ``None`` (absent: the output was not used; a ``(4, B, T, C)`` stack is
    also a sequence of four). Absent ones are never read (the kernels' ``HAS_G_*`` flags); present
    ones are passed as they are when contiguous, else copied. With all four absent every gradient
    is zero and no kernel runs. The observation adjoints ``(d phi, d info, d info * yc)`` come as
    ``(3, B, T, C)`` when any of ``obs_var, mean, h`` is per step, else ``(3, B, 1, C)`` summed over
    time; likewise the transition adjoints ``(d decay, d noise)`` (zero at step 0). With
    :data:`TILE_BWD` on, a problem the forward runs on tiles (:func:`uses_tiles`) runs backwards on
    tiles too (:mod:`kernels.filter_tiles_bwd`: ``L`` is then the tiles per stretch), else on the walks.
    """
    y = views["y"]
    B, T, C = y.shape
    dtype, dev = y.dtype, y.device
    trans_step, obs_step = _steps(views, _TRANS), _steps(views, _OBS)
    if all(g is None for g in cot):
        like = dict(dtype=dtype, device=dev)
        return (torch.zeros(B, T, C, **like), torch.zeros(3, B, T if obs_step else 1, C, **like),
                torch.zeros(2, B, T if trans_step else 1, C, **like), torch.zeros(B, 2, C, **like))
    if TILE_BWD and uses_tiles(T, C, stretch):
        ns, L = tile_plan(T)
        grid = (ns, B * C)
        opts = dict(TILE=TILE, ROW=TILE_ROW, num_warps=TILE_WARPS, WIDE=4 * B * T * C >= WIDE_FROM)
        agg_kernel, bwd_kernel = filter_tile_bwd_agg_kernel, filter_tile_bwd_kernel
    else:
        ns, L = plan(B, T, C, stretch)
        grid, opts = _launch(B, T, C, ns)
        opts["UNROLL"] = BWD_UNROLL
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
        filter_bwd_carry_kernel[(B * C,)](agg, top, C, ns, CH=min(CARRY_CHUNK, next_power_of_2(ns - 1)),
                                          num_warps=CARRY_WARPS)
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


class _FusedFilter(torch.autograd.Function):
    """``(y, theta, sigma, dt, obs_var, mean, h, init) -> (mu, lam, pred_mu, pred_var)``, centred.

    Gradients are not materialised: an output the loss does not use reaches :meth:`backward` as
    ``None`` and the kernels skip its cotangent.
    """

    @staticmethod
    def forward(ctx, y, theta, sigma, dt, obs_var, mean, h, init, shape, stretch):
        inputs = (y, theta, sigma, dt, obs_var, mean, h)
        views = {k: _flat(x.detach(), shape) for k, x in zip(_ORDER, inputs)}
        init = init.detach().contiguous()
        out = filter_forward(views, init, stretch=stretch)
        ctx.shape, ctx.stretch = shape, stretch
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*inputs, init, out["mu"], out["lam"])
        return out["mu"], out["lam"], out["pred_mu"], out["pred_var"]

    @staticmethod
    def backward(ctx, *grads):
        *inputs, init, mu, lam = ctx.saved_tensors
        shape = ctx.shape
        views = {k: _flat(x, shape) for k, x in zip(_ORDER, inputs)}
        grad_y, obs_grad, trans_grad, grad_init = filter_backward(views, init, mu, lam, grads, ctx.stretch)
        y, theta, sigma, dt, obs_var, mean, h = inputs
        param_grads = _chain(shape, dict(theta=theta, sigma=sigma, dt=dt, obs_var=obs_var, mean=mean, h=h),
                             obs_grad, trans_grad, ctx.needs_input_grad[1:7])
        gy = grad_y.reshape(shape).sum_to_size(y.shape) if ctx.needs_input_grad[0] else None
        return (gy, *param_grads, grad_init, None, None)


def _chain(shape, params, obs_grad, trans_grad, needed):
    """Gradients of the user's parameters from the kernel's per-step or summed adjoints.

    ``obs_grad = (d phi, d info, d info * yc)`` and ``trans_grad = (d decay, d noise)`` are
    ``(B, 1 or T, C)`` stacks; the parameters enter through ``phi = h^2 / obs_var``,
    ``info = (h / obs_var)(y - h mean)`` (with ``y - h mean`` as ``yc + h0 mean0 - h mean`` around
    the current values, so no ``y`` is needed here) and :func:`kalmanscan.ou.discretize`.
    """
    names = ("theta", "sigma", "dt", "obs_var", "mean", "h")
    if not any(needed):
        return (None,) * 6
    with torch.enable_grad():
        leaves = {k: params[k].detach().requires_grad_() for k in names}
        x = {k: _flat_time(leaves[k], shape) for k in names}
        decay, noise = ou.discretize(x["theta"], x["sigma"], x["dt"])
        g_phi, g_info, g_info_yc = obs_grad
        h, obs_var, mean = x["h"], x["obs_var"], x["mean"]
        hr = h / obs_var
        shift = (h * mean).detach() - h * mean
        total = (trans_grad[0] * decay).sum() + (trans_grad[1] * noise).sum()
        total = total + (g_phi * hr * h).sum() + (hr * (g_info_yc + shift * g_info)).sum()
        wanted = [leaves[k] for k, n in zip(names, needed) if n]
        got = iter(torch.autograd.grad(total, wanted, allow_unused=True))
    return tuple(next(got) if n else None for n in needed)


def _flat_time(x, shape):
    """``x`` (``(..., 1 or T, C or 1)``) broadcast over batch and channels: ``(B, 1 or T, C)``."""
    B = math.prod(shape[:-2])
    full = shape[:-2] + (x.shape[-2], shape[-1])
    return torch.broadcast_to(x, full).reshape(B, x.shape[-2], shape[-1])


def filter_triton(p: Problem, stretch: int | None = None) -> dict:
    """Filter the validated problem ``p`` with the fused kernels; same contract as ``filter_torch``.

    Differentiable with respect to ``y``, every parameter and the initial belief. When nothing
    needs a gradient, one kernel pass writes every field of the result (no torch passes after it).
    A problem with no process noise where ``decay < 1`` (``sigma = 0``, or a noise below
    :data:`kalmanscan.mobius.NO_NOISE`) runs on the torch backend instead: its precision grows like
    ``decay^(-2t)``, past the range of the kernels, which carry it (see :mod:`kalmanscan.mobius`).
    ``stretch`` overrides the number of steps per stretch (see :func:`plan`).
    """
    shape = p.shape
    _check_device(p.y)
    B, C = math.prod(shape[:-2]), shape[-1]
    bshape = shape[:-2] + (1, C)
    lam0 = (1.0 / p.init_var).expand(bshape).reshape(B, C)
    mu0 = (p.init_mean - p.mean[..., :1, :]).expand(bshape).reshape(B, C)
    init = torch.stack([lam0, lam0 * mu0], 1)
    inputs = (p.y, p.theta, p.sigma, p.dt, p.obs_var, p.mean, p.h)
    decay, noise = p.decay_noise()
    if mobius.no_process_noise(decay, noise):
        return filter_torch(p)
    if not (torch.is_grad_enabled() and any(x.requires_grad for x in inputs + (init,))):
        views = {k: _flat(x, shape) for k, x in zip(_ORDER, inputs)}
        out = filter_forward(views, init.contiguous(), stretch=stretch, posterior=True)
        return {**{k: x.reshape(shape) for k, x in out.items()}, "decay": decay, "noise": noise}
    mu_c, lam, pred_mu_c, pred_var = _FusedFilter.apply(*inputs, init, shape, stretch)
    missing = torch.isnan(p.y)
    return finish(p, *(x.reshape(shape) for x in (mu_c, lam, pred_mu_c, pred_var)), missing, decay, noise)
