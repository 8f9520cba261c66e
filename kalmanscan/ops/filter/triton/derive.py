"""The triton backend's derived Posterior fields: the fields of :mod:`kalmanscan.inference.derived`
from a filter's mean and variance in one kernel pass (:mod:`kalmanscan.kernels.filter.derive`),
writing only the fields asked for. Without gradient: the derivation keeps its torch operations
where one is tracked."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kalmanscan.kernels.filter.derive import derive_fields_kernel
from kalmanscan.ops.filter.triton.walks import check_device, flat
from kalmanscan.ops.launch import cdiv, next_power_of_2
from kalmanscan.problem.problem import Problem

__all__ = ["FIELDS", "derived_fields"]

FIELDS = ("precision", "pred_mean", "pred_var", "pred_precision", "pred_obs_mean", "pred_obs_var", "logliks",
          "missing")
"""The fields the kernel writes, in its pointer order (bit ``1 << i`` of its ``FIELDS`` mask)."""

_TILE = 1024
"""Elements per program: ``BLOCK_C`` channels (at most 128, contiguous) by ``BLOCK_T`` steps."""


def derived_fields(p: Problem, mean: torch.Tensor, var: torch.Tensor,
                   fields: Sequence[str] = FIELDS) -> dict[str, torch.Tensor]:
    """The named :data:`FIELDS` of ``p``'s filter as new contiguous ``p.shape`` tensors of
    ``mean``'s dtype (float32 or float64), from the filtered ``mean`` and ``var`` (broadcastable to
    ``p.shape``), ``y``, the OU mean level, ``h``, ``obs_var``, the transitions
    (:meth:`Problem.decay_noise`) and the initial belief: the values of the derivation's torch
    operations, to rounding. One launch on CUDA tensors (or on the CPU under
    ``TRITON_INTERPRET=1``); nothing given is written; no gradient."""
    check_device(p.y)
    shape, dtype = tuple(p.shape), mean.dtype
    B, T, C = math.prod(shape[:-2]), shape[-2], shape[-1]
    decay, noise = p.decay_noise()
    steps = [flat(x.detach(), shape) for x in (p.y, mean, var, p.mean, p.h, p.obs_var, decay, noise)]
    inits = [flat(x.detach(), shape) for x in (p.init_mean, p.init_var)]
    out = {k: torch.empty(shape, dtype=dtype, device=mean.device) for k in FIELDS if k in fields}
    if B == 0:
        return out
    block_c = min(128, next_power_of_2(C))
    block_t = min(_TILE // block_c, next_power_of_2(T))
    reach = max([B * T * C] + [sum((n - 1) * s for n, s in zip(x.shape, x.stride())) + 1 for x in steps + inits])
    args = [a for x in steps for a in (x, *x.stride())] + [a for x in inits for a in (x, x.stride(0), x.stride(2))]
    pointers = [out.get(k, steps[1]) for k in FIELDS]  # a field not asked for: never written through
    grid = (B * cdiv(T, block_t) * cdiv(C, block_c),)
    derive_fields_kernel[grid](*args, *pointers, T, C, FIELDS=sum(1 << i for i, k in enumerate(FIELDS) if k in out),
                               BLOCK_T=block_t, BLOCK_C=block_c, WIDE=reach >= 1 << 31, num_warps=4)
    return out
