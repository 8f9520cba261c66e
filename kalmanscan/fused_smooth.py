"""The ``"triton"`` smoother: the reverse walks of :mod:`kernels.smooth_rts` over the filter's output.

:func:`kalmanscan.smooth` runs it when the filter ran on the triton backend and nothing needs a
gradient (with gradients the smoother's two reverse scans run in torch, differentiable by
autograd, :func:`kalmanscan.smooth.rts_torch`). Stretches, lanes and launch options are the
filter's (:func:`kalmanscan.fused.plan`); the carry between stretches is the filter backward's
reverse scan of five-number affine maps.
"""

from __future__ import annotations

import math

import torch

from kernels.filter_bwd import filter_bwd_carry_kernel
from kernels.smooth_rts import rts_agg_kernel, rts_kernel

from . import fused
from .launch import next_power_of_2

__all__ = ["rts_triton"]

_FIELDS = ("mean", "var", "pred_mean", "pred_var", "decay", "noise")


def rts_triton(f: dict, mean_param, stretch: int | None = None):
    """Smoothed ``(mean, var, precision)``, each ``(..., T, C)``, from the filter's tensors ``f``
    (``mean, var, pred_mean, pred_var, decay, noise``, broadcastable to ``(..., T, C)``) and the
    model's mean parameter; same contract as :func:`kalmanscan.smooth.rts_torch` (which returns
    no precision). ``stretch`` forces the steps per stretch, as for the filter."""
    shape = tuple(f["mean"].shape)
    views = [fused._flat(f[k], shape) for k in _FIELDS] + [fused._flat(mean_param, shape)]
    B, T, C = math.prod(shape[:-2]), shape[-2], shape[-1]
    dtype, dev = views[0].dtype, views[0].device
    ns, L = fused.plan(B, T, C, stretch)
    grid, opts = fused._launch(B, T, C, ns)
    args = [a for x in views for a in (x, *x.stride())]
    top = torch.zeros(B, 2, ns, C, dtype=dtype, device=dev)
    if ns > 1:
        agg = torch.empty(B, 5, ns, C, dtype=dtype, device=dev)
        rts_agg_kernel[grid](*args, agg, T, C, ns, L, **opts)
        filter_bwd_carry_kernel[(B * C,)](agg, top, C, ns, CH=min(fused.CARRY_CHUNK, next_power_of_2(ns - 1)),
                                          num_warps=fused.CARRY_WARPS)
    out = [torch.empty(B, T, C, dtype=dtype, device=dev) for _ in range(3)]
    rts_kernel[grid](*args, top, *out, T, C, ns, L, **opts)
    return tuple(x.reshape(shape) for x in out)
