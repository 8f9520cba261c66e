"""Collectives for the sequence-parallel scans: a differentiable all-gather and input agreement.

Every function here is collective: all ranks of ``group`` must call it in the same order with
tensors of the same shape, dtype and kind of device (CUDA for NCCL, CPU for gloo).

Autograd. ``torch.distributed.all_gather`` records no gradient. :func:`all_gather` does: its
backward sums the incoming gradients of the gathered stack over the ranks (one ``all_reduce``)
and returns each rank its own slot, the adjoint of a gather. A gradient that rank ``r`` sends to
the summary of rank ``j < r`` is the adjoint of ``r``'s carry pulled back through the prefix, so
this one exchange carries the adjoint summaries backwards in rank order. Because the backward is
a collective too, every rank must run backward through its outputs whenever one does (as with
``DistributedDataParallel``); :func:`tie` makes sure each rank's outputs depend on every gather,
so no rank skips one.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any


import torch
import torch.distributed as dist

__all__ = ["rank_world", "all_gather", "tie", "agree", "fingerprint"]


def rank_world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(rank, world_size)`` of this process in ``group`` (the default group when ``None``).

    Raises ``ValueError`` when ``torch.distributed`` is not initialised.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("group: torch.distributed is not initialised (call init_process_group first)")
    return dist.get_rank(group), dist.get_world_size(group)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        _, world = rank_world(group)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        rank, _ = rank_world(ctx.group)
        return grad[rank], None


def all_gather(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Stack of every rank's ``x``: shape ``(world, *x.shape)``, index = rank; differentiable."""
    return _AllGather.apply(x, group)


class _Tie(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, *xs):
        ctx.anchor_shape = anchor.shape
        ctx.anchor_dtype = anchor.dtype
        ctx.anchor_device = anchor.device
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        zero = torch.zeros(ctx.anchor_shape, dtype=ctx.anchor_dtype, device=ctx.anchor_device)
        return (zero, *grads)


def tie(anchor: torch.Tensor, xs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``xs`` unchanged, but recorded as depending on ``anchor`` (with a zero gradient).

    The backward of a gather is collective; tying a rank's outputs to a gathered tensor its
    results do not otherwise depend on (rank 0 uses no carry) makes every rank reach that
    backward, and tying the input of a later gather to an earlier one fixes the order in which
    the backward collectives run, the same on every rank. Every floating-point tensor of ``xs``
    is tied, also one needing no gradient of its own: when another rank needs gradients, this
    rank's outputs must lead to the collective backward too.
    """
    keys = [k for k, v in xs.items() if isinstance(v, torch.Tensor) and v.dtype.is_floating_point]
    if not keys or not anchor.requires_grad:
        return xs
    tied = _Tie.apply(anchor, *(xs[k] for k in keys))
    return dict(xs, **dict(zip(keys, tied)))


def agree(check: Callable[[], Any], info: Callable[[Any], Sequence[float]], size: int, device: torch.device,
          group: dist.ProcessGroup | None = None) -> tuple[Any, torch.Tensor]:
    """Run the local validation ``check()`` and agree with the other ranks on its outcome.

    ``check`` returns any value or raises ``ValueError``; ``info(value)`` returns ``size`` floats
    (e.g. whether this rank needs gradients). One small ``all_gather`` of ``[failed, *info]``
    follows, so a bad input on one rank raises ``ValueError`` on every rank instead of leaving the
    others waiting in a later collective. Returns ``(value, infos)``, ``infos`` a float64 CPU
    tensor of shape ``(world, size)``.
    """
    _, world = rank_world(group)
    error, value, row = None, None, [1.0] + [0.0] * size
    try:
        value = check()
        row = [0.0, *(float(x) for x in info(value))]
    except ValueError as exc:
        error = exc
    if len(row) != size + 1:
        raise ValueError(f"info must return {size} numbers, got {len(row) - 1}")
    gathered = all_gather(torch.tensor(row, dtype=torch.float64, device=device), group).cpu()
    failed = [r for r in range(world) if gathered[r, 0] > 0]
    if error is not None:
        raise error
    if failed:
        raise ValueError(f"invalid input on rank {failed[0]} of the group (it raised there)")
    return value, gathered[:, 1:]


def fingerprint(*values: Any) -> float:
    """A number that equals another rank's exactly when ``values`` (shapes, dtypes: anything
    with a stable ``repr``) are equal: their CRC-32, exact in the float64 rows of :func:`agree`."""
    return float(zlib.crc32(repr(values).encode()))
